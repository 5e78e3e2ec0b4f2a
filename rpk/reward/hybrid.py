"""Judge and rule on one row: how a judged row's reward is made (`Hybrid`, a row each in
`MODES`), the router that sends every response its way (`JudgeRouter`), and the
judge/rule confusion counted wherever both scored a row.

- `alone`: the judge's verdict is the reward. With `reward.judge.compare_rules` the rule
  checks the row beside it, for the counts only.
- `weighted`: a `judge=w` term of `reward.functions` (`judge=0.3 builtin=0.7`): the judge
  and the rule terms score the response side by side as it finishes, and the reward is
  w x the judge's + the rule terms' weighted sum. Either part's failure is the sample's,
  as any term's is; the first term's verdict is the sample's `correct`. Rows that are
  not judged get the rule terms alone.
- `cascade`: the rule first; the judge only where the rule says no or cannot score the
  row (its call failed), as FAPO and General-Reasoner put a model verifier behind a
  rule to catch its false negatives. The rule's yes stands; elsewhere the judge's
  verdict is the reward. Counted: the rows sent to the judge and its rescues (rule no,
  judge yes).

The confusion, where both scored a row, takes the rule as the truth: tp (both yes), fp
(judge yes, rule no), tn (both no), fn (judge no, rule yes). fp / (fp + tn) is the
judge's false-positive rate, the share of the answers the rule fails that the judge
passes: what a policy that learns to fool the judge drives up. Under `cascade` the judge
sees rule-no rows only, so there are fp and tn alone, and every rescue is an fp: a
rule's false negative fixed, or the judge fooled. The canaries (`rpk.reward.canary`),
answers known to be wrong, measure the second alone.

Each count is a total since the start (`tallies`); a step's is the difference of two
steps' totals, which `step_columns` turns into metrics.jsonl's columns.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpk.core.protocols import MeteredScorer as Scorer
from rpk.core.records import Prompt, Response, Scored
from rpk.reward.functions import RewardError
from rpk.reward.group import GROUPS, GroupJudge, GroupJudging
from rpk.reward.judge import JudgeScorer, first_error, is_judged
from rpk.reward.rubric import JudgeTerm, RubricSettings


class Hybrid(enum.StrEnum):
    ALONE = "alone"
    WEIGHTED = "weighted"
    CASCADE = "cascade"


@dataclass(frozen=True, slots=True)
class HybridSettings:
    """How judged rows combine the judge and their rule reward (`reward.judge.mode`, or
    weighted by a `judge=w` term of `reward.functions`: its weight, and whether it is the
    first term, whose verdict is the sample's), the rubric requests' template, and
    whether the judge sees whole groups (`reward.judge.group`; `seed` draws their
    orders)."""

    mode: Hybrid = Hybrid.ALONE
    judge_weight: float = 1.0
    judge_first: bool = False
    rubric: RubricSettings = RubricSettings()
    group: GroupJudging = GroupJudging.OFF
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Mode:
    """One row of `MODES`. `needs_rule`: every judged row is scored by its rule reward
    too (which must exist). `score`: one judged response's reward. `combine`: the
    judge's and the rule's Scored of a response, both scored side by side, as one (None:
    the judge waits for the rule, so a group cannot be judged at once). `counts`: what
    it counts beyond the confusion, zeros included, so that columns do not come and go."""

    mode: Hybrid
    needs_rule: bool
    score: Callable[[JudgeRouter, Response], Awaitable[Scored]]
    combine: Callable[[JudgeRouter, Scored, Scored], Scored] | None
    counts: tuple[str, ...] = ()


class JudgeRouter:
    """Each response to the judge or to the rule scorer (`rules`, None when every row is
    judged), by its row, judged rows as `hybrid.mode` says; the metrics of both, with
    every failure kind of both. `ruled`: the data sources whose judged rows the rule
    scores too (None: every one, a reward service's); under `alone` that is the
    comparison `compare_rules` asks for, the other modes need it."""

    def __init__(self, judge: JudgeScorer, rules: Scorer | None, data_sources: Sequence[str],
                 ruled: frozenset[str] | None = frozenset(),
                 hybrid: HybridSettings = HybridSettings()) -> None:
        self.judge = judge
        self.rules = rules
        self.data_sources = tuple(data_sources)
        self.ruled = ruled
        self.hybrid = hybrid
        self.mode = MODES[hybrid.mode]
        if self.mode.needs_rule and rules is None:
            raise RewardError(f"reward.judge.mode {hybrid.mode}: judged rows need a rule reward")
        self.term = JudgeTerm(judge, hybrid.rubric)
        way = GROUPS[hybrid.group]
        if way.grouped and self.mode.combine is None:
            raise RewardError(f"reward.judge.group {hybrid.group} cannot serve reward.judge.mode "
                              f"{hybrid.mode}: the judge sees only the rows the rule fails")
        self.group = GroupJudge(judge, hybrid.group, hybrid.seed) if way.grouped else None
        self.routed: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    @property
    def compares(self) -> bool:
        """Judge and rule both score some judged rows: the confusion is counted."""
        return self.rules is not None and (self.mode.needs_rule or self.ruled is None or bool(self.ruled))

    def _both_score(self, prompt: Prompt) -> bool:
        return self.rules is not None and (
            self.mode.needs_rule or self.ruled is None or prompt.data_source in self.ruled)

    async def score(self, response: Response) -> Scored:
        if is_judged(response.prompt, self.data_sources):
            self.routed["judge"] += 1
            return await self.mode.score(self, response)
        if self.rules is None:
            raise RewardError(
                f"data_source {response.prompt.data_source!r} has no rule reward and its row "
                "is not judged"
            )
        self.routed["rule"] += 1
        return await self.rules.score(response)

    def by_group(self, prompt: Prompt) -> bool:
        """The row's responses are judged as a group, once all of them have finished."""
        return self.group is not None and is_judged(prompt, self.data_sources)

    async def score_group(self, responses: Sequence[Response]) -> list[Scored]:
        """A group's responses (judged rows, `by_group`), each as `score` would make it
        with the judge's verdicts from the group; in their order."""
        assert self.group is not None and self.mode.combine is not None
        self.routed["judge"] += len(responses)
        tag = responses[0].prompt.uid
        try:
            async with asyncio.TaskGroup() as tg:
                by_group = tg.create_task(self.group.score_group(responses), name=f"group-judge:{tag}")
                by_rule = [tg.create_task(self.rules.score(r), name=f"group-rule:{tag}/{r.index}")
                           if self.rules is not None and self._both_score(r.prompt) else None
                           for r in responses]
        except BaseExceptionGroup as group:
            raise first_error(group) from None  # a dead judge stops the run as itself
        out = []
        for j, r in zip(by_group.result(), by_rule, strict=True):
            out.append(j if r is None else self.mode.combine(self, j, r.result()))
        return out

    async def _side_by_side(self, response: Response) -> tuple[Scored, Scored | None]:
        """The judge's Scored and the rule's (None where the rule does not score the row),
        scored at once; a judge that dies takes the rule's call with it."""
        if not self._both_score(response.prompt):
            return await self.term.score(response), None
        assert self.rules is not None
        tag = f"{response.prompt.uid}/{response.index}"
        try:
            async with asyncio.TaskGroup() as tg:
                by_judge = tg.create_task(self.term.score(response), name=f"judge:{tag}")
                by_rule = tg.create_task(self.rules.score(response), name=f"rule:{tag}")
        except BaseExceptionGroup as group:
            raise first_error(group) from None  # a dead judge stops the run as itself
        return by_judge.result(), by_rule.result()

    async def _alone(self, response: Response) -> Scored:
        by_judge, by_rule = await self._side_by_side(response)
        return by_judge if by_rule is None else self._compared(by_judge, by_rule)

    def _compared(self, by_judge: Scored, by_rule: Scored) -> Scored:
        if by_judge.error is None and by_rule.error is None:
            self._confusion(by_judge.correct, by_rule.correct)
        return by_judge

    async def _weighted(self, response: Response) -> Scored:
        by_judge, by_rule = await self._side_by_side(response)
        assert by_rule is not None
        return self._weighted_sum(by_judge, by_rule)

    def _weighted_sum(self, by_judge: Scored, by_rule: Scored) -> Scored:
        first, second = (by_judge, by_rule) if self.hybrid.judge_first else (by_rule, by_judge)
        for part in (first, second):
            if part.error is not None:
                return Scored(by_rule.response, 0.0, False, error=part.error)
        self._confusion(by_judge.correct, by_rule.correct)
        reward = self.hybrid.judge_weight * by_judge.reward + by_rule.reward
        return Scored(by_rule.response, reward, first.correct)

    async def _cascade(self, response: Response) -> Scored:
        assert self.rules is not None
        by_rule = await self.rules.score(response)
        self.counts["cascade_rows"] += 1
        if by_rule.error is None and by_rule.correct:
            return by_rule
        self.counts["cascade_to_judge"] += 1
        self.counts["cascade_rule_failed" if by_rule.error is not None else "cascade_rule_no"] += 1
        by_judge = await self.term.score(response)
        if by_rule.error is None and by_judge.error is None:
            self._confusion(by_judge.correct, False)
            self.counts["cascade_rescued"] += by_judge.correct
        return by_judge

    def _confusion(self, judge: bool, rule: bool) -> None:
        cell = ("tp" if rule else "fp") if judge else ("fn" if rule else "tn")
        self.counts[f"judge_rule_{cell}"] += 1

    def tallies(self) -> dict[str, float]:
        """The router's counts since the start, and its rubric's and groups' (a step's
        are the difference of two steps')."""
        out = {k: 0.0 for k in (*(CONFUSION if self.compares else ()), *self.mode.counts)}
        out.update({k: float(v) for k, v in self.counts.items()})
        out.update(self.term.tallies())
        if self.group is not None:
            out.update(self.group.tallies())
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, Any] = dict(self.rules.metrics()) if self.rules is not None else {}
        out.update(self.judge.metrics())
        out["reward_routed_judge_total"] = float(self.routed["judge"])
        out["reward_routed_rule_total"] = float(self.routed["rule"])
        out.update({f"reward_{k}_total": v for k, v in self.tallies().items()})
        return out

    async def aclose(self) -> None:
        try:
            if self.rules is not None:
                await self.rules.aclose()
        finally:
            await self.judge.aclose()


MODES: Mapping[Hybrid, Mode] = {m.mode: m for m in (
    Mode(Hybrid.ALONE, False, JudgeRouter._alone, JudgeRouter._compared),
    Mode(Hybrid.WEIGHTED, True, JudgeRouter._weighted, JudgeRouter._weighted_sum),
    Mode(Hybrid.CASCADE, True, JudgeRouter._cascade, None,
         ("cascade_rows", "cascade_to_judge", "cascade_rule_no", "cascade_rule_failed",
          "cascade_rescued")),
)}

CONFUSION = ("judge_rule_tp", "judge_rule_fp", "judge_rule_tn", "judge_rule_fn")


def step_columns(step: Mapping[str, float]) -> dict[str, Any]:
    """A step's columns for metrics.jsonl from its counts (`tallies` differences):

    - judge/rule: `reward_judge_rule_{tp,fp,tn,fn}`, `_compared`, `_agreed` and
      `reward_judge_rule_agreement`; `reward_judge_fp_rate` (fp / (fp + tn): of the
      answers the rule fails, the share the judge passes) and `reward_judge_fn_rate`
      (fn / (fn + tp)), each absent when its denominator is 0;
    - cascade: `reward_cascade_{rows,to_judge,rule_no,rule_failed,rescued}`,
      `reward_cascade_judge_frac` (rows sent to the judge / rows) and
      `reward_cascade_rescue_rate` (rescued / rule no);
    - rubrics: `reward_rubric_rows`, and per criterion `reward_rubric_<name>_asked` and
      `_mean` (its mean reward over the verdicts read); group judging: `reward_groups`, `reward_group_requests`."""
    out: dict[str, Any] = {}
    if CONFUSION[0] in step:
        tp, fp, tn, fn = (int(step.get(k, 0)) for k in CONFUSION)
        out.update({f"reward_{k}": int(step.get(k, 0)) for k in CONFUSION})
        out["reward_judge_rule_compared"] = tp + fp + tn + fn
        out["reward_judge_rule_agreed"] = tp + tn
        for key, num, den in (("reward_judge_rule_agreement", tp + tn, tp + fp + tn + fn),
                              ("reward_judge_fp_rate", fp, fp + tn),
                              ("reward_judge_fn_rate", fn, fn + tp)):
            if den:
                out[key] = num / den
    if "cascade_rows" in step:
        for key in ("rows", "to_judge", "rule_no", "rule_failed", "rescued"):
            out[f"reward_cascade_{key}"] = int(step.get(f"cascade_{key}", 0))
        if step["cascade_rows"]:
            out["reward_cascade_judge_frac"] = step.get("cascade_to_judge", 0) / step["cascade_rows"]
        if step.get("cascade_rule_no"):
            out["reward_cascade_rescue_rate"] = step.get("cascade_rescued", 0) / step["cascade_rule_no"]
    if "rubric_rows" in step:
        out["reward_rubric_rows"] = int(step["rubric_rows"])
    for key, value in step.items():
        if key.startswith("rubric_") and key.endswith("_asked"):
            name = key[len("rubric_"):-len("_asked")]
            out[f"reward_rubric_{name}_asked"] = int(value)
            answered = step.get(f"rubric_{name}_answered", 0)
            if answered:
                out[f"reward_rubric_{name}_mean"] = step.get(f"rubric_{name}_reward", 0.0) / answered
    if "groups" in step:
        out["reward_groups"] = int(step["groups"])
        out["reward_group_requests"] = int(step.get("group_requests", 0))
    return out


def step_counts(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """A step's counts: the totals now less those before it."""
    return {k: v - before.get(k, 0.0) for k, v in now.items()}
