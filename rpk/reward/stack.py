"""The reward stack: from each data source's reward (as `resolve_rewards` found it) to the one
scorer a run scores with.

- Function terms (a user's function, the math and arith checkers, a weighted sum of
  them) run where `reward.backend` says: the process pool or threads, every data
  source's in one pool.
- The built-in code checker (`code.CHECKER`, alone or as a term of a weighted sum) runs
  on the event loop, scored by one `CodeScorer` built from `reward.sandbox` and owned
  here: each test already runs in a sandbox process under its own timeout, and the
  adaptive timeouts learn from every run of the whole run.
- A data source with both adds the parts, weight * code score + the sum of the function
  terms, in one sample; the first term's verdict is the sample's `correct`.

Shaping goes on top, and `RewardStack` on top of that: besides scores, the run asks it
for the sandbox to probe at start-up and for the name of each data source's reward.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rpk.core.protocols import MeteredScorer
from rpk.core.records import Prompt, Response, Scored
from rpk.reward.canary import CanarySet, CanarySettings
from rpk.reward.code import CodeChecker, CodeScorer, SandboxSettings
from rpk.reward.functions import (
    FAILURE_KINDS,
    FunctionScorer,
    Reward,
    RewardError,
    RewardFn,
    WeightedSum,
    reward_name,
)
from rpk.reward.hybrid import HybridSettings, JudgeRouter
from rpk.reward.judge import FAILURE_KINDS as JUDGE_FAILURE_KINDS
from rpk.reward.judge import JudgeScorer
from rpk.reward.pool import PoolSettings, ProcessScorer
from rpk.reward.shaping import ShapedScorer, Shaping


@dataclass(frozen=True, slots=True)
class RewardSettings:
    """Where reward functions run, the shaping on top and the sandbox of code terms: the
    config's `reward` section (`rpk.config.RewardConfig`, which says what each field
    means and checks it), as `rpk.assembly.settings` copies it; the defaults are that
    section's, but for the pool's memory limit, which the section sizes by the machine."""

    backend: str = "process"  # "process" (a worker pool) or "thread"
    max_concurrency: int = 8  # the thread backend's calls at once
    # The process backend's workers; its timeout bounds every function call and program.
    pool: PoolSettings = PoolSettings(timeout_s=30.0)
    format_regex: str | None = None
    format_weight: float = 0.1
    overlong_buffer: int = 0
    overlong_weight: float = 1.0
    sandbox: SandboxSettings = SandboxSettings()

    @property
    def timeout_s(self) -> float:
        return self.pool.timeout_s


@dataclass(frozen=True, slots=True)
class Split:
    """One data source's reward, split by where its terms run."""

    function: RewardFn | None  # the function terms: one function, or their WeightedSum
    code_weight: float | None = None  # the code checker's weight; None: no code term
    code_first: bool = False  # the code checker is the first term: its verdict counts


def split(reward: Reward) -> Split:
    if isinstance(reward, CodeChecker):
        return Split(None, 1.0, True)
    if not isinstance(reward, WeightedSum):
        return Split(reward)
    functions = tuple((fn, w) for fn, w in reward.terms if not isinstance(fn, CodeChecker))
    if len(functions) == len(reward.terms):
        return Split(reward)
    code_weight = sum(w for fn, w in reward.terms if isinstance(fn, CodeChecker))
    code_first = isinstance(reward.terms[0][0], CodeChecker)
    return Split(WeightedSum(functions) if functions else None, code_weight, code_first)


class SandboxScorer(FunctionScorer):
    """The code checker's scorer: `sandbox` called on the event loop for the data sources
    `sources`, at most `slots` responses at once, each under `timeout_s`."""

    def __init__(
        self, sandbox: CodeScorer, sources: Sequence[str], timeout_s: float, slots: int
    ) -> None:
        super().__init__({ds: sandbox for ds in sources}, timeout_s, slots)
        self.sandbox = sandbox

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), **self.sandbox.stats()}


@dataclass(frozen=True, slots=True)
class Route:
    """Where one data source's samples are scored."""

    split: Split
    functions: MeteredScorer | None  # scores split.function
    code: SandboxScorer | None  # scores the code term


