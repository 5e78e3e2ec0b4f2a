"""The reward stage: reward functions with veRL's signature and the scorers that run
them per response, as each finishes. `make_scorer` builds the one the config asks for."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Protocol

from rpk.core.records import Response, Scored
from rpk.reward.functions import (
    BUILTIN,
    FunctionScorer,
    RewardError,
    RewardFn,
    WeightedSum,
    load_function,
    resolve,
)
from rpk.reward import code
from rpk.reward.pool import PoolSettings, ProcessScorer, RewardPoolError
from rpk.reward.shaping import ShapedScorer, Shaping

if TYPE_CHECKING:
    from rpk.config import RewardConfig

__all__ = [
    "BUILTIN", "FunctionScorer", "MeteredScorer", "PoolSettings", "ProcessScorer",
    "RewardError", "RewardPoolError", "ShapedScorer", "Shaping", "WeightedSum",
    "load_function", "make_scorer", "resolve", "sandbox_of", "with_shaping",
]


class MeteredScorer(Protocol):
    """A Scorer whose state is worth columns in metrics.jsonl."""

    async def score(self, response: Response) -> Scored: ...

    async def aclose(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


def make_scorer(
    cfg: RewardConfig, functions: Mapping[str, RewardFn], *, max_tokens: int
) -> MeteredScorer:
    """The scorer of `reward.backend`, wrapped in shaping when any is configured;
    `max_tokens` is rollout.max_tokens, the overlong penalty's L_max."""
    # Code rewards run their programs in sandbox processes already, killed on timeout;
    # they are async and stay on the loop, where the adaptive timeouts are shared.
    sandboxed = {ds: fn for ds, fn in functions.items() if fn is code.compute_score}
    others = {ds: fn for ds, fn in functions.items() if ds not in sandboxed}
    by_source: dict[str, MeteredScorer] = {}
    if others:
        base = _function_scorer(cfg, others)
        by_source.update({ds: base for ds in others})
    if sandboxed:
        code.configure(cfg.sandbox)
        slots = cfg.sandbox.max_concurrency or os.cpu_count() or 1
        sandbox_scorer = _SandboxScorer(sandboxed, cfg.timeout_s, slots)
        by_source.update({ds: sandbox_scorer for ds in sandboxed})
    unique = {id(s): s for s in by_source.values()}
    scorer = next(iter(unique.values())) if len(unique) == 1 else BySource(by_source)
    return with_shaping(cfg, scorer, max_tokens=max_tokens)


def sandbox_of(scorer: MeteredScorer) -> code.CodeScorer | None:
    """The code sandbox behind `scorer`, if it scores code (probed at start-up)."""
    return code.configured()


def with_shaping(cfg: RewardConfig, scorer: MeteredScorer, *, max_tokens: int) -> MeteredScorer:
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


def _function_scorer(cfg: RewardConfig, functions: Mapping[str, RewardFn]) -> MeteredScorer:
    if cfg.backend == "thread":
        return FunctionScorer(functions, cfg.timeout_s, cfg.max_concurrency)
    settings = PoolSettings(
        timeout_s=cfg.timeout_s, min_workers=cfg.min_workers,
        max_workers=cfg.max_workers, idle_s=cfg.idle_s,
    )
    return ProcessScorer(functions, settings)


class _SandboxScorer(FunctionScorer):
    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), **code.timeout_stats()}


class BySource:
    """Routes each response to the scorer of its data source (a dataset mixing math in
    the process pool with code in the sandbox); metrics of the same name are summed."""

    def __init__(self, scorers: Mapping[str, MeteredScorer]) -> None:
        self._by_source = dict(scorers)
        self._unique = list({id(s): s for s in scorers.values()}.values())

    async def score(self, response: Response) -> Scored:
        return await self._by_source[response.prompt.data_source].score(response)

    async def aclose(self) -> None:
        for scorer in self._unique:
            await scorer.aclose()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for scorer in self._unique:
            for k, v in scorer.metrics().items():
                out[k] = out.get(k, 0.0) + v
        return out
