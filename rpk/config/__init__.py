"""rpk's configuration: one tree of frozen dataclasses.

Set fields in a YAML file (`--config run.yaml`, nested sections) or on the command line
(`--train.lr 1e-5`); `python -m rpk.run --help` lists them all. Each section checks its
own values and names the offending field and value. The sections live in two modules:
what the run is given (`inputs`: model, data, agent, reward) and how it goes
(`execution`: rollout, train, run, dist); `Config` holds them and checks what spans two.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from rpk.config.cli import build, dump_yaml, help_text, load
from rpk.config.execution import DistConfig, RolloutConfig, RunConfig, TrainConfig
from rpk.core.errors import ConfigError
from rpk.core.names import MULTI_TURN_TASKS, TASKS
from rpk.core.modes import TransferChoice
from rpk.config.inputs import AgentConfig, DataConfig, ModelConfig, RewardConfig, SandboxConfig
from rpk.tasks.specs import ARITH_MAX_DIGITS, ArithSpec, JudgeTinySpec, TinySpec, ToolAddTinySpec

__all__ = [
    "ARITH_MAX_DIGITS", "MULTI_TURN_TASKS", "TASKS", "AgentConfig", "ArithSpec", "Config",
    "ConfigError", "DataConfig", "TASK_DEFAULTS", "DistConfig", "ModelConfig", "RewardConfig", "RolloutConfig",
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
        return self.data.task in MULTI_TURN_TASKS or bool(self.agent.tools) or self.agent.env is not None


# Where a built-in task's default job differs from the run's defaults (the YAML file and
# the command line still win). tool_add: a 20-digit sum's trajectory, with its retries
# and running sums, is up to ~620 tokens beside its prompt, which arith's 320 cuts
# short; and a step of 16 prompts (half arith's) takes ~7 s on the 2-core machine, so
# 120 steps train as many prompts as 60 of 32 but with twice the updates, validated
# three times (512 prompts each: a standard error near 0.02).
TASK_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "tool_add": {
        "rollout": {"max_tokens": 640, "prompts_per_step": 16},
        "run": {"steps": 120, "eval_every": 60},
    },
}


def task_defaults(tree: Mapping[str, Any]) -> Mapping[str, Any]:
    """The defaults of the built-in task a config tree names (`data.task`), or none."""
    data = tree.get("data")
    name = data.get("task") if isinstance(data, Mapping) else None
    return TASK_DEFAULTS.get(name, {}) if isinstance(name, str) else {}


def from_argv(argv: list[str], prog: str = "python -m rpk.run") -> Config:
    """Parse the command line, under the named task's defaults (`TASK_DEFAULTS`); prints
    help and exits on -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(Config, prog))
        sys.exit(0)
    return load(Config, argv, task_defaults)