class BySource:
    """Routes each response to the scorers of its data source's reward and adds the
    parts; metrics of the same name are summed over the scorers."""

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self._routes = dict(routes)
        parts = [p for r in routes.values() for p in (r.functions, r.code) if p is not None]
        self.scorers: list[MeteredScorer] = list({id(p): p for p in parts}.values())
        code = next((r.code for r in routes.values() if r.code is not None), None)
        self.sandbox: CodeScorer | None = code.sandbox if code is not None else None

    async def score(self, response: Response) -> Scored:
        route = self._routes[response.prompt.data_source]
        if route.code is None:
            assert route.functions is not None
            return await route.functions.score(response)
        if route.functions is None and route.split.code_weight == 1.0:
            return await route.code.score(response)
        return await self._add(route, route.code, response)

    async def _add(self, route: Route, code: SandboxScorer, response: Response) -> Scored:
        tag = f"{response.prompt.uid}/{response.index}"
        async with asyncio.TaskGroup() as tg:
            code_task = tg.create_task(code.score(response), name=f"reward-code:{tag}")
            fn_task = (
                tg.create_task(route.functions.score(response), name=f"reward-functions:{tag}")
                if route.functions is not None
                else None
            )
        by_code = code_task.result()
        by_functions = fn_task.result() if fn_task is not None else None
        for part in (by_code, by_functions):
            if part is not None and part.error is not None:
                return Scored(response, 0.0, False, error=part.error)
        assert route.split.code_weight is not None
        reward = route.split.code_weight * by_code.reward
        if by_functions is not None:
            reward += by_functions.reward
        verdict = by_code if route.split.code_first or by_functions is None else by_functions
        return Scored(response, reward, verdict.correct)

    async def aclose(self) -> None:
        for scorer in self.scorers:
            await scorer.aclose()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for scorer in self.scorers:
            for k, v in scorer.metrics().items():
                out[k] = out.get(k, 0.0) + v
        return out


def by_source(
    rewards: Mapping[str, Reward],
    function_scorer: Callable[[Mapping[str, RewardFn]], MeteredScorer],
    code_scorer: Callable[[Sequence[str]], SandboxScorer],
) -> BySource:
    """The router for `rewards`: one function scorer for every function part, one code
    scorer for every code term (each built only if some data source needs it)."""
    splits = {ds: split(r) for ds, r in rewards.items()}
    function_parts = {ds: s.function for ds, s in splits.items() if s.function is not None}
    code_sources = [ds for ds, s in splits.items() if s.code_weight is not None]
    functions = function_scorer(function_parts) if function_parts else None
    code = code_scorer(code_sources) if code_sources else None
    return BySource({
        ds: Route(
            s,
            functions if s.function is not None else None,
            code if s.code_weight is not None else None,
        )
        for ds, s in splits.items()
    })


class RewardStack:
    """The run's scorer: `scorer` (routed and shaped) plus what the run asks of the reward
    stage besides scores. `sandbox` is the code sandbox it owns (None without code
    terms), probed at start-up; `name_of(data_source)` names the reward in errors;
    `failure_kinds` are the kinds its failures are counted by; `judge` is the judge
    scorer whose engine the run starts before its rollout engine (None: nothing judged),
    `router` the router that sends rows to it and counts where judge and rule both
    scored, and `canaries` the known-wrong answers the run asks the judge each step
    (`rpk.reward.canary`; None: none). With group judging (`by_group`) the round hands
    a judged row's whole group to `score_group` once its last response has finished."""

    def __init__(
        self,
        scorer: MeteredScorer,
        *,
        name_of: Callable[[str], str],
        failure_kinds: Sequence[str] = FAILURE_KINDS,
        sandbox: CodeScorer | None = None,
        judge: JudgeScorer | None = None,
        router: JudgeRouter | None = None,
        canaries: CanarySet | None = None,
        canary: CanarySettings = CanarySettings(),
    ) -> None:
        self.scorer = scorer
        self.name_of = name_of
        self.failure_kinds = tuple(failure_kinds)
        self.sandbox = sandbox
        self.judge = judge
        self.router = router
        self.canaries = canaries
        self.canary = canary

    async def score(self, response: Response) -> Scored:
        return await self.scorer.score(response)

    def by_group(self, prompt: Prompt) -> bool:
        return self.router is not None and self.router.by_group(prompt)

    async def score_group(self, responses: Sequence[Response]) -> list[Scored]:
        assert self.router is not None
        scored = await self.router.score_group(responses)
        if isinstance(self.scorer, ShapedScorer):
            return [self.scorer.shape(s) for s in scored]
        return scored

    async def aclose(self) -> None:
        await self.scorer.aclose()

    def metrics(self) -> dict[str, float]:
        return self.scorer.metrics()


