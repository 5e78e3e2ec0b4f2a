"""The reward stage: reward functions with veRL's signature and the scorers that run
them per response, as each finishes."""

from rpk.reward.functions import BUILTIN, FunctionScorer, RewardError, load_function, resolve

__all__ = ["BUILTIN", "FunctionScorer", "RewardError", "load_function", "resolve"]
