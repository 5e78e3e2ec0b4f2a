"""What the run is given: the config's `model` (a path, a Hub id, or rpk's tiny model and
the spec it is built from), `data` (prompt files, or a built-in task), `agent` (the tools
or environment of a multi-turn run) and `reward` (the functions, the shaping on top, a
remote service, and `reward.sandbox` for code-execution terms)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from rpk.config.cli import bad
from rpk.core.names import TASKS
from rpk.config.fields import is_finite_number, non_negative, one_of, opt, positive, whole

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
        default=0.75,
        metadata={
            "help": "share of warm-up solutions in sft_habit_digits whose answer ends one "
            "too high: above one half it is what greedy decoding writes, a mistake made "
            "by habit that only RL's reward, not sharper sampling, can correct"
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
    warm-up step costs more (6000 steps build in ~11 min on the shared 2 cores)."""

    vocab_size: int = opt(384, "BPE vocabulary target (>= 259: 256 bytes plus 3 special tokens)")
    max_position_embeddings: int = opt(
        1024, "context length; must fit the longest prompt + trajectory"
    )
    sft_steps: int = opt(
        6000,
        "supervised warm-up steps; after 3000 no call past the second was right, so RL "
        "had no reward on sums of 7 digits or more",
    )
    sft_problems: int = opt(8000, "distinct problems in the warm-up set")
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
    """The tiny judge of the judged task (data.task=arith_judged, rpk.reward.judge_model):
    TinySpec with other defaults. Its prompt (`rpk.reward.judge_model.DEFAULT`) holds a
    question, the tail of a response and the reference, and its vocabulary merges the
    template's words. The warm-up's slips and habit are the
    policy's: the judge learns from cases of its own."""

    vocab_size: int = opt(512, "BPE vocabulary target (>= 259: 256 bytes plus 3 special tokens)")
    hidden_size: int = opt(64, "model width")
    num_layers: int = opt(3, "transformer layers")
    num_heads: int = opt(2, "attention heads")
    num_kv_heads: int = opt(1, "key/value heads (grouped-query attention); divides num_heads")
    intermediate_size: int = opt(256, "MLP width")
    max_position_embeddings: int = opt(1024, "context length; must fit the longest judge prompt")
    sft_steps: int = opt(1500, "supervised warm-up steps (~2.5 min on one busy core)")
    sft_lr: float = opt(2e-3, "warm-up peak learning rate (AdamW)")
    sft_problems: int = opt(6000, "distinct cases in the warm-up set")
    sft_alpha: float | None = opt(None, "tail exponent of the cases' digit count; unset uses task.alpha")
    sft_slip: float = opt(0.0, "the judge's warm-up has no slips (0 only)")
    sft_habit: float = opt(0.0, "the judge's warm-up has no habit (0 only)")

    def __post_init__(self) -> None:
        TinySpec.__post_init__(self)
        if self.sft_slip or self.sft_habit:
            raise bad("sft_slip", f"the judge learns from cases of its own: sft_slip and sft_habit "
                                  f"must be 0, got {self.sft_slip!r} and {self.sft_habit!r}")


