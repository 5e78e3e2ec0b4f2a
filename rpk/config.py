"""rpk's configuration: one tree of frozen dataclasses.

Set fields in a YAML file (`--config run.yaml`, nested sections) or on the command line
(`--train.lr 1e-5`); `python -m rpk.run --help` lists them all. Each section checks its
own values and names the offending field and value.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from rpk.cli_config import ConfigError, build, dump_yaml, help_text, load
from rpk.tiny import TinySpec

__all__ = ["Config", "ConfigError", "from_argv", "build", "dump_yaml"]


def opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str | None = opt(
        None, "a local HF model directory; unset builds rpk's tiny model (no download)"
    )
    cache_dir: str = opt(".cache/rpk", "where built models are cached, keyed by their spec")
    tiny: TinySpec = field(default_factory=TinySpec)


@dataclass(frozen=True, slots=True)
class DataConfig:
    train_files: tuple[str, ...] = opt(
        (), "jsonl/parquet files in veRL's layout; empty uses the built-in arithmetic task"
    )
    builtin_size: int = opt(4096, "number of built-in task prompts generated (one epoch)")
    max_prompt_tokens: int = opt(256, "rows whose templated prompt is longer are errors")
    shuffle: bool = opt(True, "shuffle the prompts each epoch (seeded by run.seed)")

    def __post_init__(self) -> None:
        _positive(self, "builtin_size", "max_prompt_tokens")


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    policy: Literal["sync", "oversample", "tail"] = opt(
        "sync",
        "round scheduling: sync (veRL: every response runs to the end), oversample "
        "(launch more, keep the first P0 groups, drop the rest) or tail (RollPacker's "
        "tail batching: like oversample, but unfinished prompts are deferred to long rounds)",
    )
    eta_prompts: float = opt(1.25, "tail, oversample: a short round launches eta_prompts * P0 prompts")
    eta_responses: float = opt(1.25, "tail, oversample: ... with eta_responses * R0 responses each")
    prompts_per_step: int = opt(32, "P0: prompts (GRPO groups) trained per step")
    responses_per_prompt: int = opt(8, "R0: responses per prompt (the group size)")
    max_tokens: int = opt(320, "length budget of one response, in tokens")
    temperature: float = opt(1.0, "sampling temperature (the trainer uses the same)")
    top_p: float = opt(1.0, "nucleus sampling")
    max_num_seqs: int = opt(128, "engine concurrency: requests decoded at once")
    max_model_len: int = opt(0, "engine context length (prompt + response); 0 = the model's")
    kv_cache_mb: int = opt(512, "KV-cache memory of the engine, MiB (CPU engine)")
    dtype: str = opt("auto", "engine dtype; auto = float32 on CPU, bfloat16 on GPU")
    gpu_memory_utilization: float = opt(0.5, "GPU engine only: memory fraction for vLLM")

    def __post_init__(self) -> None:
        _positive(
            self, "prompts_per_step", "responses_per_prompt", "max_tokens",
            "max_num_seqs", "kv_cache_mb",
        )
        _non_negative(self, "max_model_len")
        _non_negative(self, "temperature")
        for name in ("eta_prompts", "eta_responses"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.responses_per_prompt < 2:
            raise ConfigError(
                f"responses_per_prompt must be >= 2 for group-relative advantages, "
                f"got {self.responses_per_prompt!r}"
            )
        if self.max_model_len and self.max_tokens >= self.max_model_len:
            raise ConfigError(
                f"max_tokens ({self.max_tokens}) must be < max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class RewardConfig:
    function: str | None = opt(
        None,
        "reward as module:function with veRL's compute_score signature; "
        "unset uses the built-in task's checker",
    )
    timeout_s: float = opt(30.0, "a score call that takes longer scores 0 and is counted")
    max_concurrency: int = opt(8, "score calls in flight at once")

    def __post_init__(self) -> None:
        _positive(self, "timeout_s", "max_concurrency")
        if self.function is not None and ":" not in self.function:
            raise ConfigError(f"function must look like module:function, got {self.function!r}")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    lr: float = opt(2e-4, "AdamW learning rate")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm")
    clip_low: float = opt(0.2, "PPO clip: ratio floor is 1 - clip_low")
    clip_high: float = opt(0.2, "PPO clip: ratio ceiling is 1 + clip_high")
    micro_batch_tokens: int = opt(8192, "token budget of one micro-batch (grad accumulation)")
    torch_threads: int = opt(0, "trainer torch threads on CPU; 0 = all cores")
    device: str = opt("auto", "trainer device: auto, cpu or cuda")

    def __post_init__(self) -> None:
        _positive(self, "lr", "grad_clip", "micro_batch_tokens")
        _non_negative(self, "weight_decay", "clip_low", "clip_high", "torch_threads")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")


@dataclass(frozen=True, slots=True)
class RunConfig:
    steps: int = opt(60, "RL steps (one optimizer step each)")
    seed: int = opt(0, "seeds data order, sampling and the trainer")
    out_dir: str = opt("runs", "run directories go to OUT_DIR/<timestamp>/")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and always at the end); 0 = end only")
    resume: str | None = opt(None, "a checkpoint directory (or a run directory) to continue from")
    progress: bool = opt(True, "show the live progress display")
    uvloop: bool = opt(True, "use uvloop's event loop when installed")

    def __post_init__(self) -> None:
        _positive(self, "steps")
        _non_negative(self, "checkpoint_every")


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


def from_argv(argv: list[str], prog: str = "python -m rpk.run") -> Config:
    """Parse the command line; prints help and exits on -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(Config, prog))
        sys.exit(0)
    return load(Config, argv)
