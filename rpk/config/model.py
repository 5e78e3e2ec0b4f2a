"""The config's `model` and `data` sections: the model to train (a path, a Hub id, or
rpk's tiny model and the spec it is built from) and the prompts (files, or a built-in
task)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rpk.cli_config import bad
from rpk.config.fields import non_negative, opt, positive, whole

# The tiny model's tokenizer reserves these ids after the 256 bytes (rpk.tasks.tiny).
_SPECIAL_TOKENS = 3
# The built-in task labels each column with a letter (rpk.tasks.arith): the alphabet is
# the hard cap on its digit count.
ARITH_MAX_DIGITS = 26


@dataclass(frozen=True, slots=True)
class ArithSpec:
    """How the built-in task (`rpk.tasks.arith`) draws its prompts."""

    max_digits: int = field(
        default=20,
        metadata={"help": f"largest column count of a problem (1..{ARITH_MAX_DIGITS})"},
    )
    alpha: float = field(
        default=1.3,
        metadata={
            "help": "tail exponent: P(digits=d) ~ d**-alpha; smaller means more long "
            "problems (0 is uniform)"
        },
    )

    def __post_init__(self) -> None:
        if not 1 <= self.max_digits <= ARITH_MAX_DIGITS:
            raise bad("max_digits", f"must be in 1..{ARITH_MAX_DIGITS}, got {self.max_digits!r}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise bad("alpha", f"must be a finite number >= 0, got {self.alpha!r}")


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Everything that determines a tiny-model build (and so its cache key)."""

    vocab_size: int = field(
        default=320,
        metadata={"help": "BPE vocabulary target (>= 259: 256 bytes plus 3 special tokens)"},
    )
    hidden_size: int = field(default=128, metadata={"help": "model width"})
    num_layers: int = field(default=4, metadata={"help": "transformer layers"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_kv_heads: int = field(
        default=2,
        metadata={"help": "key/value heads (grouped-query attention); divides num_heads"},
    )
    intermediate_size: int = field(default=384, metadata={"help": "MLP width"})
    max_position_embeddings: int = field(
        default=512, metadata={"help": "context length; must fit the longest prompt + solution"}
    )
    sft_steps: int = field(default=3000, metadata={"help": "supervised warm-up steps"})
    sft_batch_tokens: int = field(
        default=1024,
        metadata={"help": "warm-up batch size in tokens (padded prompt + response)"},
    )
    sft_lr: float = field(default=1e-3, metadata={"help": "warm-up peak learning rate (AdamW)"})
    sft_problems: int = field(
        default=10000, metadata={"help": "distinct problems in the warm-up set"}
    )
    sft_alpha: float | None = field(
        default=1.0,
        metadata={
            "help": "tail exponent of the warm-up problems' digit count (P(d) ~ d**-alpha); "
            "unset uses task.alpha. Smaller than the task's shows the warm-up more long "
            "additions, so that RL's long prompts are solvable some of the time"
        },
    )
    sft_slip: float = field(
        default=0.3,
        metadata={
            "help": "share of warm-up solutions whose final answer has one digit wrong: "
            "the model learns to slip now and then, which RL then trains away"
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the tokenizer corpus, init and warm-up"}
    )
    task: ArithSpec = field(
        default_factory=ArithSpec, metadata={"help": "the arithmetic task the model learns"}
    )

    def __post_init__(self) -> None:
        whole(
            self, "hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
            "intermediate_size", "max_position_embeddings", "sft_batch_tokens", "sft_problems",
        )
        if self.vocab_size < 256 + _SPECIAL_TOKENS:
            raise bad("vocab_size", f"must be >= {256 + _SPECIAL_TOKENS}, got {self.vocab_size!r}")
        if not (isinstance(self.sft_steps, int) and self.sft_steps >= 0):
            raise bad("sft_steps", f"must be an integer >= 0, got {self.sft_steps!r}")
        if self.hidden_size % self.num_heads:
            raise bad(
                "hidden_size",
                f"({self.hidden_size}) must be divisible by num_heads ({self.num_heads})",
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise bad(
                "hidden_size",
                f"/ num_heads must be even (rotary), got {self.hidden_size // self.num_heads}",
            )
        if self.num_heads % self.num_kv_heads:
            raise bad(
                "num_kv_heads", f"({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.sft_alpha is not None and not (
            math.isfinite(self.sft_alpha) and self.sft_alpha >= 0
        ):
            raise bad("sft_alpha", f"must be a finite number >= 0, got {self.sft_alpha!r}")
        if not 0 <= self.sft_slip < 1:
            raise bad("sft_slip", f"must be in [0, 1), got {self.sft_slip!r}")
        if not (math.isfinite(self.sft_lr) and self.sft_lr > 0):
            raise bad("sft_lr", f"must be a finite number > 0, got {self.sft_lr!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.task, ArithSpec):
            raise bad("task", f"must be an ArithSpec, got {self.task!r}")


@dataclass(frozen=True, slots=True)
class ToolAddTinySpec(TinySpec):
    """The tiny model of the multi-turn task (data.task=tool_add, rpk.tasks.tiny_multi):
    TinySpec with other defaults: its trajectories (a 20-digit sum with retries is ~850
    tokens) outgrow arith's context, its vocabulary has the tool calls' words, and each
    warm-up step costs more (3000 steps build in ~5 min on 2 cores)."""

    vocab_size: int = opt(384, "BPE vocabulary target (>= 259: 256 bytes plus 3 special tokens)")
    max_position_embeddings: int = opt(
        1024, "context length; must fit the longest prompt + trajectory"
    )
    sft_steps: int = opt(3000, "supervised warm-up steps")
    sft_problems: int = opt(8000, "distinct problems in the warm-up set")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str | None = opt(
        None,
        "a local HF model directory, or a Hugging Face Hub id (Qwen/Qwen2.5-7B-Instruct: "
        "downloaded once into the HF cache, offline after); unset builds rpk's tiny model",
    )
    hub_cache: str | None = opt(
        None, "where Hub models are cached; unset = huggingface_hub's (HF_HOME, HF_HUB_CACHE)"
    )
    cache_dir: str = opt(".cache/rpk", "where built models are cached, keyed by their spec")
    tiny: TinySpec = field(default_factory=TinySpec)
    tiny_tool_add: ToolAddTinySpec = field(default_factory=ToolAddTinySpec)


# The built-in tasks (`data.task`); which of them are multi-turn (`rpk.agent`).
TASKS = ("arith", "tool_add")
MULTI_TURN_TASKS = ("tool_add",)


@dataclass(frozen=True, slots=True)
class DataConfig:
    task: str = opt(
        "arith",
        "the built-in task when train_files is empty: arith (single-turn additions) or "
        "tool_add (multi-turn: long additions through a 4-digit adder tool)",
    )
    train_files: tuple[str, ...] = opt(
        (), "jsonl/parquet files in veRL's layout; empty uses the built-in arithmetic task"
    )
    builtin_size: int = opt(4096, "number of built-in task prompts generated (one epoch)")
    max_prompt_tokens: int = opt(256, "rows whose templated prompt is longer are errors")
    shuffle: bool = opt(True, "shuffle the prompts each epoch (seeded by run.seed)")
    val_files: tuple[str, ...] = opt(
        (),
        "validation files in veRL's layout (scored like train_files); empty: the built-in "
        "task's held-out split, or no validation when train_files is set",
    )
    val_size: int = opt(
        512,
        "built-in task: held-out validation prompts, none equal to a training prompt (512: "
        "a standard error of about 0.02); 0 = none",
    )

    def __post_init__(self) -> None:
        positive(self, "builtin_size", "max_prompt_tokens")
        non_negative(self, "val_size")
        if self.task not in TASKS:
            raise bad("task", f"{self.task!r} is not one of {', '.join(TASKS)}")