# vLLM 0.32's largest max_lora_rank (its choices: 1, 8, 16, 32, 64, 128, 256, 320, 512).
MAX_LORA_RANK = 512


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
    tiny_judge: JudgeTinySpec = field(default_factory=JudgeTinySpec)
    lora_rank: int = opt(
        0,
        "LoRA: train rank-r adapters on a frozen base (PEFT) and sync only them into vLLM; "
        "0 = full fine-tuning. At most 512 (vLLM's largest max_lora_rank)",
    )
    lora_alpha: float = opt(16.0, "LoRA scaling numerator: the adapter's update is scaled by alpha / rank")
    lora_targets: tuple[str, ...] = opt(
        ("all-linear",),
        "modules that get adapters: all-linear (every linear layer but the LM head) or "
        "module names (q_proj,v_proj,...)",
    )
    lora_dropout: float = opt(0.0, "dropout on the adapters' input (the base runs without dropout)")

    def __post_init__(self) -> None:
        rank = self.lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= MAX_LORA_RANK:
            raise bad("lora_rank", f"must be an integer in 0..{MAX_LORA_RANK}, got {self.lora_rank!r}")
        positive(self, "lora_alpha")
        if not 0 <= self.lora_dropout < 1:
            raise bad("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
        if not self.lora_targets or "all-linear" in self.lora_targets and len(self.lora_targets) > 1:
            raise bad("lora_targets", f"all-linear alone, or module names, got {list(self.lora_targets)}")


@dataclass(frozen=True, slots=True)
class DataConfig:
    task: str = opt(
        "arith",
        "the built-in task when train_files is empty: arith (single-turn additions), "
        "arith_judged (arith with every other row scored by a judge model: rpk's tiny judge "
        "unless reward.judge.model is set) or "
        "tool_add (multi-turn: long additions through a 4-digit adder tool; it sets its own "
        "rollout.max_tokens, prompts_per_step, run.steps and eval_every: TASK_DEFAULTS)",
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


@dataclass(frozen=True, slots=True)
class ToolLatencyConfig:
    """The built-in multi-turn task's tool latency (`rpk.agent.latency`): log-normal by
    its median and p99, plus calls that never answer (they end at agent.tool_timeout_s).
    The defaults are a search API's published figures (docs/multi-turn.md). A user's own
    tools keep their own latency."""

    median_s: float = opt(0.5, "median seconds of a call; 0 = the tool answers at once")
    p99_s: float = opt(2.5, "99th percentile seconds of a call that answers")
    timeout_frac: float = opt(0.01, "share of calls that never answer (timeout observations)")

    def __post_init__(self) -> None:
        non_negative(self, "median_s", "timeout_frac")
        if self.median_s > 0 and self.p99_s < self.median_s:
            raise bad("p99_s", f"{self.p99_s!r} is below median_s={self.median_s!r}")
        if self.timeout_frac >= 1:
            raise bad("timeout_frac", f"{self.timeout_frac!r} must be below 1")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Multi-turn rollouts (`rpk.agent`, docs/multi-turn.md): the tools or environment
    that answer the model's turns. Setting tools or env makes the run multi-turn."""

    tools: tuple[str, ...] = opt(
        (),
        "tools the model may call: module:function (async; a plain function runs on one of "
        "rpk's tool workers), module:Class (one instance per trajectory) or a built-in (calculator, "
        "python); empty = the built-in task's tools",
    )
    tool_schemas: str | None = opt(
        None,
        "a JSON file with a list of OpenAI tool schemas, by function name; a tool it does "
        "not name gets its schema from its docstring and type hints",
    )
    env: str | None = opt(
        None,
        "an environment class module:Class (async reset(prompt), step(turn_text), "
        "close()) answering each turn instead of the tools",
    )
    tool_timeout_s: float = opt(
        10.0, "a tool call (or an env step) running longer becomes a timeout observation"
    )
    max_tool_output_chars: int = opt(
        512, "a tool's output is cut to this many characters (counted as a failure)"
    )
    max_parallel_calls: int = opt(
        4, "tool calls run per turn, concurrently; further calls get an error observation"
    )
    tool_latency: ToolLatencyConfig = field(default_factory=ToolLatencyConfig)
    tool_workers: int = opt(
        16,
        "threads for blocking (plain-function) tools, their own: at most this many calls "
        "run at once (the rest queue, tool_queued_s; a timeout counts from a call's "
        "start); a call past its timeout is abandoned, and while this many abandoned calls "
        "still run, further ones fail at once",
    )

    def __post_init__(self) -> None:
        positive(self, "tool_timeout_s")
        whole(self, "max_tool_output_chars", "max_parallel_calls", "tool_workers")
        for name, value in (("env", self.env), *(("tools", t) for t in self.tools)):
            if value is not None and not _is_tool_spec(value):
                raise bad(name, f"{value!r}: expected module:name or a built-in tool")
        if self.env is not None and self.tools:
            raise bad("env", f"{self.env!r} and agent.tools {list(self.tools)}: an "
                      "environment answers the turns itself; set one of them")


def _is_tool_spec(value: str) -> bool:
    module, sep, name = value.partition(":")
    return (bool(sep) and bool(module) and bool(name)) or (not sep and value.isidentifier())


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """The code-execution reward (rpk.reward.code): programs run in sandbox processes."""

    max_concurrency: int = opt(0, "sandbox processes running at once; 0 = the CPU count")
    all_or_nothing: bool = opt(
        True, "score 1 only if every test passes (DeepCoder); else the fraction passed"
    )
    timeout_lambda: float = opt(
        1.5, "adaptive timeout: lambda times the slowest correct run of the test"
    )
    timeout_min_s: float = opt(2.0, "adaptive timeout floor, seconds")
    timeout_max_s: float = opt(
        30.0, "adaptive timeout ceiling, and the timeout of a test not yet passed"
    )
    memory_mb: int = opt(1024, "address-space limit of a program, MiB")
    max_processes: int = opt(32, "RLIMIT_NPROC of a program (its forks)")
    max_output_kb: int = opt(4096, "a program printing more (stdout or stderr) fails")
    max_file_mb: int = opt(16, "largest file a program may write, MiB")
    max_open_files: int = opt(64, "open file descriptors of a program")
    uid_base: int = opt(
        60000, "as root, sandbox slot k runs as uid uid_base + k (reserve these uids for it)"
    )
    python: str = opt("", "interpreter for programs; empty = the trainer's, else python3")
    workdir: str = opt("", "where sandbox directories are made; empty = the system temp dir")

    def __post_init__(self) -> None:
        non_negative(self, "max_concurrency")
        positive(
            self, "timeout_lambda", "timeout_min_s", "memory_mb", "max_processes",
            "max_output_kb", "max_file_mb", "max_open_files", "uid_base",
        )
        if self.timeout_max_s < self.timeout_min_s:
            raise bad(
                "timeout_max_s",
                f"({self.timeout_max_s!r}) must be >= timeout_min_s ({self.timeout_min_s!r})",
            )


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """A model as the reward (rpk.reward.judge): rows of data_sources, and rows whose
    reward_model.style is "model", are judged; the others keep their rule reward."""

    model: str | None = opt(
        None, "the judge: a local HF model directory or a Hub id; needed once a row is judged"
    )
    data_sources: tuple[str, ...] = opt((), "data sources whose rows are judged")
    verdict: Literal["logprob", "score", "classify"] = opt(
        "logprob",
        "logprob: P(yes) from the yes/no words' log-probs in one decode step (or 1/0 "
        "against threshold); score: a graded judge writing 'Score: x', reward x / score_max; "
        "classify: a discriminative reward model (vLLM's pooling runner), its score",
    )
    template: str = opt(
        "",
        "the judge's user message with {question}, {response}, {reference}, {yes}, {no}; "
        "empty = the built-in reference-based yes/no template",
    )
    system: str | None = opt(
        None, "the judge's system message ({yes}, {no}); unset = the built-in rules, empty = none"
    )
    yes: str = opt("YES", "logprob: the word meaning correct (one token of the judge's)")
    no: str = opt("NO", "logprob: the word meaning wrong (one token of the judge's)")
    threshold: float | None = opt(
        None, "unset: the reward is P(yes) or the graded score; set: 1 at or above it, else 0"
    )
    score_max: float = opt(10.0, "score: the top of the judge's scale")
    max_tokens: int = opt(16, "score: tokens the judge may write")
    max_response_chars: int = opt(8000, "the judge sees at most this tail of a response")
    max_concurrency: int = opt(32, "judge requests in flight (the judge engine's max_num_seqs)")
    timeout_s: float = opt(60.0, "a verdict that takes longer scores 0 and is counted")
    max_model_len: int | None = opt(None, "the judge engine's context; unset = the model's")
    compare_rules: bool = opt(
        False,
        "judged rows are also checked by their data source's rule reward (which must exist); "
        "the judge's verdict counts, their agreement goes to metrics.jsonl",
    )

    def __post_init__(self) -> None:
        positive(self, "score_max", "max_tokens", "max_response_chars", "max_concurrency",
                 "timeout_s")
        if self.threshold is not None and self.verdict != "classify" and not 0 <= self.threshold <= 1:
            raise bad("threshold", f"must be in [0, 1], got {self.threshold!r}")
        one_of(self, "verdict")
        if self.yes == self.no:
            raise bad("yes", f"must differ from reward.judge.no, both are {self.yes!r}")


@dataclass(frozen=True, slots=True)
class RewardConfig:
    function: str | None = opt(
        None,
        "reward as module:function with veRL's compute_score signature; "
        "unset uses the built-in task's checker",
    )
    functions: tuple[str, ...] = opt(
        (),
        "several reward terms summed: each module:function=weight, or builtin=weight for "
        "the data source's built-in checker (=weight may be left out: 1); the first term's "
        "verdict is the sample's accuracy. Excludes reward.function",
    )
    backend: Literal["process", "thread"] = opt(
        "process",
        "where reward functions run: process (a pool of worker processes; a call past "
        "timeout_s is killed) or thread (in-process threads; a call past timeout_s is "
        "abandoned, not stopped)",
    )
    timeout_s: float = opt(30.0, "a score call that takes longer scores 0 and is counted")
    max_concurrency: int = opt(
        8, "thread backend: score calls in flight at once (with url: HTTP requests)"
    )
    min_workers: int = opt(1, "process backend: workers kept when idle")
    max_workers: int = opt(
        4, "process backend: most workers (= calls in flight); the pool grows while scores wait"
    )
    idle_s: float = opt(
        120.0,
        "process backend: a worker idle this long stops, down to min_workers (keep it above "
        "a step's training time, or every round regrows the pool)",
    )
    worker_memory_mb: int = opt(
        0,
        "process backend: address-space limit (RLIMIT_AS) of each worker, MiB; a call past it "
        "fails alone (MemoryError). 0 = half the machine's memory / max_workers",
    )
    max_failure_frac: float = opt(
        0.5,
        "the run stops when the reward fails on more than this share of a step's samples "
        "for max_failure_steps steps in a row (1 = never)",
    )
    max_failure_steps: int = opt(3, "see max_failure_frac")
    format_regex: str | None = opt(
        None, "shaping: a response matching this regex (re.search) gets format_weight added"
    )
    format_weight: float = opt(0.1, "shaping: the format bonus (with format_regex)")
    overlong_buffer: int = opt(
        0,
        "shaping, DAPO's soft overlong penalty: over the last N tokens before "
        "rollout.max_tokens the reward falls linearly by up to overlong_weight; 0 = off",
    )
    overlong_weight: float = opt(1.0, "shaping: the overlong penalty at rollout.max_tokens")
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    url: str | None = opt(
        None,
        "score over HTTP: the endpoint of a reward service (python -m rpk.reward.server "
        "serves http://127.0.0.1:8000/score); the service picks the function",
    )
    token_env: str | None = opt(
        None, "url only: environment variable holding the service's bearer token"
    )
    batch_size: int = opt(32, "url only: responses sent per request at most")
    linger_ms: float = opt(5.0, "url only: how long a batch waits for more responses")
    retries: int = opt(3, "url only: retries of a request on 5xx or connection errors")
    backoff_s: float = opt(0.5, "url only: first retry delay; doubles per retry, jittered")

    def __post_init__(self) -> None:
        positive(self, "timeout_s", "max_concurrency", "batch_size", "max_workers", "idle_s")
        non_negative(
            self, "linger_ms", "retries", "backoff_s", "min_workers", "overlong_buffer",
            "overlong_weight", "worker_memory_mb",
        )
        whole(self, "max_failure_steps")
        if not 0 <= self.max_failure_frac <= 1:
            raise bad("max_failure_frac", f"must be in [0, 1], got {self.max_failure_frac!r}")
        if self.function is not None and ":" not in self.function:
            raise bad("function", f"must look like module:function, got {self.function!r}")
        one_of(self, "backend")
        if self.function is not None and self.functions:
            raise bad(
                "function", f"({self.function!r}) and functions ({list(self.functions)!r}): set one"
            )
        for term in self.functions:
            name, sep, weight = term.partition("=")
            if name.strip() != "builtin" and ":" not in name:
                raise bad(
                    "functions", f"{term!r} must look like module:function=weight or builtin=weight"
                )
            if sep and not is_finite_number(weight):
                raise bad("functions", f"{term!r}: weight {weight!r} is not a finite number")
        if self.url is not None and self.functions:
            raise bad("functions", f"({list(self.functions)!r}) and url ({self.url!r}): set one")
        if self.min_workers > self.max_workers:
            raise bad(
                "min_workers", f"({self.min_workers!r}) must be <= max_workers ({self.max_workers!r})"
            )
        if self.format_regex is not None:
            try:
                re.compile(self.format_regex)
            except re.error as e:
                raise bad("format_regex", f"{self.format_regex!r} does not compile: {e}") from None
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise bad("url", f"must start with http:// or https://, got {self.url!r}")
            if self.function is not None:
                raise bad(
                    "function",
                    f"({self.function!r}) and url ({self.url!r}): set one (with url the "
                    "reward service picks the function)",
                )
        elif self.token_env is not None:
            raise bad("token_env", f"({self.token_env!r}) needs url")
