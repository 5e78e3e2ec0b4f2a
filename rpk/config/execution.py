"""How the run goes: the config's `rollout` (the round policy, sampling, the rollout fleet
and its TP), `train` (the optimizer, the loss, the trainer's device and memory, streaming
beside the rollout), `run` (steps, seed, checkpoints, validation, records) and `dist`
(the processes: ranks, nodes, the engine nodes and their TLS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpk.core.drafts import SPECULATIVE, Speculative
from rpk.core.errors import ConfigError, bad
from rpk.core.fields import non_negative, one_of, opt, positive, whole
from rpk.core.modes import Offload, StreamMode
from rpk.core.names import POLICIES, TRACKERS


def _either(choices: type[Offload] | type[StreamMode]) -> str:
    """An enum's values as a refusal names them: "a, b or c"."""
    values = [str(c.value) for c in choices]
    return f"{', '.join(values[:-1])} or {values[-1]}"


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
    speculative: str = opt(
        "off",
        "speculative decoding in the rollout replicas, every drafted token verified by the "
        "policy (on-policy): " + "; ".join(f"{c.value} ({SPECULATIVE[c].help})" for c in Speculative)
        + " (docs/speculative.md)",
    )
    spec_max_k: int = opt(
        8, "speculative: the longest draft, vLLM's num_speculative_tokens (fixed when the engine starts)"
    )
    spec_adaptive: bool = opt(
        True,
        "speculative: the draft length by batch size from the measured step cost and "
        "acceptance, per round kind and replica, re-planned every round (false: spec_max_k "
        "at every batch size; ngram keeps its start plan)",
    )
    spec_min_gain: float = opt(
        1.05, "speculative, adaptive: a draft length must promise this speed-up over plain decoding"
    )
    spec_twin: bool | None = opt(
        None,
        "speculative: a plain replica beside each speculating one; rounds run on it (vLLM pays "
        "for speculation every step once configured, drafts or not) and hand their tail, once "
        "small enough to draft for, to the twin. Unset: on with CPU replicas, off on CUDA "
        "(where a twin would need its own weights and KV cache)",
    )
    weight_bucket_mb: int = opt(256, "weight sync sends the weights in buckets of this size, MiB")
    weight_transfer: Literal["shm", "gloo", "cpu_ipc", "auto", "ipc", "nccl", "m2n"] = opt(
        "auto",
        "weight path into the replicas: shm (safetensors bucket files in /dev/shm, loaded "
        "by every replica), gloo (vLLM's weight-transfer protocol over a gloo group: the "
        "trainer broadcasts to every worker), cpu_ipc (the same protocol with handles to "
        "shared-memory staging files: CPU replicas on the trainer's machine), ipc / nccl "
        "(vLLM's CUDA transfer engines), m2n (a sharded trainer, dist.nproc > 1: every "
        "rank sends its own shards, none gathers; vLLM's nccl_m2n on GPU, over gloo on "
        "CPU), auto (cpu_ipc on CPU, the fastest measured; on GPU ipc for a replica on the "
        "trainer's GPU and nccl for the others, m2n for a sharded trainer whose rollout "
        "GPUs are its own: dist.trainer_gpus)",
    )

    def __post_init__(self) -> None:
        positive(
            self, "prompts_per_step", "responses_per_prompt", "max_tokens",
            "max_num_seqs", "kv_cache_mb", "weight_bucket_mb",
        )
        if self.colocate not in (None, True, False):
            raise bad("colocate", f"must be true, false or unset, got {self.colocate!r}")
        one_of(self, "tp", "tp_switch", "weight_transfer")
        non_negative(self, "max_model_len")
        non_negative(self, "temperature")
        if self.speculative not in tuple(Speculative):
            raise bad("speculative", f"{self.speculative!r} is not one of {', '.join(Speculative)}")
        whole(self, "spec_max_k")
        if self.spec_twin not in (None, True, False):
            raise bad("spec_twin", f"must be true, false or unset, got {self.spec_twin!r}")
        if not self.spec_min_gain >= 1:
            raise bad("spec_min_gain", f"must be >= 1, got {self.spec_min_gain!r}")
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
class TrainConfig:
    lr: float = opt(
        5e-5,
        "AdamW learning rate (2e-4 unlearned the tiny model's solved additions: "
        "docs/benchmarks.md, 'Learning rate')",
    )
    lora_lr: float = opt(
        5e-4,
        "AdamW learning rate of the LoRA adapters (model.lora_rank > 0), in place of lr: "
        "10x the full fine-tuning one, as LoRA RL runs use (docs/trainer.md, 'LoRA')",
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
        positive(self, "lr", "lora_lr", "micro_batch_tokens", "stream_chunk_tokens")
        non_negative(
            self, "weight_decay", "torch_threads", "kl_coef", "entropy_coef", "grad_clip"
        )
        if not 0 <= self.stream_start_frac <= 1:
            raise bad("stream_start_frac", f"must be in [0, 1], got {self.stream_start_frac!r}")
        if self.stream_mode not in set(StreamMode):
            raise bad("stream_mode", f"must be {_either(StreamMode)}, got {self.stream_mode!r}")
        non_negative(self, "borrow_check_s")
        if not 0 < self.borrow_min_frac <= self.borrow_max_frac <= 1:
            raise bad(
                "borrow_min_frac",
                f"and borrow_max_frac need 0 < min <= max <= 1, got {self.borrow_min_frac!r} "
                f"and {self.borrow_max_frac!r}",
            )
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) is not None:
                non_negative(self, name)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.offload != "auto" and self.offload not in {o.value for o in Offload}:
            raise bad("offload", f"must be auto, {_either(Offload)}, got {self.offload!r}")
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
        positive(self, "steps")
        non_negative(
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
    trainer_gpus: int = opt(
        0,
        "GPU only, disaggregated: the trainer's ranks take the first this many GPUs of each "
        "node, the rollout the others (rollout.devices, if set, must avoid them); weights "
        "then go over nccl_m2n under auto. 0 = rollout and training share every GPU",
    )
    gpus: int = opt(
        0, "run.dry_run: plan for this many GPUs per node (0 = the GPUs CUDA shows here)"
    )
    gpu_mem_gb: float = opt(
        0.0, "run.dry_run: memory of each GPU, GB (1e9 bytes); 0 = what CUDA reports here"
    )
    host_mem_gb: float = opt(
        0.0,
        "run.dry_run: host RAM of each node, GB (1e9 bytes), checked against the trainer "
        "state offloaded there and the rest; 0 = unknown, not checked (a run reads this machine's)",
    )
    nodes: int = opt(1, "run.dry_run: nodes of dist.gpus GPUs each")

    def __post_init__(self) -> None:
        non_negative(self, "nproc", "gpus", "gpu_mem_gb", "host_mem_gb", "trainer_gpus")
        whole(self, "nodes")
        whole(self, "dp_replicate")
        positive(self, "timeout_s", "engine_start_timeout_s", "heartbeat_s")
        whole(self, "heartbeat_misses")
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
