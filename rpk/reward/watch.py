"""Reward failures made loud. One failed sample costs only itself (it scores 0 and is
counted), but a run whose reward fails on most samples learns nothing: so each step's
failures are counted by kind for the step line and metrics.jsonl, the first exception
texts of each kind go to `reward_errors.jsonl` as they happen, and `FailureRule` stops
a run whose reward keeps failing. With a judge, each step's judge/rule confusion (and
the cascade's, the rubrics' and the groups' counts: `rpk.reward.hybrid.step_columns`)
and its canaries' verdicts (`rpk.reward.canary`, asked beside the round: `canaries`) go
to metrics.jsonl beside them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rpk.core.records import Prompt, Response, Scored
from rpk.reward.canary import Canaries, CanaryAlarm
from rpk.reward.functions import RewardError
from rpk.reward.hybrid import step_columns, step_counts
from rpk.reward.judge import FAILURE_KINDS as JUDGE_FAILURE_KINDS
from rpk.reward.judge import is_judged
from rpk.reward.stack import RewardStack

ERRORS_FILE = "reward_errors.jsonl"


class RewardFailing(RewardError):
    """The reward failed on too many samples for too many steps in a row."""


@dataclass(frozen=True, slots=True)
class Failure:
    step: int
    kind: str
    data_source: str
    text: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Why the run stops: `steps` bad steps in a row, the last with `failed` of
    `scored` samples failed, and the streak's first failure."""

    steps: int
    failed: int
    scored: int
    first: Failure


class FailureRule:
    """A step is bad when more than `max_frac` of the samples it scored failed; after
    `max_steps` bad steps in a row the run stops. A step that scored nothing breaks the
    streak, like a good one."""

    def __init__(self, max_frac: float, max_steps: int) -> None:
        if not 0 <= max_frac <= 1 or max_steps < 1:
            raise ValueError(f"need 0 <= max_frac <= 1 and max_steps >= 1, got {max_frac}, {max_steps}")
        self.max_frac = max_frac
        self.max_steps = max_steps
        self.streak = 0
        self.first: Failure | None = None  # the streak's first failure

    def observe(self, scored: int, failed: int, first: Failure | None) -> Stop | None:
        """One step's counts (and its first failure); a `Stop` when the run must end."""
        if scored > 0 and failed > self.max_frac * scored:
            assert first is not None, "a step with failures has a first one"
            self.first = self.first or first
            self.streak += 1
        else:
            self.streak, self.first = 0, None
        if self.streak < self.max_steps:
            return None
        assert self.first is not None
        return Stop(self.streak, failed, scored, self.first)


