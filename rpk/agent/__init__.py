"""Multi-turn rollouts: a trajectory of model turns and tool (or environment)
observations is one response of a GRPO group. `AgentEngine` wraps the rollout engine so
that the round loop schedules trajectories exactly as it schedules single completions
(docs/multi-turn.md)."""
