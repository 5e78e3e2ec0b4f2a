"""What a built-in task is made from: `ArithSpec` (how the arithmetic tasks draw their
prompts) and `TinySpec` (rpk's tiny model and the warm-up that teaches it a task), with
the tool task's and the judge's variants. The config's `data` and `model` sections hold
them; the tasks read them without importing the config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rpk.core.errors import bad
from rpk.core.fields import again, opt, whole

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
    sft_habit: float = field(
        default=0.9,
        metadata={
            "help": "share of warm-up solutions in sft_habit_digits whose answer ends one "
            "too high. The tiny model learns it less sharply than it is taught, so the share "
            "sits well above one half for greedy decoding to write it: a mistake made by "
            "habit that only RL's reward, not sharper sampling, can correct "
            "(docs/default-run.md)"
        },
    )
    sft_habit_digits: tuple[int, int] = field(
        default=(4, 6),
        metadata={"help": "the digit counts (lowest, highest) the warm-up's habit applies to"},
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
        if not 0 <= self.sft_habit < 1:
            raise bad("sft_habit", f"must be in [0, 1), got {self.sft_habit!r}")
        lo, hi = self.sft_habit_digits
        if not 1 <= lo <= hi:
            raise bad(
                "sft_habit_digits",
                f"must be (lowest, highest), 1 <= lowest <= highest, got {self.sft_habit_digits!r}",
            )
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
    warm-up step costs more (docs/default-run.md gives its build time)."""

    vocab_size: int = again(TinySpec, "vocab_size", 384)
    max_position_embeddings: int = opt(
        1024, "context length; must fit the longest prompt + trajectory"
    )
    sft_steps: int = opt(
        6000,
        "supervised warm-up steps; the calls past the second need this many to come out "
        "right at all, without which RL has no reward on sums of 7 digits or more",
    )
    sft_problems: int = again(TinySpec, "sft_problems", 8000)
    sft_habit: float = opt(
        0.65,
        "share of the warm-up's trajectories in sft_habit_digits that answer before their "
        "last call: above one half it is what greedy decoding does, an agent's mistake "
        "only RL's reward corrects",
    )
    sft_habit_digits: tuple[int, int] = opt(
        (5, 20), "the digit counts (lowest, highest) the warm-up's habit applies to: multi-call sums"
    )


@dataclass(frozen=True, slots=True)
class JudgeTinySpec(TinySpec):
    """The tiny judge of the judged task (data.task=arith_judged, rpk.judge.tiny):
    TinySpec with other defaults. Its prompt (`rpk.judge.tiny.DEFAULT`) holds the
    response's final answer line and the reference, and it writes a scratchpad of label
    look-ups before its verdict: two full heads a layer (a look-up by label is a
    previous-token head and an induction head, each needing keys of its own) of size 32
    (vLLM's CPU attention has no kernel for 16), a context for the longest prompt and
    scratchpad, and its vocabulary merges the template's words. Its warm-up is long and
    wide (8000 steps of 4096 tokens, ~30 cases a step): a fifth of that (6000 steps of
    1024) left it guessing the digits it looks up (docs/reward.md). The warm-up's slips
    and habit are the policy's: the judge learns from cases of its own."""

    vocab_size: int = again(TinySpec, "vocab_size", 512)
    hidden_size: int = again(TinySpec, "hidden_size", 64)
    num_layers: int = again(TinySpec, "num_layers", 4)
    num_heads: int = again(TinySpec, "num_heads", 2)
    num_kv_heads: int = again(TinySpec, "num_kv_heads", 2)
    intermediate_size: int = again(TinySpec, "intermediate_size", 256)
    max_position_embeddings: int = opt(512, "context length; must fit the longest judge prompt and scratchpad")
    sft_steps: int = again(TinySpec, "sft_steps", 8000)
    sft_batch_tokens: int = again(TinySpec, "sft_batch_tokens", 4096)
    sft_lr: float = again(TinySpec, "sft_lr", 3e-3)
    sft_problems: int = opt(100000, "distinct cases in the warm-up set")
    sft_alpha: float | None = opt(
        0.3, "tail exponent of the cases' digit count (0.3: long answers often, where a look-up "
        "is likeliest to slip); unset uses task.alpha")
    sft_slip: float = opt(0.0, "the judge's warm-up has no slips (0 only)")
    sft_habit: float = opt(0.0, "the judge's warm-up has no habit (0 only)")

    def __post_init__(self) -> None:
        TinySpec.__post_init__(self)
        if self.sft_slip or self.sft_habit:
            raise bad("sft_slip", f"the judge learns from cases of its own: sft_slip and sft_habit "
                                  f"must be 0, got {self.sft_slip!r} and {self.sft_habit!r}")