class ErrorLog:
    """`reward_errors.jsonl`: the first `per_kind` failures of each kind, one JSON line
    each, flushed as they happen (the file appears with the first failure)."""

    def __init__(self, path: Path, per_kind: int = 5) -> None:
        self.path = path
        self.per_kind = per_kind
        self.kept: Counter[str] = Counter()
        self._file: IO[str] | None = None
        if path.is_file():  # a resumed run: what its earlier steps logged counts
            for line in path.read_text(encoding="utf-8").splitlines():
                self.kept[json.loads(line)["kind"]] += 1

    def add(self, failure: Failure) -> None:
        if self.kept[failure.kind] >= self.per_kind:
            return
        self.kept[failure.kind] += 1
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        line = {"step": failure.step, "kind": failure.kind,
                "data_source": failure.data_source, "text": failure.text}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class RewardWatch:
    """The run's scorer as the step loop sees it: the reward stack, with each step's
    samples and failures counted (`begin_step` .. `end_step`), failures logged, and
    the rule applied. `aclose` closes the log; the stack belongs to its builder.
    `steps`: the run's, whose first third the canaries' alarm compares against; `note`:
    where the alarm's line goes."""

    def __init__(self, stack: RewardStack, log: ErrorLog, rule: FailureRule, *, steps: int = 0,
                 note: Callable[[str], None] = print) -> None:
        self.stack = stack
        self.log = log
        self.rule = rule
        self.canaries: Canaries | None = None
        if stack.judge is not None and stack.canaries is not None and stack.canary.per_step:
            c = stack.canary
            self.canaries = Canaries(stack.judge, stack.canaries, c.per_step,
                                     CanaryAlarm(steps, c.margin), note)
        self.step = 0
        self.scored = 0
        self.failed: Counter[str] = Counter()
        self.first: Failure | None = None
        self.stop: Stop | None = None
        # The judge has a rule of its own over the judged samples alone: judged rows may
        # be a small share of a step, and a judge failing on all of them must still stop.
        self.judge_rule = (
            FailureRule(rule.max_frac, rule.max_steps) if stack.judge is not None else None
        )
        self.judged = 0
        self.judge_failed = 0
        self.judge_first: Failure | None = None
        self._before: dict[str, float] = {}

    def begin_step(self, step: int) -> None:
        self.step, self.scored, self.first = step, 0, None
        self.judged, self.judge_failed, self.judge_first = 0, 0, None
        self.failed.clear()
        # The judge's counts from here: validation between steps scores through the
        # stack too, and is no step's.
        self._before = self.stack.router.tallies() if self.stack.router is not None else {}

    async def score(self, response: Response) -> Scored:
        return self._count(response, await self.stack.score(response))

    @property
    def groups(self) -> bool:
        """Some rows are judged a group at a time: the round hands them over whole."""
        router = self.stack.router
        return router is not None and router.group is not None

    def by_group(self, prompt: Prompt) -> bool:
        """The row's responses are judged as a group (`rpk.core.protocols.GroupScorer`)."""
        return self.stack.by_group(prompt)

    async def score_group(self, responses: Sequence[Response]) -> list[Scored]:
        scored = await self.stack.score_group(responses)
        return [self._count(r, s) for r, s in zip(responses, scored)]

    async def ask_canaries(self) -> None:
        """The step's canaries (`rpk.reward.canary`): the loop asks them beside the round."""
        if self.canaries is not None:
            await self.canaries.ask()

    def _count(self, response: Response, scored: Scored) -> Scored:
        self.scored += 1
        judge = self.stack.judge
        judged = judge is not None and is_judged(response.prompt, judge.settings.data_sources)
        self.judged += judged
        if scored.error is not None:
            kind, _, text = scored.error.partition(": ")
            failure = Failure(self.step, kind, response.prompt.data_source, text)
            self.failed[kind] += 1
            self.first = self.first or failure
            if judged:
                self.judge_failed += 1
                self.judge_first = self.judge_first or failure
            self.log.add(failure)
        return scored

    def end_step(self) -> dict[str, Any]:
        """The step's columns for metrics.jsonl; the rule's verdict is kept for
        `raise_if_failing`."""
        total = sum(self.failed.values())
        self.stop = self.rule.observe(self.scored, total, self.first)
        if self.judge_rule is not None:
            judge_stop = self.judge_rule.observe(self.judged, self.judge_failed, self.judge_first)
            self.stop = self.stop or judge_stop
        return {
            "reward_scored": self.scored,
            "reward_failed": total,
            **{f"reward_failed_{k}": self.failed[k] for k in self.stack.failure_kinds},
            **self._judge_columns(),
            **(self.canaries.end_step() if self.canaries is not None else {}),
        }

    def _judge_columns(self) -> dict[str, Any]:
        router = self.stack.router
        if router is None:
            return {}
        return step_columns(step_counts(self._before, router.tallies()))

    def raise_if_failing(self) -> None:
        stop = self.stop
        if stop is None:
            return
        first = stop.first
        text = " ".join(first.text.split())  # one line, whatever the exception said
        by_judge = self.stack.judge is not None and first.kind in JUDGE_FAILURE_KINDS
        name = f"the judge {self.stack.judge.settings.model}" if by_judge else (
            self.stack.name_of(first.data_source))
        samples = "judged samples" if by_judge else "samples"
        raise RewardFailing(
            f"reward {name} failed on more than "
            f"{self.rule.max_frac:.0%} of the {samples} in each of the last {stop.steps} steps "
            f"(the last: {stop.failed} of {stop.scored}); first error (step {first.step}, "
            f"data_source {first.data_source!r}): {first.kind}: {text} "
            f"[reward.max_failure_frac={self.rule.max_frac}, "
            f"reward.max_failure_steps={self.rule.max_steps}; more in {self.log.path}]"
        )

    async def aclose(self) -> None:
        self.log.close()
