"""rpk's configuration: one tree of frozen dataclasses.

Set fields in a YAML file (`--config run.yaml`, nested sections) or on the command line
(`--train.lr 1e-5`); `python -m rpk.run --help` lists them all. Each section checks its
own values and names the offending field and value.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from rpk.cli_config import ConfigError, bad, build, dump_yaml, help_text, load
from rpk.core.names import POLICIES, TRACKERS

__all__ = ["Config", "ConfigError", "from_argv", "build", "dump_yaml"]

# The tiny model's tokenizer reserves these ids after the 256 bytes (rpk.tasks.tiny).
_SPECIAL_TOKENS = 3
# The built-in task labels each column with a letter (rpk.tasks.arith): the alphabet is
# the hard cap on its digit count.
ARITH_MAX_DIGITS = 26


def opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise bad(name, f"must be > 0, got {value!r}")


def _whole(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise bad(name, f"must be a positive integer, got {value!r}")


def _is_finite_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _non_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value >= 0:
            raise bad(name, f"must be >= 0, got {value!r}")


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
        _whole(
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
        _positive(self, "builtin_size", "max_prompt_tokens")
        _non_negative(self, "val_size")
        if self.task not in TASKS:
            raise bad("task", f"{self.task!r} is not one of {', '.join(TASKS)}")


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    policy: str = opt(
        "tail",
        "round scheduling: tail (RollPacker's tail batching: over-provisioned short rounds, "
        "unfinished prompts deferred to long rounds), sync (veRL: every response runs to "
        "the end), oversample (launch more, keep the first P0 groups, drop the rest) or "
        "partial (APRIL: launch more, continue the unfinished responses next step) or "
        "length_aware (tail batching packed by learned length guesses, adaptive eta)",
    )
    eta_prompts: float = opt(
        1.25, "tail, oversample, partial: a short round launches eta_prompts * P0 prompts"
    )
    eta_responses: float = opt(
        1.25, "tail, oversample: ... with eta_responses * R0 responses each (partial: R0)"
    )
    lookahead_rounds: int = opt(
        10,
        "length_aware: prompts are drawn lookahead_rounds * P0 at a time and packed into "
        "rounds by guessed length; the P0 guessed longest make the last, long round",
    )
    adaptive_eta: bool = opt(
        True,
        "length_aware: choose each short round's speculation from the length guesses and "
        "the measured engine cost (false: eta_prompts / eta_responses, no defer cap)",
    )
    eta_prompts_min: float = opt(1.0, "length_aware, adaptive: lower bound of eta_prompts")
    eta_prompts_max: float = opt(1.5, "length_aware, adaptive: upper bound of eta_prompts")
    eta_responses_min: float = opt(1.0, "length_aware, adaptive: lower bound of eta_responses")
    eta_responses_max: float = opt(1.5, "length_aware, adaptive: upper bound of eta_responses")
    dynamic_sampling: bool = opt(
        False,
        "DAPO dynamic sampling: groups whose rewards are all equal are not trained, not "
        "counted towards P0 and not deferred",
    )
    prompts_per_step: int = opt(32, "P0: prompts (GRPO groups) trained per step")
    responses_per_prompt: int = opt(8, "R0: responses per prompt (the group size)")
    max_tokens: int = opt(
        320,
        "length budget of one response, in tokens (a multi-turn trajectory's: its model "
        "and observation tokens together)",
    )
    max_turns: int = opt(8, "multi-turn tasks: model turns per trajectory at most")
    temperature: float = opt(1.0, "sampling temperature (the trainer uses the same)")
    top_p: float = opt(1.0, "nucleus sampling")
    max_num_seqs: int = opt(
        512,
        "engine concurrency per rollout device (a TP-t replica decodes t times as many): "
        "requests decoded at once; tail batching wants a whole short round "
        "(eta_p*P0 x eta_r*R0) in flight, or late prompts wait behind early ones",
    )
    max_model_len: int = opt(0, "engine context length (prompt + response); 0 = the model's")
    kv_cache_mb: int = opt(
        512, "KV-cache memory per rollout device, MiB (CPU engine): a TP-t replica has t times it"
    )
    dtype: str = opt("auto", "engine dtype; auto = float32 on CPU, bfloat16 on GPU")
    gpu_memory_utilization: float = opt(
        0.5,
        "memory fraction passed to vLLM on CPU (where kv_cache_mb sizes the cache); on CUDA "
        "the memory plan sets it (python -m rpk.run --run.dry_run true shows it)",
    )
    tp: Literal["fixed", "elastic"] = opt(
        "fixed",
        "rollout tensor parallelism: fixed (tp_size), or elastic (RollPacker's planner picks "
        "the TP per round kind among tp_sizes: rising preemptions double it, 4 rounds "
        "without halve it)",
    )
    tp_size: int = opt(1, "TP of each rollout replica: the fixed one, or elastic's first")
    tp_sizes: tuple[int, ...] = opt(
        (),
        "the layouts built, e.g. 1,2 (each covers the rollout devices with replicas of "
        "one TP); empty = tp_size alone (fixed) or the powers of two up to the device "
        "count (elastic)",
    )
    devices: tuple[int, ...] = opt(
        (),
        "devices the rollout uses, e.g. 0,1 (GPU ids; cores on CPU); empty = the first "
        "max(tp_sizes), a lone TP-1 replica left unpinned",
    )
    tp_switch: Literal["sleep", "restart"] = opt(
        "sleep",
        "how layouts not in use wait: asleep (started once; on GPU vLLM's level-2 sleep "
        "drops their weights) or stopped (restarted on a switch, where they do not fit)",
    )
    colocate: bool | None = opt(
        None,
        "rollout and training share the devices: the replicas sleep while the trainer "
        "trains and wake in two parts around the weight sync (weights, sync, the trainer's "
        "state to host, KV cache). Unset: on with CUDA, off on CPU (true runs every call there)",
    )
    weight_bucket_mb: int = opt(256, "weight sync sends the weights in buckets of this size, MiB")
    weight_transfer: Literal["shm", "gloo", "cpu_ipc", "auto", "ipc", "nccl"] = opt(
        "auto",
        "weight path into the replicas: shm (safetensors bucket files in /dev/shm, loaded "
        "by every replica), gloo (vLLM's weight-transfer protocol over a gloo group: the "
        "trainer broadcasts to every worker), cpu_ipc (the same protocol with handles to "
        "shared-memory staging files: CPU replicas on the trainer's machine), ipc / nccl "
        "(vLLM's CUDA transfer engines), auto (cpu_ipc on CPU, the fastest measured; on "
        "GPU ipc for a replica on the trainer's GPU and nccl for the others)",
    )

    def __post_init__(self) -> None:
        _positive(
            self, "prompts_per_step", "responses_per_prompt", "max_tokens",
            "max_num_seqs", "kv_cache_mb", "weight_bucket_mb",
        )
        if self.colocate not in (None, True, False):
            raise bad("colocate", f"must be true, false or unset, got {self.colocate!r}")
        choices = {"tp": ("fixed", "elastic"), "tp_switch": ("sleep", "restart"),
                   "weight_transfer": ("shm", "gloo", "cpu_ipc", "auto", "ipc", "nccl")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _non_negative(self, "max_model_len")
        _non_negative(self, "temperature")
        if self.policy not in POLICIES:
            raise bad("policy", f"{self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in (
            "eta_prompts", "eta_responses", "eta_prompts_min", "eta_prompts_max",
            "eta_responses_min", "eta_responses_max",
        ):
            if not getattr(self, name) >= 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)!r}")
        for kind in ("prompts", "responses"):
            lo, hi = getattr(self, f"eta_{kind}_min"), getattr(self, f"eta_{kind}_max")
            if hi < lo:
                raise bad(f"eta_{kind}_max", f"({hi!r}) must be >= eta_{kind}_min ({lo!r})")
        _whole(self, "lookahead_rounds", "max_turns")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.responses_per_prompt < 2:
            raise bad(
                "responses_per_prompt",
                f"must be >= 2 for group-relative advantages, got {self.responses_per_prompt!r}",
            )
        if self.max_model_len and self.max_tokens >= self.max_model_len:
            raise bad(
                "max_tokens", f"({self.max_tokens}) must be < max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Multi-turn rollouts (`rpk.agent`, docs/multi-turn.md): the tools or environment
    that answer the model's turns. Setting tools or env makes the run multi-turn."""

    tools: tuple[str, ...] = opt(
        (),
        "tools the model may call: module:function (async; a plain function runs on a "
        "thread), module:Class (one instance per trajectory) or a built-in (calculator, "
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

    def __post_init__(self) -> None:
        _positive(self, "tool_timeout_s")
        _whole(self, "max_tool_output_chars", "max_parallel_calls")
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
        _non_negative(self, "max_concurrency")
        _positive(
            self, "timeout_lambda", "timeout_min_s", "memory_mb", "max_processes",
            "max_output_kb", "max_file_mb", "max_open_files", "uid_base",
        )
        if self.timeout_max_s < self.timeout_min_s:
            raise bad(
                "timeout_max_s",
                f"({self.timeout_max_s!r}) must be >= timeout_min_s ({self.timeout_min_s!r})",
            )


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
        _positive(self, "timeout_s", "max_concurrency", "batch_size", "max_workers", "idle_s")
        _non_negative(
            self, "linger_ms", "retries", "backoff_s", "min_workers", "overlong_buffer",
            "overlong_weight", "worker_memory_mb",
        )
        _whole(self, "max_failure_steps")
        if not 0 <= self.max_failure_frac <= 1:
            raise bad("max_failure_frac", f"must be in [0, 1], got {self.max_failure_frac!r}")
        if self.function is not None and ":" not in self.function:
            raise bad("function", f"must look like module:function, got {self.function!r}")
        if self.backend not in ("process", "thread"):
            raise bad("backend", f"must be process or thread, got {self.backend!r}")
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
            if sep and not _is_finite_number(weight):
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


@dataclass(frozen=True, slots=True)
class TrainConfig:
    lr: float = opt(
        5e-5,
        "AdamW learning rate (2e-4 unlearned the tiny model's solved additions: "
        "docs/benchmarks.md, 'Learning rate')",
    )
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm; 0 = no clipping (the norm is still reported)")
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = opt(
        "grpo", "policy loss (rpk/train/losses.py: LOSSES); it also picks the advantage"
    )
    clip_low: float | None = opt(
        None, "PPO clip: ratio floor is 1 - clip_low; unset = the loss's (0.2, gspo 3e-4)"
    )
    clip_high: float | None = opt(
        None,
        "PPO clip: ratio ceiling is 1 + clip_high; unset = the loss's (0.2, dapo 0.28, gspo 4e-4)",
    )
    overlong_filter: bool | None = opt(
        None, "leave truncated responses out of the loss; unset = on for dapo only"
    )
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial model; 0 loads no reference model")
    entropy_coef: float = opt(0.0, "entropy bonus (subtracted from the loss per token)")
    micro_batch_tokens: int = opt(8192, "token budget of one micro-batch (grad accumulation)")
    torch_threads: int = opt(
        0,
        "trainer intra-op CPU threads, set on the trainer's thread at each step (torch's "
        "count is process-wide, OpenMP's per thread); 0 = torch's default (all cores)",
    )
    device: str = opt("auto", "trainer device: auto, cpu or cuda")
    activation_checkpointing: bool | None = opt(
        None,
        "recompute each decoder layer in backward, keeping only its input: a sequence's "
        "activations are one layer's, not all layers' (unset: on with CUDA, off on CPU)",
    )
    defer_reduction: bool | None = opt(
        None,
        "sharded: keep the gradients unsharded and reduce them once at the step's end "
        "(float32, the whole model on every rank); false reduce-scatters after every "
        "micro-batch. Unset: defer where the memory plan fits it (always on CPU)",
    )
    offload: str = opt(
        "auto",
        "trainer state moved to host memory while vLLM generates (GPU): none, optimizer "
        "(AdamW's moments), all (and the parameter shards), or auto (the memory plan's)",
    )
    stream_mode: str = opt(
        "thread",
        "when the trainer works on completed groups: none (after the round), thread (on a "
        "trainer thread while the tail generates), borrow (the paper's stream trainer: half "
        "the rollout replicas hand their requests to the others and the trainer runs on "
        "their devices; needs >= 2 replicas, else thread)",
    )
    stream_start_frac: float = opt(
        0.0,
        "thread streaming starts once this fraction of the round's groups is complete (the "
        "paper uses 0.2-0.5; from the first group hid the most on the CPU measured)",
    )
    borrow_min_frac: float = opt(
        0.2, "borrow: lend once this fraction of the round's responses is done and still arriving"
    )
    borrow_max_frac: float = opt(
        0.5, "borrow: lend at the latest once this fraction of the round's responses is done"
    )
    borrow_check_s: float = opt(
        1.0,
        "borrow: seconds between the trigger's checks (responses still arriving: >= 5% of the "
        "round more than at the last check); keep it well under a round",
    )
    stream_chunk_tokens: int = opt(
        1024,
        "streaming hands the trainer a chunk once this many tokens wait: smaller chunks "
        "leave less to train after the round ends",
    )

    def __post_init__(self) -> None:
        _positive(self, "lr", "micro_batch_tokens", "stream_chunk_tokens")
        _non_negative(
            self, "weight_decay", "torch_threads", "kl_coef", "entropy_coef", "grad_clip"
        )
        if not 0 <= self.stream_start_frac <= 1:
            raise bad("stream_start_frac", f"must be in [0, 1], got {self.stream_start_frac!r}")
        if self.stream_mode not in ("none", "thread", "borrow"):
            raise bad("stream_mode", f"must be none, thread or borrow, got {self.stream_mode!r}")
        _non_negative(self, "borrow_check_s")
        if not 0 < self.borrow_min_frac <= self.borrow_max_frac <= 1:
            raise bad(
                "borrow_min_frac",
                f"and borrow_max_frac need 0 < min <= max <= 1, got {self.borrow_min_frac!r} "
                f"and {self.borrow_max_frac!r}",
            )
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) is not None:
                _non_negative(self, name)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.offload not in ("auto", "none", "optimizer", "all"):
            raise bad("offload", f"must be auto, none, optimizer or all, got {self.offload!r}")
        for name in ("activation_checkpointing", "defer_reduction"):
            if getattr(self, name) not in (None, True, False):
                raise bad(name, f"must be true, false or unset, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class RunConfig:
    steps: int = opt(60, "RL steps (one optimizer step each)")
    seed: int = opt(0, "seeds data order, sampling and the trainer")
    out_dir: str = opt("runs", "run directories go to OUT_DIR/<timestamp>/")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and always at the end); 0 = end only")
    resume: str | None = opt(
        None,
        "continue a run: its directory (runs/latest works; the newest complete checkpoint "
        "is taken) or one of its checkpoints; the run goes on in that directory",
    )
    keep_checkpoints: int = opt(
        0, "keep the newest N checkpoints, 0 = all; one holding a file named KEEP stays"
    )
    verify_checkpoint: bool = opt(
        True,
        "check the checkpoint run.resume takes against its manifest: file sizes always, "
        "their hashes too when true (reads every byte)",
    )
    samples_per_step: int = opt(
        3, "responses per step written to samples.jsonl (the shortest, the longest, others)"
    )
    show_samples: bool = opt(False, "print one sampled response per step on the console")
    verify_sync: bool = opt(
        False,
        "after every weight sync, check that each rollout worker holds exactly the "
        "trainer's weights (sha256 per tensor); a difference stops the run naming the "
        "replica and the tensor. Costs a hash of the weights on both sides per sync",
    )
    progress: bool = opt(True, "show the live progress display")
    uvloop: bool = opt(True, "use uvloop's event loop when installed")
    eval_every: int = opt(
        20, "validate every N steps, and always after the last one; 0 = after the last only"
    )
    eval_before_train: bool = opt(True, "validate before the first step (veRL's val_before_train)")
    eval_k: int = opt(
        4,
        "validation: sampled responses per prompt at rollout.temperature, for mean@k and "
        "pass@k (greedy pass@1 is always measured); 0 = greedy only",
    )
    trackers: tuple[str, ...] = opt(
        ("tensorboard",),
        f"where scalars, the config and sample texts go besides metrics.jsonl: any of "
        f"{', '.join(TRACKERS)} (optional extras: pip install 'rpk[wandb]'); empty = none",
    )
    project: str = opt("rpk", "the wandb project / MLflow experiment")
    name: str | None = opt(None, "the wandb / MLflow run name; unset = the run directory's name")
    dry_run: bool = opt(
        False,
        "print the resolved layout, the GPU memory plan and each vLLM replica's engine "
        "arguments as JSON, and start nothing (dist.gpus / dist.gpu_mem_gb ask it for a GPU "
        "box this machine does not have)",
    )

    def __post_init__(self) -> None:
        _positive(self, "steps")
        _non_negative(
            self, "checkpoint_every", "keep_checkpoints", "samples_per_step", "eval_every", "eval_k"
        )
        for tracker in self.trackers:
            if tracker not in TRACKERS:
                raise bad("trackers", f"{tracker!r} is not one of {', '.join(TRACKERS)}")
        if len(set(self.trackers)) != len(self.trackers):
            raise bad("trackers", f"lists a tracker twice: {list(self.trackers)!r}")
        if not self.project:
            raise bad("project", "must not be empty")


