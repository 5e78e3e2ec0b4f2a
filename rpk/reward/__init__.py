"""The reward stage: reward functions with veRL's signature and the scorers that run
them per response, as each finishes. `make_scorer` builds the stack the config asks for
(rpk.reward.stack)."""

from __future__ import annotations

from rpk.reward.functions import (
    FunctionScorer,
    Reward,
    RewardError,
    RewardFn,
    WeightedSum,
    builtin,
    load_function,
    resolve_rewards,
)
from rpk.reward.pool import PoolSettings, ProcessScorer, RewardPoolError
from rpk.reward.shaping import ShapedScorer, Shaping
from rpk.reward.stack import (
    BySource,
    MeteredScorer,
    RewardSettings,
    RewardStack,
    SandboxScorer,
    make_scorer,
    with_shaping,
)

__all__ = [
    "BySource", "FunctionScorer", "MeteredScorer", "PoolSettings", "ProcessScorer",
    "Reward", "RewardError", "RewardFn", "RewardPoolError", "RewardSettings", "RewardStack",
    "SandboxScorer",
    "ShapedScorer", "Shaping", "WeightedSum", "builtin", "load_function", "make_scorer", "resolve_rewards",
    "with_shaping",
]
