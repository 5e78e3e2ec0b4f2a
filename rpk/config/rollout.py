"""The config's `rollout` section (the round policy, sampling, the rollout fleet and its
TP) and `agent` (the tools or environment of a multi-turn run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpk.cli_config import bad
from rpk.config.fields import non_negative, opt, positive, whole
from rpk.core.names import POLICIES


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
        positive(
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
        non_negative(self, "max_model_len")
        non_negative(self, "temperature")
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
        whole(self, "lookahead_rounds", "max_turns")
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
        positive(self, "tool_timeout_s")
        whole(self, "max_tool_output_chars", "max_parallel_calls")
        for name, value in (("env", self.env), *(("tools", t) for t in self.tools)):
            if value is not None and not _is_tool_spec(value):
                raise bad(name, f"{value!r}: expected module:name or a built-in tool")
        if self.env is not None and self.tools:
            raise bad("env", f"{self.env!r} and agent.tools {list(self.tools)}: an "
                      "environment answers the turns itself; set one of them")


def _is_tool_spec(value: str) -> bool:
    module, sep, name = value.partition(":")
    return (bool(sep) and bool(module) and bool(name)) or (not sep and value.isidentifier())