@dataclass(frozen=True, slots=True)
class DistConfig:
    """Processes: one per device. `torchrun` sets them for several nodes; on one machine
    `nproc` asks rpk to start them itself."""

    nproc: int = opt(
        0,
        "processes (ranks) on this machine: rank 0 runs the loop, rollout and a trainer "
        "shard, the others trainer shards; 0 = one per GPU where there are several, else 1",
    )
    dp_replicate: int = opt(
        1, "HSDP: replicas of the sharded trainer (1 = FSDP over every rank)"
    )
    timeout_s: float = opt(
        300.0,
        "a collective that waits longer fails the run (a hung or lost rank); the "
        "launcher stops every rank as soon as one exits",
    )
    engine_nodes: tuple[int, ...] = opt(
        (),
        "nodes that run rollout replicas (the rollout's layouts on each, over its "
        "rollout.devices), e.g. 0,1; empty = every node. Node 0's run in the controller, "
        "the others' in an engine host that the node's local rank 0 starts",
    )
    engine_start_timeout_s: float = opt(
        900.0, "the controller waits this long for every other node's engine host to serve"
    )
    heartbeat_s: float = opt(
        2.0,
        "the controller checks every other node's engine host this often; heartbeat_misses "
        "failed checks in a row stop the run, naming the node",
    )
    heartbeat_misses: int = opt(3, "failed host checks in a row that lose a node")
    tls_cert: str = opt(
        "",
        "engine hosts on other nodes serve TLS with this certificate (PEM; the same path "
        "on every node; it must name the address the controller reaches each host at); "
        "empty = plain HTTP",
    )
    tls_key: str = opt("", "the private key of dist.tls_cert (PEM; set both or neither)")
    tls_ca: str = opt(
        "",
        "the controller checks the hosts' certificates against this CA file (a "
        "self-signed dist.tls_cert itself will do); empty = the system's CAs",
    )
    gpus: int = opt(
        0, "run.dry_run: plan for this many GPUs per node (0 = the GPUs CUDA shows here)"
    )
    gpu_mem_gb: float = opt(
        0.0, "run.dry_run: memory of each GPU, GB (1e9 bytes); 0 = what CUDA reports here"
    )
    nodes: int = opt(1, "run.dry_run: nodes of dist.gpus GPUs each")

    def __post_init__(self) -> None:
        _non_negative(self, "nproc", "gpus", "gpu_mem_gb")
        _whole(self, "nodes")
        _whole(self, "dp_replicate")
        _positive(self, "timeout_s", "engine_start_timeout_s", "heartbeat_s")
        _whole(self, "heartbeat_misses")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                f"dist.tls_cert={self.tls_cert!r} and dist.tls_key={self.tls_key!r}: set both or neither"
            )
        if self.tls_ca and not self.tls_cert:
            raise ConfigError(
                f"dist.tls_ca={self.tls_ca!r} without dist.tls_cert: the hosts would serve plain HTTP"
            )
        if any(n < 0 for n in self.engine_nodes) or len(set(self.engine_nodes)) != len(self.engine_nodes):
            raise ConfigError(
                f"dist.engine_nodes={list(self.engine_nodes)} must be distinct node indices >= 0"
            )


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
