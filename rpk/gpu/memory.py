"""The GPU memory plan: what each GPU holds in each phase of a step, as plain arithmetic.

Rollout and training share every GPU (veRL's hybrid engine, the paper's setting) and hand
the memory back and forth each step. This module says, from the model's `config.json`
and the layout alone (no device is touched), the bytes of every resident on a GPU in
each phase, what moves out of the GPU for it (vLLM's sleep level, the trainer state
offloaded to host), the KV cache that fits, and the `gpu_memory_utilization` that gives
vLLM exactly that. A config that does not fit is refused before anything starts, in one
line naming the phase, the GPU and what to change.

The phases of one step, per GPU (docs/gpu-box.md draws the timeline):

- `rollout`: vLLM awake (its weight shard, KV cache, activation and CUDA-graph reserve);
  the trainer's state on host where the plan offloads it.
- `stream`: training beside the tail of the round (the paper's streamed training), only
  where it fits: beside vLLM on every GPU, or on the GPUs of lent replicas (asleep).
- `train`: vLLM asleep; the trainer's parameter shards, gradients, AdamW states, FSDP's
  gathered layers and one micro-batch's activations.
- `sync`: vLLM's weights woken (`wake_up(tags=["weights"])`), not its KV cache; the
  trainer's parameters and the buckets in flight.
- `regroup`: the same for the largest layout an elastic run switches to.

What the trainer holds (rpk.train): float32 parameters sharded by FSDP (they are the
master copy: FSDP computes in bf16 from them), float32 gradients, AdamW's two float32
moments: 16 bytes a parameter over the FSDP degree. FSDP gathers a layer at a time in
bf16 (the next one prefetched) and the root (embeddings, LM head, final norm) for the
whole pass. Deferred gradient reduction (rpk.train.fsdp) keeps the *unsharded* gradient
on every rank in float32 until the step ends: 4 bytes a parameter, not divided. A KL
reference (`kl_reference`) is sharded the same way, float32, in every phase once loaded.

Host RAM, per node (`MemoryPlan.host`), at the worst moment: `rollout` (the offloaded
trainer state), `checkpoint` (the trainer's state back on the GPUs for the save while
vLLM rests; node 0 writes a bucket from host) or `load` (node 0 alone: rank 0 reads the
whole model in float32 on host and sends each rank its shards, rpk.train.load; a KL
reference is read so mid-run). docs/gpu-box.md has the residents. vLLM rests at level 2,
for training and for a save alike: its weights are discarded, never copied to host.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from rpk.gpu.shape import ModelShape, PlanRefused, Target

GiB = 2**30

# CUDA context, cuBLAS workspaces and NCCL buffers of one process on a GPU (the trainer
# rank and the vLLM worker each have one; a sleeping vLLM keeps its own).
PROCESS_BYTES = 1 * GiB
# Left free on every GPU for the caching allocator's fragmentation.
HEADROOM_FRAC = 0.05
# vLLM's CUDA graphs (captured for decode batch sizes up to max_num_seqs).
CUDA_GRAPH_BYTES = 1 * GiB
# vLLM's profiling pass runs a prefill of this many tokens (its default
# max_num_batched_tokens with chunked prefill on GPU).
PREFILL_TOKENS = 8192
# A KV cache is useful when it holds this many full-length sequences per replica: fewer
# and the longest responses of a round preempt one another.
USEFUL_SEQS = 4
# The fused log-prob head (rpk.kernels.chunked): one [tokens x vocab] block in float32,
# its softmax and its gradient.
HEAD_CHUNK_TOKENS = 1024
HEAD_CHUNK_VOCAB = 4096
# Streamed training beside vLLM is worth a smaller KV cache, down to this share of the
# one vLLM gets with the trainer on host: a halved cache preempts the long tail.
BESIDE_MIN_KV_SHARE = 0.5
# Beside vLLM the trainer's caching allocator keeps what its peak reserved, more than the
# peak allocated once blocks fragment over steps; vLLM's KV must fit beside the reserve.
BESIDE_ALLOCATOR_FRAC = 0.05
# Host <-> device copy rate used to price an offload (PCIe 4/5 x16, pinned).
PCIE_BYTES_PER_S = 20e9
# Trainer state per GPU below which the plan does not offload it (the copy is not worth it).
OFFLOAD_MIN_FRAC = 0.05
# Host RAM a process holds whatever the moment. Estimates (no GPU box to measure on):
# importing torch, transformers, rpk's trainer and vLLM takes 0.56 GiB of RSS on this
# project's CPU machine (2026-12-04); CUDA adds its libraries and the context's host side
# (1-2 GiB), a trainer rank the driver's data, NCCL's buffers and pinned batches, a vLLM
# worker its scheduler inputs, sampler tensors and compile caches. veRL users saw 11 GB
# per rollout process with an offloaded model among it (verl-project/verl#224): 4 GiB
# without one is meant to be on the safe side.
TRAINER_HOST_BYTES = 4 * GiB
VLLM_WORKER_HOST_BYTES = 4 * GiB
# A replica's engine-core process (scheduler, detokenizer, input queues); every layout's
# replicas run, the asleep ones too.
VLLM_ENGINE_HOST_BYTES = 2 * GiB
# Left free on each node: the kernel, the page cache the model files are read through,
# the system's daemons.
HOST_HEADROOM_FRAC = 0.10
# Rank 0 writes a checkpoint's HF weights from host memory one bucket at a time (a
# larger tensor alone): rpk.train.state.HF_SHARD_BYTES.
CHECKPOINT_BUCKET_BYTES = 2 * GiB


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    STREAM = "stream"
    TRAIN = "train"
    SYNC = "sync"
    REGROUP = "regroup"


class Offload(enum.Enum):
    """Trainer state moved to host memory while vLLM generates."""

    NONE = "none"
    OPTIMIZER = "optimizer"  # AdamW's moments
    ALL = "all"  # moments and parameter shards

    @property
    def moves_params(self) -> bool:
        return self is Offload.ALL

    @property
    def moves_optimizer(self) -> bool:
        return self is not Offload.NONE


class Stream(enum.Enum):
    """Where streamed training (training while the tail generates) may run."""

    BESIDE = "beside"  # on every GPU, beside the awake vLLM
    LENT = "lent"  # only on the GPUs of replicas lent to the trainer (asleep)
    AFTER = "after"  # nowhere: training waits for the round's end


@dataclass(frozen=True, slots=True)
class Knobs:
    """The run's choices that decide memory (from `rpk.config`, resolved by the caller)."""

    max_model_len: int
    max_num_seqs: int = 512  # per device (a TP-t replica runs t times as many)
    micro_batch_tokens: int = 8192
    weight_bucket_bytes: int = 256 * 2**20
    tp_sizes: tuple[int, ...] = ()  # layouts; empty = the plan picks one TP
    tp: int = 0  # the awake layout's; 0 = the plan's pick
    dp_replicate: int = 1  # HSDP replicate degree
    offload: Offload | None = None  # None = the plan decides
    activation_checkpointing: bool = True
    defer_reduction: bool | None = None  # None = defer where it fits
    stream_mode: str = "thread"  # what the config asks: none, thread, borrow
    engine_bytes: int = 2  # bf16 engine weights
    kv_bytes: int = 2
    master_bytes: int = 4  # float32 parameters (the master copy)
    grad_bytes: int = 4
    optim_bytes: int = 8  # AdamW: two float32 moments
    compute_bytes: int = 2  # bf16 compute (FSDP's gathered layers, activations)
    kl_reference: bool = False  # the trainer loads a KL reference model (at its first step)