def make_scorer(
    cfg: RewardSettings, rewards: Mapping[str, Reward], *, max_tokens: int,
    judge: JudgeScorer | None = None, code: CodeScorer | None = None,
    hybrid: HybridSettings = HybridSettings(), canaries: CanarySet | None = None,
    canary: CanarySettings = CanarySettings(),
) -> RewardStack:
    """The stack for `rewards` (data source -> reward): function terms on
    `reward.backend`, code terms on one sandbox (`code`, the run's, which the agent's
    python tool shares; None: one of `cfg.sandbox`), the judged rows to `judge` (combined
    with their rule as `hybrid` says), shaping on top when any is configured;
    `max_tokens` is rollout.max_tokens, the overlong penalty's L_max."""
    slots = cfg.sandbox.max_concurrency or os.cpu_count() or 1
    router = by_source(
        rewards,
        lambda functions: _function_scorer(cfg, functions),
        lambda sources: SandboxScorer(code if code is not None else CodeScorer(cfg.sandbox), sources,
                                      cfg.timeout_s, slots),
    ) if rewards else None
    names = {ds: reward_name(r) for ds, r in rewards.items()}
    compare = frozenset(rewards) if judge is not None and judge.settings.compare_rules else frozenset()
    return judged_stack(
        cfg, router, names.__getitem__, FAILURE_KINDS, judge, max_tokens=max_tokens,
        sandbox=router.sandbox if router is not None else None, ruled=compare, hybrid=hybrid,
        canaries=canaries, canary=canary,
    )


def judged_stack(
    cfg: RewardSettings, rules: MeteredScorer | None, name_of: Callable[[str], str],
    failure_kinds: Sequence[str], judge: JudgeScorer | None, *, max_tokens: int,
    sandbox: CodeScorer | None = None, ruled: frozenset[str] | None = frozenset(),
    hybrid: HybridSettings = HybridSettings(), canaries: CanarySet | None = None,
    canary: CanarySettings = CanarySettings(),
) -> RewardStack:
    """The stack over the rule scorer `rules` (None: every row is judged) with the judged
    rows routed to `judge` when there is one, as `hybrid` combines them; shaping goes on
    top of both. Under `alone`, judged rows of the data sources `ruled` (None: all) are
    also checked by `rules`, for the confusion counts."""
    if judge is None:
        assert rules is not None, "a stack scores with rules, a judge or both"
        return RewardStack(with_shaping(cfg, rules, max_tokens=max_tokens), name_of=name_of,
                           failure_kinds=failure_kinds, sandbox=sandbox)
    s = judge.settings

    def naming(data_source: str) -> str:
        if data_source in s.data_sources or rules is None:
            return f"the judge {s.model}"
        return name_of(data_source)

    router = JudgeRouter(judge, rules, s.data_sources, ruled, hybrid)
    return RewardStack(
        with_shaping(cfg, router, max_tokens=max_tokens), name_of=naming,
        failure_kinds=(*(failure_kinds if rules is not None else ()), *JUDGE_FAILURE_KINDS),
        sandbox=sandbox, judge=judge, router=router, canaries=canaries, canary=canary,
    )


def with_shaping(cfg: RewardSettings, scorer: MeteredScorer, *, max_tokens: int) -> MeteredScorer:
    """`scorer` with the configured shaping on top (any scorer: local or remote)."""
    if cfg.overlong_buffer >= max_tokens:
        raise RewardError(
            f"reward.overlong_buffer={cfg.overlong_buffer} must be < rollout.max_tokens={max_tokens}"
        )
    shaping = Shaping(
        format_regex=cfg.format_regex, format_weight=cfg.format_weight, max_tokens=max_tokens,
        overlong_buffer=cfg.overlong_buffer, overlong_weight=cfg.overlong_weight,
    )
    return ShapedScorer(scorer, shaping) if shaping.active else scorer


def _function_scorer(cfg: RewardSettings, functions: Mapping[str, RewardFn]) -> MeteredScorer:
    if cfg.backend == "thread":
        return FunctionScorer(functions, cfg.timeout_s, cfg.max_concurrency)
    return ProcessScorer(functions, cfg.pool)
