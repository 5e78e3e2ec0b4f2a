"""rpk's configuration: one tree of frozen dataclasses.

Set fields in a YAML file (`--config run.yaml`, nested sections) or on the command line
(`--train.lr 1e-5`); `python -m rpk.run --help` lists them all. Each section checks its
own values and names the offending field and value. The sections live in the modules
of this package, a group each (model and data, rollout and agent, reward, train, run
and dist); `Config` holds them and checks what spans two.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from rpk.cli_config import ConfigError, build, dump_yaml, help_text, load
from rpk.config.model import (
    ARITH_MAX_DIGITS, MULTI_TURN_TASKS, TASKS, ArithSpec, DataConfig, ModelConfig, TinySpec,
    ToolAddTinySpec,
)
from rpk.config.reward import RewardConfig, SandboxConfig
from rpk.config.rollout import AgentConfig, RolloutConfig
from rpk.config.run import DistConfig, RunConfig
from rpk.config.train import TrainConfig

__all__ = [
    "ARITH_MAX_DIGITS", "MULTI_TURN_TASKS", "TASKS", "AgentConfig", "ArithSpec", "Config",
    "ConfigError", "DataConfig", "DistConfig", "ModelConfig", "RewardConfig", "RolloutConfig",
    "RunConfig", "SandboxConfig", "TinySpec", "ToolAddTinySpec", "TrainConfig", "build",
    "dump_yaml", "from_argv",
]


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        if self.multi_turn and self.rollout.policy == "partial":
            raise ConfigError(
                "rollout.policy partial with a multi-turn task: continuing a trajectory "
                "across rounds is not built; use tail, length_aware, oversample or sync"
            )

    @property
    def multi_turn(self) -> bool:
        """Rollouts are trajectories of model turns and tool or environment observations
        (`rpk.agent`): a multi-turn built-in task, or tools or an environment set."""
        return self.data.task in MULTI_TURN_TASKS or bool(self.agent.tools) or self.agent.env is not None


def from_argv(argv: list[str], prog: str = "python -m rpk.run") -> Config:
    """Parse the command line; prints help and exits on -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(Config, prog))
        sys.exit(0)
    return load(Config, argv)