@dataclass(frozen=True, slots=True)
class Resident:
    owner: str  # "vllm" or "trainer"
    name: str
    bytes: int


@dataclass(frozen=True, slots=True)
class PhasePlan:
    phase: Phase
    gpus: tuple[int, ...]  # the GPUs this row is about (global ids)
    residents: tuple[Resident, ...]
    moved_out: tuple[str, ...]  # what left the GPU for this phase
    capacity: int

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.residents)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity * (1 - HEADROOM_FRAC)

    def bytes_of(self, owner: str, name: str) -> int:
        return sum(r.bytes for r in self.residents if (r.owner, r.name) == (owner, name))


@dataclass(frozen=True, slots=True)
class HostPlan:
    """One node's host RAM at its worst moment (`rollout`, `checkpoint` or `load`)."""

    node: int
    moment: str
    residents: tuple[Resident, ...]
    capacity: int  # 0 = unknown: not checked

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.residents)

    @property
    def fits(self) -> bool:
        return not self.capacity or self.total <= self.capacity * (1 - HOST_HEADROOM_FRAC)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    shape: ModelShape
    target: Target
    knobs: Knobs
    tp: int  # the awake layout's TP
    tp_sizes: tuple[int, ...]
    fsdp: int  # FSDP shard degree
    offload: Offload
    defer_reduction: bool
    train_sleep_level: int  # vLLM's sleep while the trainer runs
    stream: Stream
    stream_gpus: tuple[int, ...]
    kv_cache_bytes: int  # per GPU, the awake layout
    gpu_memory_utilization: float
    phases: tuple[PhasePlan, ...] = field(default=())
    host: tuple[HostPlan, ...] = ()  # a row per node; empty: not planned (split layout)

    @property
    def kv_tokens_per_replica(self) -> int:
        per_gpu = self.shape.kv_bytes_per_token(self.knobs.kv_bytes) // self.tp
        return self.kv_cache_bytes // per_gpu

    @property
    def offload_s(self) -> float:
        """One way of the trainer state's trip to host, per GPU."""
        return self.offloaded_bytes / PCIE_BYTES_PER_S

    @property
    def offloaded_bytes(self) -> int:
        return _trainer_state(self.shape, self.knobs, self.fsdp, self.offload)[1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_params": self.shape.params,
            "gpus": self.target.gpus,
            "gpu_gb": round(self.target.gpu_bytes / 1e9, 1),
            "rollout_tp": self.tp,
            "tp_sizes": list(self.tp_sizes),
            "replicas": len(self.phases[0].gpus) // self.tp if self.phases else self.target.gpus // self.tp,
            "fsdp": self.fsdp,
            "dp_replicate": self.knobs.dp_replicate,
            "offload_during_rollout": self.offload.value,
            "offload_gb_per_gpu": round(self.offloaded_bytes / 1e9, 2),
            "offload_s_each_way": round(self.offload_s, 2),
            "defer_reduction": self.defer_reduction,
            "activation_checkpointing": self.knobs.activation_checkpointing,
            "train_sleep_level": self.train_sleep_level,
            "stream": self.stream.value,
            "stream_gpus": list(self.stream_gpus),
            "kv_cache_gb_per_gpu": round(self.kv_cache_bytes / 1e9, 2),
            "kv_tokens_per_replica": self.kv_tokens_per_replica,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "phases": [
                {
                    "phase": p.phase.value,
                    "gpus": list(p.gpus),
                    "total_gb": round(p.total / 1e9, 2),
                    "capacity_gb": round(p.capacity / 1e9, 2),
                    "fits": p.fits,
                    "moved_out": list(p.moved_out),
                    "residents_gb": {f"{r.owner}.{r.name}": round(r.bytes / 1e9, 2) for r in p.residents},
                }
                for p in self.phases
            ],
            "host": [  # GB per node; available and fits None: the RAM is unknown
                {"node": h.node, "moment": h.moment, "needed_gb": round(h.total / 1e9, 2),
                 "available_gb": round(h.capacity / 1e9, 2) if h.capacity else None,
                 "fits": h.fits if h.capacity else None,
                 "residents_gb": {f"{r.owner}.{r.name}": round(r.bytes / 1e9, 2) for r in h.residents}}
                for h in self.host
            ],
        }

    def table(self) -> str:
        """The plan as tables: a row per phase, a column per resident (GB per GPU); then,
        where the nodes' RAM is known, a row per node (GB per node)."""
        lines = [(
            f"memory plan (GB per GPU): {self.shape.params / 1e9:.2f}B params, {self.target.gpus} GPUs, "
            f"rollout TP {self.tp}, FSDP {self.fsdp}, offload {self.offload.value}, "
            f"KV {self.kv_tokens_per_replica} tokens/replica, gpu_memory_utilization "
            f"{self.gpu_memory_utilization}, stream {self.stream.value}"
        )]
        lines += _grid(["phase", "gpus"], [
            ([p.phase.value, _ranges(p.gpus)], p.residents, f"{p.capacity / 1e9:.0f}") for p in self.phases
        ])
        if self.host and self.target.host_bytes:
            lines.append(f"host RAM (GB per node, {HOST_HEADROOM_FRAC:.0%} kept free):")
            lines += _grid(["node", "moment"], [
                ([str(h.node), h.moment], h.residents, f"{h.capacity / 1e9:.0f}")
                for h in self.host
            ])
        return "\n".join(lines)


