"""The config's `reward` section: where reward functions run, the shaping on top, a
remote reward service, and `reward.sandbox` (how code-execution terms run programs)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rpk.cli_config import bad
from rpk.config.fields import is_finite_number, non_negative, opt, positive, whole


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
