"""What the run is given: the config's `model` (a path, a Hub id, or rpk's tiny model and
the spec it is built from), `data` (prompt files, or a built-in task), `agent` (the tools
or environment of a multi-turn run) and `reward` (the functions, the shaping on top, a
remote service, and `reward.sandbox` for code-execution terms)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rpk.core.errors import bad
from rpk.core.fields import is_finite_number, non_negative, one_of, opt, positive, whole
from rpk.core.names import JUDGED_TASKS, TASKS
from rpk.tasks.specs import JudgeTinySpec, TinySpec, ToolAddTinySpec

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
        "arith_judged (arith with a share data.judged_frac of its rows scored by a judge model: "
        "rpk's tiny judge, read with the reason verdict, unless reward.judge.model or url is set) or "
        "tool_add (multi-turn: long additions through a 4-digit adder tool; it sets its own "
        "rollout.max_tokens, prompts_per_step, run.steps and eval_every)",
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
    judged_frac: float = opt(
        0.5,
        "a task with judged rows (arith_judged): the share of training rows scored by the judge, "
        "spread evenly (0.5: every other row; 1: all, so no rule reward reaches training); "
        "validation stays rule-checked",
    )

    def __post_init__(self) -> None:
        positive(self, "builtin_size", "max_prompt_tokens")
        non_negative(self, "val_size")
        if self.task not in TASKS:
            raise bad("task", f"{self.task!r} is not one of {', '.join(TASKS)}")
        frac = self.judged_frac
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac <= 1:
            raise bad("judged_frac", f"must be a number in [0, 1], got {frac!r}")
        if frac != 0.5 and self.task not in JUDGED_TASKS:
            raise bad("judged_frac", f"applies to a task with judged rows ({', '.join(JUDGED_TASKS)}), "
                                     f"not data.task={self.task!r}")


@dataclass(frozen=True, slots=True)
class ToolLatencyConfig:
    """The built-in multi-turn task's tool latency (`rpk.sched.toolwait.LatencyModel`): log-normal by
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
    verdict: Literal["logprob", "reason", "score", "classify"] = opt(
        "logprob",
        "logprob: P(yes) from the yes/no words' log-probs in one decode step (or 1/0 "
        "against threshold); reason: the judge thinks (up to reason_tokens) until it writes "
        "verdict_marker, then P(yes) is read right after the marker; score: a graded judge "
        "writing 'Score: x', reward x / score_max; classify: a discriminative reward model "
        "(vLLM's pooling runner) scoring [user: question, assistant: response]",
    )
    template: str = opt(
        "",
        "the judge's user message with {question}, {response}, {reference}, {yes}, {no}; "
        "empty = the built-in reference-based yes/no template",
    )
    system: str | None = opt(
        None, "the judge's system message ({yes}, {no}); unset = the built-in rules, empty = none"
    )
    yes: str = opt("YES", "logprob, reason: the word meaning correct (one token of the judge's)")
    no: str = opt("NO", "logprob, reason: the word meaning wrong (one token of the judge's)")
    threshold: float | None = opt(
        None,
        "unset: the reward is P(yes), the graded score or the reward model's score; set: "
        "logprob/reason give 1 at or above it, else 0; score and classify keep their value and "
        "only count as correct above it",
    )
    min_mass: float = opt(
        0.5,
        "logprob, reason: a verdict whose yes and no words have less probability than this "
        "together is a failure (judge_low_mass), not a reward: the judge answered off-format",
    )
    score_max: float = opt(10.0, "score: the top of the judge's scale")
    max_tokens: int = opt(16, "score: tokens the judge may write (cut there, the verdict fails)")
    reason_tokens: int = opt(512, "reason: tokens the judge may think before its verdict")
    verdict_marker: str = opt(
        "Verdict:",
        "reason: the judge stops thinking here and P(yes) is read at the next token (rpk "
        "appends it when the judge did not write it within reason_tokens)",
    )
    votes: int = opt(
        1, "reason, score: the judge answers this many times (sampled), the reward is the mean"
    )
    temperature: float = opt(1.0, "votes > 1: the judge's sampling temperature (one vote is greedy)")
    strip_think: bool = opt(
        False, "the judge sees the response after the policy's <think>...</think> block"
    )
    chat_template_kwargs: tuple[str, ...] = opt(
        (), "key=value arguments of the judge's chat template (value as JSON), e.g. enable_thinking=false"
    )
    max_response_chars: int = opt(8000, "the judge sees at most this tail of a response")
    response_after: str = opt(
        "",
        "the judge sees that tail from the last occurrence of this text on ('Answer:': the final "
        "answer line and what follows it), all of it when the text is not there; empty = all of it",
    )
    max_concurrency: int = opt(32, "verdicts in flight (the judge engine's max_num_seqs, x votes)")
    timeout_s: float = opt(
        60.0, "a verdict that takes longer, once the judge is awake, scores 0 and is counted"
    )
    max_model_len: int | None = opt(None, "the judge engine's context; unset = the model's")
    compare_rules: bool = opt(
        False,
        "judged rows are also checked by their data source's rule reward (which must exist); "
        "the judge's verdict counts, their confusion (false-positive and false-negative "
        "rates) goes to metrics.jsonl",
    )
    mode: Literal["alone", "cascade"] = opt(
        "alone",
        "how a judged row's reward combines the judge and the row's rule reward: alone (the "
        "judge's verdict); cascade (the rule first, the judge only where the rule says no or "
        "fails: the rule's yes stands). A judge=w term of reward.functions makes it weighted "
        "(w x the judge's reward + the other terms)",
    )
    group: Literal["off", "listwise", "pairwise"] = opt(
        "off",
        "judge a prompt's responses together once its group has finished: listwise (all in "
        "one shuffled list, one question each) or pairwise (every pair in both orders, the "
        "reward a response's mean preference); off: each as it finishes",
    )
    rubric_template: str = opt(
        "",
        "a rubric criterion's request (rows whose extra_info.rubric lists criteria: one request "
        "each), with {question}, {reference}, {response}, {criterion} last, {yes}, {no}; empty = "
        "the built-in one",
    )
    canaries: int = opt(
        4,
        "known-wrong answers (injections, master keys, special tokens, near misses) asked of "
        "the live judge each step, outside training; their false-positive rate goes to "
        "metrics.jsonl and the summary. 0 = none",
    )
    canary_margin: float = opt(
        0.1,
        "a warning when the canaries' false-positive rate over the last third of the run's "
        "steps rises this far above the first third's",
    )
    restarts: int = opt(
        3, "a judge engine that dies is started again, at most this many times over the run; "
        "0 = a death stops the run",
    )
    restart_backoff_s: float = opt(2.0, "first wait before a restart; doubles per failed start")
    cache: bool = opt(True, "keep verdicts by content: a repeated response is not judged again")
    cache_size: int = opt(4096, "verdicts the cache keeps (least recently used dropped first)")
    url: str | None = opt(
        None,
        "an OpenAI-compatible server as the judge (http://host:8000/v1); model = its served "
        "model name (unset: the only one it lists); logprob and score verdicts",
    )
    api_key_env: str | None = opt(None, "url: environment variable holding the API key")
    rpm: float | None = opt(None, "url: requests per minute at most; unset = no limit")
    tpm: float | None = opt(None, "url: tokens per minute at most (prompt + completion); unset = no limit")
    retries: int = opt(3, "url: retries of a request on 429, 5xx or a lost connection")
    backoff_s: float = opt(1.0, "url: first retry delay; doubles per retry, jittered")
    top_logprobs: int = opt(20, "url, logprob: the top list the yes and no words are read from (1-20)")

    def __post_init__(self) -> None:
        positive(self, "score_max", "max_tokens", "max_response_chars", "max_concurrency",
                 "timeout_s", "reason_tokens", "votes", "temperature", "cache_size")
        non_negative(self, "canary_margin", "restarts", "restart_backoff_s", "retries", "backoff_s")
        if isinstance(self.canaries, bool) or not isinstance(self.canaries, int) or self.canaries < 0:
            raise bad("canaries", f"must be an integer >= 0, got {self.canaries!r}")
        for name in ("rpm", "tpm"):
            if getattr(self, name) is not None:
                positive(self, name)
        if not 1 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", f"must be in 1..20, got {self.top_logprobs!r}")
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise bad("url", f"must start with http:// or https://, got {self.url!r}")
            if self.verdict not in ("logprob", "score"):
                raise bad("url", f"serves logprob and score verdicts, not {self.verdict!r} (classify needs "
                          "a local reward model, reason rpk's own engines)")
        one_of(self, "verdict", "mode", "group")
        if not 0 <= self.min_mass <= 1:
            raise bad("min_mass", f"must be in [0, 1], got {self.min_mass!r}")
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
        "several reward terms summed: each module:function=weight, builtin=weight for "
        "the data source's built-in checker, or judge=weight for the judge (reward.judge) on "
        "judged rows (=weight may be left out: 1); the first term's verdict is the sample's "
        "accuracy. Excludes reward.function",
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
            if name.strip() not in ("builtin", "judge") and ":" not in name:
                raise bad(
                    "functions",
                    f"{term!r} must look like module:function=weight, builtin=weight or judge=weight",
                )
            if sep and not is_finite_number(weight):
                raise bad("functions", f"{term!r}: weight {weight!r} is not a finite number")
        judge_terms = [t for t in self.functions if t.partition("=")[0].strip() == "judge"]
        if len(judge_terms) > 1:
            raise bad("functions", f"{judge_terms}: one judge term at most")
        if judge_terms and self.judge.mode != "alone":
            raise bad("functions", f"{judge_terms[0]!r} (weighted) and reward.judge.mode "
                      f"{self.judge.mode!r}: pick one way to combine the judge and the rule")
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
