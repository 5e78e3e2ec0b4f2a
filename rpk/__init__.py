"""rpk: a synchronous RL post-training engine that removes the long-tail rollout bubble."""

__version__ = "0.1.0"
