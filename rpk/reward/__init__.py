"""The reward stage: reward functions with veRL's signature and the scorers that run
them per response, as each finishes. `make_scorer` builds the one the config asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol

from rpk.loop.records import Response, Scored
from rpk.reward.functions import (
    BUILTIN,
    FunctionScorer,
    RewardError,
    RewardFn,
    WeightedSum,
    load_function,
    resolve,
)
from rpk.reward.pool import PoolSettings, ProcessScorer, RewardPoolError
from rpk.reward.shaping import ShapedScorer, Shaping

if TYPE_CHECKING:
    from rpk.config import RewardConfig

__all__ = [
    "BUILTIN", "FunctionScorer", "MeteredScorer", "PoolSettings", "ProcessScorer",
    "RewardError", "RewardPoolError", "ShapedScorer", "Shaping", "WeightedSum",
    "load_function", "make_scorer", "resolve",
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
    if cfg.overlong_buffer >= max_tokens:
        raise RewardError(
            f"reward.overlong_buffer={cfg.overlong_buffer} must be < rollout.max_tokens={max_tokens}"
        )
    scorer: MeteredScorer
    if cfg.backend == "thread":
        scorer = FunctionScorer(functions, cfg.timeout_s, cfg.max_concurrency)
    else:
        settings = PoolSettings(
            timeout_s=cfg.timeout_s, min_workers=cfg.min_workers,
            max_workers=cfg.max_workers, idle_s=cfg.idle_s,
        )
        scorer = ProcessScorer(functions, settings)
    shaping = Shaping(
        format_regex=cfg.format_regex, format_weight=cfg.format_weight, max_tokens=max_tokens,
        overlong_buffer=cfg.overlong_buffer, overlong_weight=cfg.overlong_weight,
    )
    return ShapedScorer(scorer, shaping) if shaping.active else scorer
