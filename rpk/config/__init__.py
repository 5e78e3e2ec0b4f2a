"""rpk's configuration: one tree of frozen dataclasses.

Set fields in a YAML file (`--config run.yaml`, nested sections) or on the command line
(`--train.lr 1e-5`); `python -m rpk.run --help` lists them all. Each section checks its
own values and names the offending field and value. The sections live in two modules:
what the run is given (`inputs`: model, data, agent, reward) and how it goes
(`execution`: rollout, train, run, dist); `Config` holds them and checks what spans two.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rpk import tasks
from rpk.config.cli import build, dump_yaml, help_text, load
from rpk.config.execution import DistConfig, RolloutConfig, RunConfig, TrainConfig
from rpk.config.inputs import AgentConfig, DataConfig, JudgeConfig, ModelConfig, RewardConfig, SandboxConfig
from rpk.core.errors import ConfigError
from rpk.core.modes import TransferChoice
from rpk.core.names import TASKS
from rpk.tasks.specs import ARITH_MAX_DIGITS, ArithSpec, JudgeTinySpec, TinySpec, ToolAddTinySpec

__all__ = [
    "ARITH_MAX_DIGITS", "TASKS", "AgentConfig", "ArithSpec", "Config",
    "ConfigError", "DataConfig", "DistConfig", "JudgeConfig", "ModelConfig", "RewardConfig", "RolloutConfig",
    "JudgeTinySpec", "RunConfig", "SandboxConfig", "TinySpec", "ToolAddTinySpec", "TrainConfig", "build",
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
        if self.model.lora_rank:
            # A LoRA sync sends the adapter alone; these paths drop or reshard the base.
            if self.train.stream_mode == "borrow":
                raise ConfigError(
                    "train.stream_mode borrow with model.lora_rank > 0: lent replicas drop their "
                    "base weights, which a LoRA run never sends again; use thread or none"
                )
            if self.rollout.tp == "elastic" and self.rollout.tp_switch == "sleep":
                raise ConfigError(
                    "rollout.tp elastic with tp_switch sleep and model.lora_rank > 0: a layout "
                    "put to sleep drops its base weights, which a LoRA run never sends again; "
                    "use rollout.tp_switch restart (the layout reloads the base from disk)"
                )
            if self.rollout.weight_transfer == TransferChoice.M2N:
                raise ConfigError(
                    "rollout.weight_transfer m2n with model.lora_rank > 0: a LoRA sync is the "
                    "adapter, written once as PEFT files; leave weight_transfer at auto"
                )

    @property
    def multi_turn(self) -> bool:
        """Rollouts are trajectories of model turns and tool or environment observations
        (`rpk.agent`): a multi-turn built-in task, or tools or an environment set."""
        return tasks.task(self.data.task).multi_turn or bool(self.agent.tools) or self.agent.env is not None


def task_defaults(tree: Mapping[str, Any]) -> Mapping[str, Any]:
    """The defaults of the built-in task a config tree names (`data.task`,
    `rpk.tasks.Task.defaults`), or none."""
    data = tree.get("data")
    name = data.get("task") if isinstance(data, Mapping) else None
    found = tasks.TASKS.get(name) if isinstance(name, str) else None
    return found.defaults if found is not None else {}


def from_argv(argv: list[str], prog: str = "python -m rpk.run") -> Config:
    """Parse the command line, under the named task's defaults (`task_defaults`); prints
    help and exits on -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(Config, prog))
        sys.exit(0)
    return load(Config, argv, task_defaults)