def _grid(keys: list[str], rows: Sequence[tuple[list[str], Sequence[Resident], str]]) -> list[str]:
    """Rows of `keys`, a column per resident (GB), the total and the capacity."""
    names = list(dict.fromkeys(f"{r.owner}.{r.name}" for _, residents, _ in rows for r in residents))
    out = [[*keys, *names, "total", "of"]]
    for first, residents, capacity in rows:
        cells = {f"{r.owner}.{r.name}": r.bytes for r in residents}
        out.append([
            *first, *(f"{cells[n] / 1e9:.1f}" if n in cells else "-" for n in names),
            f"{sum(r.bytes for r in residents) / 1e9:.1f}", capacity,
        ])
    widths = [max(len(r[i]) for r in out) for i in range(len(out[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in out]


def _ranges(gpus: Sequence[int]) -> str:
    if not gpus:
        return "-"
    if list(gpus) == list(range(gpus[0], gpus[0] + len(gpus))):
        return f"{gpus[0]}-{gpus[-1]}" if len(gpus) > 1 else str(gpus[0])
    return ",".join(map(str, gpus))


def _trainer_state(shape: ModelShape, k: Knobs, fsdp: int, offload: Offload) -> tuple[int, int]:
    """(bytes of the trainer's parameters + AdamW moments on one GPU, of which offloaded)."""
    params, optim = (r.bytes for r in _state_residents(shape, k, fsdp))
    moved = (params if offload.moves_params else 0) + (optim if offload.moves_optimizer else 0)
    return params + optim, moved


def _state_residents(shape: ModelShape, k: Knobs, fsdp: int) -> list[Resident]:
    """The trainer state that outlives a step: parameter shards and AdamW's moments."""
    return [
        Resident("trainer", "params", math.ceil(shape.params * k.master_bytes / fsdp)),
        Resident("trainer", "adamw", math.ceil(shape.params * k.optim_bytes / fsdp)),
    ]


def _reference(shape: ModelShape, k: Knobs, fsdp: int) -> tuple[Resident, ...]:
    """The KL reference's float32 shards: on the GPU in every phase (nothing offloads it)."""
    if not k.kl_reference:
        return ()
    return (Resident("trainer", "kl_reference", math.ceil(shape.params * k.master_bytes / fsdp)),)


def _beyond_rollout(shape: ModelShape, k: Knobs, fsdp: int, training: Sequence[Resident]) -> int:
    """What training adds on a GPU to the state (nothing offloaded) and reference it keeps."""
    kept = _trainer_state(shape, k, fsdp, Offload.NONE)[0] + sum(r.bytes for r in _reference(shape, k, fsdp))
    return sum(r.bytes for r in training) - kept


def _trainer_residents(shape: ModelShape, k: Knobs, fsdp: int, defer: bool) -> list[Resident]:
    """The trainer while it trains one micro-batch."""
    n = shape.params
    tokens = max(k.micro_batch_tokens, k.max_model_len)  # a longer sample is a batch alone
    per_layer = shape.activation_bytes_per_token(k.compute_bytes)
    if k.activation_checkpointing:
        # Each layer's input kept; one layer recomputed in full during its backward.
        acts = tokens * (shape.num_layers * shape.hidden_size * k.compute_bytes + per_layer)
    else:
        acts = tokens * shape.num_layers * per_layer
    # The hidden states in bf16, and the backward's float32 `scaled` and `d_hidden`
    # (rpk.kernels.chunked.chunked_backward), beside one chunk's logits, softmax, gradient.
    head = (tokens * shape.hidden_size * (k.compute_bytes + 2 * 4)
            + 3 * HEAD_CHUNK_TOKENS * HEAD_CHUNK_VOCAB * 4)
    grads = n * k.grad_bytes if defer else math.ceil(n * k.grad_bytes / fsdp)
    # Gathered in bf16: the root for the whole pass, a layer and the prefetched next one;
    # the largest gathered gradient: float32 before its reduce-scatter, or deferred, bf16
    # before FSDP2 adds it into the float32 one (traced: tests/test_device_ledger.py).
    gathered = (shape.root_params + 2 * shape.layer_params) * k.compute_bytes
    gathered += max(shape.root_params, shape.layer_params) * (k.compute_bytes if defer else k.grad_bytes)
    # The reference's forward gathers its own root and layers (resharded after it).
    gathered += (shape.root_params + 2 * shape.layer_params) * k.compute_bytes if k.kl_reference else 0
    # The optimizer step is the row's other moment: the micro-batch's tensors are gone,
    # the gradient is sharded, and foreach AdamW holds one float32 temporary per shard
    # (its sqrt of the second moment). Seen on an H200 at 1.5B, FSDP 1: the step's peak
    # was the whole step's (28.65 GiB against 26.2 planned for the micro-batch alone).
    micro = grads + gathered + acts + head
    step = math.ceil(n * (k.grad_bytes + k.master_bytes) / fsdp)
    return [
        *_state_residents(shape, k, fsdp),
        *_reference(shape, k, fsdp),
        Resident("trainer", "grads_unsharded" if defer else "grads", grads),
        Resident("trainer", "fsdp_gathered", gathered),
        Resident("trainer", "activations", acts),
        Resident("trainer", "logprob_head", head),
        *([Resident("trainer", "adamw_step", step - micro)] if step > micro else []),
    ]


def _vllm_fixed(shape: ModelShape, k: Knobs, tp: int) -> list[Resident]:
    """An awake replica's shard on one GPU, KV cache aside."""
    seqs = k.max_num_seqs * tp
    prefill = PREFILL_TOKENS * (4 * shape.hidden_size + 2 * shape.intermediate_size // tp) * k.compute_bytes
    sampler = seqs * shape.vocab_size * 4 * 2  # float32 logits and probabilities
    return [
        Resident("vllm", "weights", math.ceil(shape.params * k.engine_bytes / tp)),
        Resident("vllm", "reserve", CUDA_GRAPH_BYTES + prefill + sampler),
    ]


def _context(k: Knobs) -> list[Resident]:
    """The processes' contexts on a GPU; each elastic layout asleep at level 2 keeps its
    own context and CUDA-graph pool (vLLM keeps the pool outside sleep mode's cumem)."""
    asleep = max(len(set(k.tp_sizes)) - 1, 0)
    return [Resident("vllm", "context", PROCESS_BYTES), Resident("trainer", "context", PROCESS_BYTES),
            *([Resident("vllm", "asleep_layouts", asleep * (PROCESS_BYTES + CUDA_GRAPH_BYTES))] if asleep else [])]


def _usable(target: Target) -> int:
    return int(target.gpu_bytes * (1 - HEADROOM_FRAC))


def _kv_room(shape: ModelShape, k: Knobs, target: Target, tp: int, fsdp: int, offload: Offload) -> int:
    """KV bytes that fit on one GPU during rollout."""
    kept = _trainer_state(shape, k, fsdp, offload)
    fixed = (*_context(k), *_vllm_fixed(shape, k, tp), *_reference(shape, k, fsdp))
    used = sum(r.bytes for r in fixed) + kept[0] - kept[1]
    return _usable(target) - used


def _useful_kv(shape: ModelShape, k: Knobs, tp: int) -> int:
    return USEFUL_SEQS * k.max_model_len * shape.kv_bytes_per_token(k.kv_bytes) // tp


def _tp_candidates(target: Target, shape: ModelShape) -> list[int]:
    """TP sizes inside one node that split the attention heads (vLLM replicates KV heads
    when TP exceeds their count)."""
    return [
        t for t in range(1, target.gpus_per_node + 1)
        if target.gpus_per_node % t == 0 and shape.num_heads % t == 0
        and (shape.num_kv_heads % t == 0 or t % shape.num_kv_heads == 0)
    ]


def plan_memory(shape: ModelShape, target: Target, knobs: Knobs) -> MemoryPlan:
    """The plan, or `PlanRefused` naming the phase and the GPU (or the node, for host
    RAM) and what to change."""
    plan, over = _plan(shape, target, knobs)
    if isinstance(over, PhasePlan):
        raise PlanRefused(_refusal(plan, over))
    if over is not None:
        raise PlanRefused(_host_refusal(plan, over))
    return plan


def _fits(shape: ModelShape, target: Target, knobs: Knobs) -> bool:
    try:
        return _plan(shape, target, knobs)[1] is None
    except PlanRefused:
        return False


# The offloads that keep more on the GPU and less on host, lightest last.
_LIGHTER = {Offload.ALL: (Offload.OPTIMIZER, Offload.NONE), Offload.OPTIMIZER: (Offload.NONE,), Offload.NONE: ()}


def _plan(shape: ModelShape, target: Target, knobs: Knobs) -> tuple[MemoryPlan, PhasePlan | HostPlan | None]:
    """The plan and its first phase, or else node, that does not fit (None: all fit).
    Where the plan chose the offload and a node's RAM cannot hold it, a lighter one that
    still fits the GPUs is taken."""
    plan, over = _plan_gpus(shape, target, knobs)
    short = next((h for h in plan.host if not h.fits), None)
    if over is not None or short is None:
        return plan, over
    if knobs.offload is None:
        for lighter in _LIGHTER[plan.offload]:
            other = _fitting_gpus(shape, target, replace(knobs, offload=lighter))
            if other is not None and all(h.fits for h in other.host):
                return replace(other, knobs=knobs), None
    return plan, short


def _fitting_gpus(shape: ModelShape, target: Target, knobs: Knobs) -> MemoryPlan | None:
    """The plan where it fits the GPUs (its host rows unchecked), else None."""
    try:
        plan, over = _plan_gpus(shape, target, knobs)
    except PlanRefused:
        return None
    return plan if over is None else None


def _plan_gpus(shape: ModelShape, target: Target, knobs: Knobs) -> tuple[MemoryPlan, PhasePlan | None]:
    """The plan (host rows included) and its first phase that does not fit on the GPUs."""
    k = knobs
    if target.gpus % k.dp_replicate:
        raise PlanRefused(f"dist.dp_replicate={k.dp_replicate} does not divide {target.gpus} GPUs")
    fsdp = target.gpus // k.dp_replicate
    gpus = tuple(range(target.gpus))
    train_row, defer = _train_phase(shape, target, k, fsdp)
    training = _trainer_residents(shape, k, fsdp, defer)
    state, _ = _trainer_state(shape, k, fsdp, Offload.NONE)
    offloads = ([k.offload] if k.offload is not None else
                [Offload.NONE] if state < OFFLOAD_MIN_FRAC * target.gpu_bytes else
                [Offload.ALL])
    tp, offload = _pick_tp(shape, target, k, fsdp, offloads)
    if _fits_beside(shape, target, k, fsdp, tp, offload, training):
        offload, stream, stream_gpus = Offload.NONE, Stream.BESIDE, gpus
    else:
        stream, stream_gpus = _lent_stream(target, k, tp, train_row)
    fixed = [*_context(k)[:1], *_vllm_fixed(shape, k, tp)]
    room = _kv_room(shape, k, target, tp, fsdp, offload)
    if stream is Stream.BESIDE:
        room -= _beyond_rollout(shape, k, fsdp, training) + int(BESIDE_ALLOCATOR_FRAC * target.gpu_bytes)
    # vLLM is given a fraction of the GPU (three decimals); the KV cache is what that
    # fraction leaves once its weights and reserve are in.
    util = math.floor((sum(r.bytes for r in fixed) + room) / target.gpu_bytes * 1000) / 1000
    kv = int(util * target.gpu_bytes) - sum(r.bytes for r in fixed)
    on_host = _offloaded_names(offload)
    kept = [*(r for r in _state_residents(shape, k, fsdp) if r.name not in on_host),
            *_reference(shape, k, fsdp)]
    awake = (*_context(k), *_vllm_fixed(shape, k, tp), Resident("vllm", "kv_cache", kv))
    rollout = PhasePlan(
        Phase.ROLLOUT, gpus, (*awake, *kept),
        tuple(f"trainer.{n} -> host" for n in on_host) + ("trainer.grads freed",), target.gpu_bytes,
    )
    stream_rows = {
        Stream.BESIDE: [PhasePlan(Phase.STREAM, gpus, (*awake, *training), (), target.gpu_bytes)],
        Stream.LENT: [PhasePlan(Phase.STREAM, stream_gpus, train_row.residents,
                                ("vllm.weights (lent: sleep level 2)", "vllm.kv_cache"), target.gpu_bytes)],
        Stream.AFTER: [],
    }[stream]
    sizes = tuple(sorted(set(k.tp_sizes) | {tp})) if k.tp_sizes else (tp,)
    sync_rows = [
        _sync_phase(Phase.SYNC if t == tp else Phase.REGROUP, shape, target, k, fsdp, t)
        for t in sizes if t == tp or t == max(sizes)
    ]
    phases = (rollout, *stream_rows, train_row, *sync_rows)
    plan = MemoryPlan(
        shape=shape, target=target, knobs=k, tp=tp, tp_sizes=sizes, fsdp=fsdp, offload=offload,
        defer_reduction=defer, train_sleep_level=2, stream=stream, stream_gpus=stream_gpus,
        kv_cache_bytes=kv, gpu_memory_utilization=util, phases=phases,
        host=_host_rows(shape, target, k, fsdp, offload, sizes),
    )
    return plan, next((p for p in phases if not p.fits), None)


def _host_rows(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, offload: Offload, sizes: Sequence[int]
) -> tuple[HostPlan, ...]:
    """Each node's host RAM at its worst moment (the module's docstring lists them)."""
    g = target.gpus_per_node
    base = (
        Resident("trainer", "processes", g * TRAINER_HOST_BYTES),
        Resident("vllm", "processes", sum(
            g // t * (VLLM_ENGINE_HOST_BYTES + t * VLLM_WORKER_HOST_BYTES) for t in sizes)),
    )
    half = k.optim_bytes // 2  # one AdamW moment's bytes per element
    moments = 2 * _pinned(math.ceil(rows / fsdp) * cols * half for rows, cols in shape.tensors())
    pinned = (Resident("trainer", "adamw_pinned", g * moments),) if offload.moves_optimizer else ()
    params = ((Resident("trainer", "params", g * math.ceil(shape.params * k.master_bytes / fsdp)),)
              if offload.moves_params else ())
    bucket = Resident("trainer", "checkpoint_bucket",
                      max(CHECKPOINT_BUCKET_BYTES, shape.largest_tensor * k.master_bytes))
    # Rank 0 alone reads a model (rpk.train.load): one whole model, on node 0 only. A KL
    # reference is read at the first step, the moments pinned by the offloads before it.
    load = (*base, *(pinned if k.kl_reference else ()),
            Resident("trainer", "model_load", shape.params * k.master_bytes))
    rows = []
    for node in range(target.nodes):
        moments_of = {
            "rollout": (*base, *pinned, *params),
            # vLLM rests at level 2 for a save (rpk.loop.step.while_resting): no host copy
            # of its weights, which the sync after the save sends again.
            "checkpoint": (*base, *pinned, *((bucket,) if node == 0 else ())),
            **({"load": load} if node == 0 else {}),
        }
        moment, residents = max(moments_of.items(), key=lambda m: sum(r.bytes for r in m[1]))
        rows.append(HostPlan(node, moment, residents, target.host_bytes))
    return tuple(rows)


def _pinned(blocks: Iterable[int]) -> int:
    """Pinned host memory for blocks of these sizes: torch's caching host allocator
    rounds each up to a power of two, and keeps it (cached, still pinned) once freed."""
    return sum(1 << (b - 1).bit_length() for b in blocks if b)


def _fits_beside(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, tp: int, offload: Offload,
    training: Sequence[Resident],
) -> bool:
    """Whether the whole trainer fits beside an awake vLLM of `tp` (streamed training on
    every GPU, nothing offloaded) and leaves it at least BESIDE_MIN_KV_SHARE of the KV
    cache it has with the trainer state on host."""
    if k.stream_mode == "none" or k.offload not in (None, Offload.NONE):
        return False
    extra = _beyond_rollout(shape, k, fsdp, training) + int(BESIDE_ALLOCATOR_FRAC * target.gpu_bytes)
    room = _kv_room(shape, k, target, tp, fsdp, Offload.NONE) - extra
    return room >= max(_useful_kv(shape, k, tp),
                       BESIDE_MIN_KV_SHARE * _kv_room(shape, k, target, tp, fsdp, offload))


def _offloaded_names(offload: Offload) -> tuple[str, ...]:
    return tuple(n for n, moved in (("params", offload.moves_params), ("adamw", offload.moves_optimizer)) if moved)


def _pick_tp(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, offloads: Sequence[Offload]
) -> tuple[int, Offload]:
    """The given TP, or the smallest whose weights plus a useful KV cache fit; with the
    least offload that lets it."""
    tps = [k.tp] if k.tp else [t for t in _tp_candidates(target, shape)
                                if not k.tp_sizes or t in k.tp_sizes]
    if not tps:
        raise PlanRefused(
            f"rollout: no TP among {list(k.tp_sizes)} divides {target.gpus_per_node} GPUs per node"
        )
    for tp in tps:
        for offload in offloads:
            if _kv_room(shape, k, target, tp, fsdp, offload) >= _useful_kv(shape, k, tp):
                return tp, offload
    tp, offload = tps[-1], offloads[-1]
    room = _kv_room(shape, k, target, tp, fsdp, offload)
    raise PlanRefused(
        f"rollout, GPU 0: at TP {tp} the KV cache gets {max(room, 0) / GiB:.1f} GiB, less than "
        f"{USEFUL_SEQS} sequences of rollout.max_model_len={k.max_model_len} "
        f"({_useful_kv(shape, k, tp) / GiB:.1f} GiB); lower rollout.max_tokens or use GPUs "
        f"with more memory than {target.gpu_bytes / GiB:.0f} GiB"
        + ("" if k.offload is None or k.offload is Offload.ALL else ", or offload all")
    )


def _train_phase(shape: ModelShape, target: Target, k: Knobs, fsdp: int) -> tuple[PhasePlan, bool]:
    """vLLM asleep, the trainer on one micro-batch; deferred reduction where it fits."""
    options = [k.defer_reduction] if k.defer_reduction is not None else [True, False]
    row = None
    for defer in options:
        residents = (*_context(k), *_trainer_residents(shape, k, fsdp, defer))
        row = PhasePlan(Phase.TRAIN, tuple(range(target.gpus)), tuple(residents),
                        ("vllm.weights (sleep level 2)", "vllm.kv_cache"), target.gpu_bytes)
        if row.fits:
            return row, defer
    assert row is not None
    return row, options[-1]


def _lent_stream(target: Target, k: Knobs, tp: int, train_row: PhasePlan) -> tuple[Stream, tuple[int, ...]]:
    """Borrowing with HSDP: the lent half of the replicas train alone where their GPUs
    make whole replicate groups (the other ranks need not compute); else training waits
    for the round's end."""
    replicas = target.gpus // tp
    group = target.gpus // k.dp_replicate
    lent = tuple(range(target.gpus - (replicas // 2) * tp, target.gpus))
    if k.stream_mode == "borrow" and k.dp_replicate > 1 and lent and len(lent) % group == 0 and train_row.fits:
        return Stream.LENT, lent
    return Stream.AFTER, ()


def _sync_phase(
    phase: Phase, shape: ModelShape, target: Target, k: Knobs, fsdp: int, tp: int
) -> PhasePlan:
    """vLLM's weights woken (not its KV cache), the trainer's parameter shards (what is
    gathered whole, tensor by tensor), the bucket being sent and the tensor being
    gathered. The gradients are freed; AdamW stays on the GPU, since the code offloads it
    at `before_kv`, after the push (rpk.engine.fleet's wake order)."""
    bucket = max(k.weight_bucket_bytes, shape.largest_tensor * k.master_bytes)
    state = _state_residents(shape, k, fsdp)
    residents = (
        *_context(k),
        Resident("vllm", "weights", math.ceil(shape.params * k.engine_bytes / tp)),
        *state,
        *_reference(shape, k, fsdp),
        Resident("trainer", "sync_buckets", 2 * bucket),
    )
    moved = ("trainer.grads freed", "vllm.kv_cache (woken after the sync)")
    return PhasePlan(phase, tuple(range(target.gpus)), residents, moved, target.gpu_bytes)


def _refusal(plan: MemoryPlan, p: PhasePlan) -> str:
    """One line: the phase, the GPU, what overflows, and each change that would fit
    (each checked by planning again with it)."""
    biggest = max(p.residents, key=lambda r: r.bytes)
    over = (p.total - p.capacity * (1 - HEADROOM_FRAC)) / GiB
    return (
        f"{p.phase.value} phase, GPU {p.gpus[0]}: needs {p.total / GiB:.1f} GiB of "
        f"{p.capacity / GiB:.0f} GiB ({over:.1f} GiB over; largest: {biggest.owner}.{biggest.name} "
        f"{biggest.bytes / GiB:.1f} GiB); " + " or ".join(_fixes(plan))
    )


def _host_refusal(plan: MemoryPlan, h: HostPlan) -> str:
    """One line: host, the node, the moment, the bytes needed and there, and each change
    that would fit (each checked by planning again with it)."""
    biggest = max(h.residents, key=lambda r: r.bytes)
    return (
        f"host, node {h.node}: needs {h.total / 1e9:.1f} GB of RAM at {h.moment}, the node has "
        f"{h.capacity / 1e9:.1f} GB ({h.capacity * (1 - HOST_HEADROOM_FRAC) / 1e9:.1f} GB usable, "
        f"{HOST_HEADROOM_FRAC:.0%} kept free; largest: {biggest.owner}.{biggest.name} {biggest.bytes / 1e9:.1f} GB); "
        + " or ".join(_host_fixes(plan))
    )


def _host_fixes(plan: MemoryPlan) -> list[str]:
    k, t = plan.knobs, plan.target
    lighter = [o for o in _LIGHTER[k.offload] if _fits(plan.shape, t, replace(k, offload=o))] if k.offload else []
    fixes = [f"--train.offload {o.value}" for o in lighter[:1]] + _more_nodes(plan)
    # The least RAM that fits: with the plan's offload, or a lighter one it would take.
    options = [k] if k.offload is not None else [replace(k, offload=o) for o in (plan.offload, *_LIGHTER[plan.offload])]
    plans = [p for p in (_fitting_gpus(plan.shape, t, o) for o in options) if p is not None]
    needs = [(math.ceil(max(h.total for h in p.host) / (1 - HOST_HEADROOM_FRAC) / 1e9), p.offload) for p in plans]
    for gb, offload in sorted(needs, key=lambda n: n[0]):
        if _fits(plan.shape, replace(t, host_bytes=gb * 10**9), k):
            then = f" (offload {offload.value} then)" if offload is not plan.offload else ""
            fixes.append(f"nodes with {gb} GB of RAM or more{then}")
            break
    return fixes


def _more_nodes(plan: MemoryPlan) -> list[str]:
    """The fewest nodes (up to 8 times as many) on which the plan fits, FSDP over all."""
    t, k = plan.target, replace(plan.knobs, dp_replicate=1)
    more = next((replace(t, nodes=n) for n in range(t.nodes + 1, 8 * t.nodes + 1)
                 if _fits(plan.shape, replace(t, nodes=n), k)), None)
    if more is None:
        return []
    return [f"{more.gpus} GPUs ({more.nodes} nodes of {t.gpus_per_node}): FSDP divides the trainer state"]


def _fixes(plan: MemoryPlan) -> list[str]:
    k, t = plan.knobs, plan.target

    def fits(knobs: Knobs = k, target: Target = t) -> bool:
        return _fits(plan.shape, target, knobs)

    fixes = []
    if k.micro_batch_tokens > k.max_model_len and fits(replace(k, micro_batch_tokens=k.max_model_len)):
        fixes.append(f"--train.micro_batch_tokens {k.max_model_len}")
    if not k.activation_checkpointing and fits(replace(k, activation_checkpointing=True)):
        fixes.append("--train.activation_checkpointing true")
    if k.defer_reduction and fits(replace(k, defer_reduction=False)):
        fixes.append("--train.defer_reduction false")
    if k.offload not in (None, Offload.ALL) and fits(replace(k, offload=Offload.ALL)):
        fixes.append("offload all (unset the offload choice)")
    short = replace(k, max_model_len=k.max_model_len // 2, micro_batch_tokens=min(k.micro_batch_tokens, k.max_model_len // 2))
    if k.max_model_len >= 2048 and fits(short):
        fixes.append(f"--rollout.max_tokens below {short.max_model_len}")
    fixes += _more_nodes(plan)
    return fixes or [f"GPUs with more than {t.gpu_bytes / GiB:.0f} GiB"]
