"""The cost model: what each resident of a GPU or a node's RAM weighs, per phase.

Plain arithmetic from the model's shape (`rpk.gpu.shape`) and the run's knobs; the
layouts (`colocated`, `split`) put these residents in their rows.

What the trainer holds (rpk.train): float32 parameters sharded by FSDP (they are the
master copy: FSDP computes in bf16 from them), float32 gradients, AdamW's two float32
moments: 16 bytes a parameter over the FSDP degree. FSDP gathers a layer at a time in
bf16 (the next one prefetched) and the root (embeddings, LM head, final norm) for the
whole pass. Deferred gradient reduction (rpk.train.fsdp) keeps the *unsharded* gradient
on every rank in float32 until the step ends: 4 bytes a parameter, not divided. A KL
reference (`kl_reference`) is sharded the same way, float32, in every phase once loaded.

With LoRA (`lora_rank`) the base is frozen and held in bf16 (2 bytes a parameter over
the FSDP degree); only the adapters have gradients and AdamW moments, in float32 like a
full model's master copy (rpk.train.lora: FSDP2 asks one dtype of a group's trainable
parameters only, so float32 adapters beside a bf16 base are legal). The KL reference
is the base with the adapters off: no copy. vLLM rests at level 1 for a LoRA run (its
weights backed up to host, since a sync sends the adapter alone) and keeps a slot of
`max_lora_rank` adapter buffers on every GPU.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rpk.core.modes import Offload, StreamMode
from rpk.gpu.shape import ModelShape, Target

GiB = 2**30

# CUDA context, cuBLAS workspaces and NCCL buffers of one process on a GPU (the trainer
# rank and the vLLM worker each have one; a sleeping vLLM keeps its own).
PROCESS_BYTES = 1 * GiB
# Left free on every GPU for the caching allocator's fragmentation.
HEADROOM_FRAC = 0.05
# vLLM's CUDA graphs (captured for decode batch sizes up to max_num_seqs).
CUDA_GRAPH_BYTES = 1 * GiB
# What a vLLM layout asleep at level 2 leaves on each of its GPUs: its context (NCCL
# buffers included) and its CUDA-graph pool.
ASLEEP_LAYOUT_BYTES = PROCESS_BYTES + CUDA_GRAPH_BYTES
# The CUDA context torch makes in a process on a GPU it only copies to (rank 0's, on the
# other GPUs of a replica its IPC lane feeds): no cuBLAS workspace, no NCCL.
PEER_CONTEXT_BYTES = GiB // 2
# The prefill budget of one scheduler step rpk gives every engine on a GPU
# (`VLLMSettings.max_num_batched_tokens`), raised to the engine's max_num_seqs as vLLM
# requires (`prefill_tokens`); vLLM's profiling pass runs a batch of that many tokens.
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

# The offloads that keep more on the GPU and less on host, lightest last.
LIGHTER = {Offload.ALL: (Offload.OPTIMIZER, Offload.NONE), Offload.OPTIMIZER: (Offload.NONE,), Offload.NONE: ()}


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    STREAM = "stream"
    TRAIN = "train"
    SYNC = "sync"
    REGROUP = "regroup"


class Stream(enum.Enum):
    """Where streamed training (training while the tail generates) may run."""

    BESIDE = "beside"  # on every GPU, beside the awake vLLM
    LENT = "lent"  # only on the GPUs of replicas lent to the trainer (asleep)
    AFTER = "after"  # nowhere: training waits for the round's end


@dataclass(frozen=True, slots=True)
class JudgeKnobs:
    """A judge colocated on the rollout GPUs (`judge`): its model's shape, its longest
    input with the verdict, and the requests each replica (one per GPU) has in flight."""

    shape: ModelShape
    max_model_len: int
    max_num_seqs: int


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
    stream_mode: StreamMode = StreamMode.THREAD  # what the config asks
    engine_bytes: int = 2  # bf16 engine weights
    kv_bytes: int = 2
    master_bytes: int = 4  # float32 parameters (the master copy)
    grad_bytes: int = 4
    optim_bytes: int = 8  # AdamW: two float32 moments
    compute_bytes: int = 2  # bf16 compute (FSDP's gathered layers, activations)
    kl_reference: bool = False  # the trainer loads a KL reference model (at its first step)
    lora_rank: int = 0  # LoRA adapters' rank; 0 = full fine-tuning
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_slot_rank: int = 0  # vLLM's max_lora_rank (its buffers are this rank)
    judge: JudgeKnobs | None = None  # a judge beside the rollout on every GPU

    @property
    def trainable_bytes(self) -> tuple[int, int, int]:
        """Bytes a trainable parameter, its gradient and its AdamW moments take: float32,
        a full model's master copy or LoRA's adapters alike."""
        return self.master_bytes, self.grad_bytes, self.optim_bytes


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


def usable(target: Target) -> int:
    return int(target.gpu_bytes * (1 - HEADROOM_FRAC))


# LoRA's `all-linear`: every linear of a decoder layer (PEFT leaves out the LM head).
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The trainer's state by what an offload moves: parameters (`all`), AdamW moments (both).
PARAM_STATE = ("params", "base", "adapters")
OPTIMIZER_STATE = ("adamw", "adapter_adamw")


def adapter_tensors(shape: ModelShape, rank: int, targets: Sequence[str]) -> list[tuple[int, int]]:
    """Every LoRA tensor as (rows, elements per row): A is rank x in, B out x rank."""
    h, q, kv, i = shape.hidden_size, shape.num_heads * shape.head_dim, shape.kv_dim, shape.intermediate_size
    linears = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
               "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    names = LINEAR_MODULES if "all-linear" in targets else [t for t in targets if t in linears]
    layer = [t for n in names for t in ((rank, linears[n][0]), (linears[n][1], rank))]
    return layer * shape.num_layers


def adapter_params(shape: ModelShape, rank: int, targets: Sequence[str]) -> int:
    return sum(rows * cols for rows, cols in adapter_tensors(shape, rank, targets))


def trainable_tensors(shape: ModelShape, k: Knobs) -> list[tuple[int, int]]:
    """The tensors with gradients and AdamW moments: every one, or the adapters'."""
    return adapter_tensors(shape, k.lora_rank, k.lora_targets) if k.lora_rank else shape.tensors()


def trainable_params(shape: ModelShape, k: Knobs) -> int:
    return adapter_params(shape, k.lora_rank, k.lora_targets) if k.lora_rank else shape.params


def state_residents(shape: ModelShape, k: Knobs, fsdp: int) -> list[Resident]:
    """The trainer state that outlives a step: parameter shards and AdamW's moments (with
    LoRA: the frozen bf16 base, the adapters and their moments)."""
    if not k.lora_rank:
        return [
            Resident("trainer", "params", math.ceil(shape.params * k.master_bytes / fsdp)),
            Resident("trainer", "adamw", math.ceil(shape.params * k.optim_bytes / fsdp)),
        ]
    n, (param_b, _, optim_b) = trainable_params(shape, k), k.trainable_bytes
    return [
        Resident("trainer", "base", math.ceil(shape.params * k.compute_bytes / fsdp)),
        Resident("trainer", "adapters", math.ceil(n * param_b / fsdp)),
        Resident("trainer", "adapter_adamw", math.ceil(n * optim_b / fsdp)),
    ]


def offloaded_names(k: Knobs, offload: Offload) -> tuple[str, ...]:
    """The state residents `offload` moves to host while vLLM generates."""
    names = ("base", "adapters", "adapter_adamw") if k.lora_rank else ("params", "adamw")
    return tuple(n for n in names if (offload.moves_params and n in PARAM_STATE)
                 or (offload.moves_optimizer and n in OPTIMIZER_STATE))


def trainer_state(shape: ModelShape, k: Knobs, fsdp: int, offload: Offload) -> tuple[int, int]:
    """(bytes of the trainer's state on one GPU, of which offloaded)."""
    state = state_residents(shape, k, fsdp)
    moved = offloaded_names(k, offload)
    return sum(r.bytes for r in state), sum(r.bytes for r in state if r.name in moved)


def reference(shape: ModelShape, k: Knobs, fsdp: int) -> tuple[Resident, ...]:
    """The KL reference's float32 shards: on the GPU in every phase (nothing offloads it)."""
    if not k.kl_reference:
        return ()
    return (Resident("trainer", "kl_reference", math.ceil(shape.params * k.master_bytes / fsdp)),)


def beyond_rollout(shape: ModelShape, k: Knobs, fsdp: int, training: Sequence[Resident]) -> int:
    """What training adds on a GPU to the state (nothing offloaded) and reference it keeps."""
    kept = trainer_state(shape, k, fsdp, Offload.NONE)[0] + sum(r.bytes for r in reference(shape, k, fsdp))
    return sum(r.bytes for r in training) - kept


def trainer_residents(shape: ModelShape, k: Knobs, fsdp: int, defer: bool) -> list[Resident]:
    """The trainer while it trains one micro-batch (with LoRA the gradients are the
    adapters'; the activations are the same, backward runs through every layer)."""
    n = trainable_params(shape, k)
    _, grad_b, _ = k.trainable_bytes
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
    grads = n * grad_b if defer else math.ceil(n * grad_b / fsdp)
    # Gathered in bf16: the root for the whole pass, a layer and the prefetched next one;
    # the largest gathered gradient: float32 before its reduce-scatter, or deferred, bf16
    # before FSDP2 adds it into the float32 one (traced: tests/test_device_ledger.py).
    gathered = (shape.root_params + 2 * shape.layer_params) * k.compute_bytes
    if k.lora_rank:  # one layer's adapter gradient; the root has no adapters
        gathered += n // shape.num_layers * grad_b
    else:
        gathered += max(shape.root_params, shape.layer_params) * (k.compute_bytes if defer else k.grad_bytes)
    # The reference's forward gathers its own root and layers (resharded after it).
    gathered += (shape.root_params + 2 * shape.layer_params) * k.compute_bytes if k.kl_reference else 0
    # The optimizer step is the row's other moment: the micro-batch's tensors are gone,
    # the gradient is sharded, and foreach AdamW holds one float32 temporary per shard
    # (its sqrt of the second moment). Seen on an H200 at 1.5B, FSDP 1: the step's peak
    # was the whole step's (28.65 GiB against 26.2 planned for the micro-batch alone).
    micro = grads + gathered + acts + head
    step = math.ceil(n * (grad_b + k.trainable_bytes[0]) / fsdp)
    grad_name = ("adapter_" if k.lora_rank else "") + ("grads_unsharded" if defer else "grads")
    return [
        *state_residents(shape, k, fsdp),
        *reference(shape, k, fsdp),
        Resident("trainer", grad_name, grads),
        Resident("trainer", "fsdp_gathered", gathered),
        Resident("trainer", "activations", acts),
        Resident("trainer", "logprob_head", head),
        *([Resident("trainer", "adamw_step", step - micro)] if step > micro else []),
    ]


def prefill_tokens(seqs: int) -> int:
    """An engine's `max_num_batched_tokens` for `seqs` sequences (the rule of
    `rpk.engine.vllm_settings.batched_tokens`): never below max_num_seqs."""
    return max(PREFILL_TOKENS, seqs)


def vllm_fixed(shape: ModelShape, k: Knobs, tp: int) -> list[Resident]:
    """An awake replica's shard on one GPU, KV cache aside."""
    seqs = k.max_num_seqs * tp
    prefill = prefill_tokens(seqs) * (4 * shape.hidden_size + 2 * shape.intermediate_size // tp) * k.compute_bytes
    sampler = seqs * shape.vocab_size * 4 * 2  # float32 logits and probabilities
    # With LoRA vLLM holds a slot of adapter buffers at max_lora_rank (max_loras 1).
    slot = math.ceil(adapter_params(shape, k.lora_slot_rank, LINEAR_MODULES) * k.engine_bytes / tp)
    return [
        Resident("vllm", "weights", math.ceil(shape.params * k.engine_bytes / tp)),
        Resident("vllm", "reserve", CUDA_GRAPH_BYTES + prefill + sampler),
        *([Resident("vllm", "lora_slot", slot)] if k.lora_rank else []),
    ]


def context(k: Knobs, tp: int) -> list[Resident]:
    """The processes' contexts on a shared GPU, the awake layout of TP `tp`. Each other
    elastic layout, asleep at level 2, keeps its own context and CUDA-graph pool (vLLM
    keeps the pool outside sleep mode's cumem unless `sleep_mode_offload_cudagraph`,
    `vllm/config/vllm.py` `use_cumem_cudagraph_pool`). Where a layout's replica holding
    the trainer's GPU spans others, rank 0's IPC lane copies each bucket onto them
    (`rpk.sync.lanes.IpcLane`): its process then has a context there too."""
    layouts = set(k.tp_sizes) | {tp}
    asleep = len(layouts) - 1
    trainer = PROCESS_BYTES + (PEER_CONTEXT_BYTES if max(layouts) > 1 else 0)
    return [Resident("vllm", "context", PROCESS_BYTES), Resident("trainer", "context", trainer),
            *([Resident("vllm", "asleep_layouts", asleep * ASLEEP_LAYOUT_BYTES)] if asleep else []),
            *([Resident("judge", "context", PROCESS_BYTES)] if k.judge is not None else [])]


def resting(k: Knobs) -> list[Resident]:
    """What the awake layout keeps on a GPU while it sleeps for the trainer: its CUDA-graph
    pool (outside cumem, as above); its context is in `context`."""
    return [Resident("vllm", "cuda_graphs", CUDA_GRAPH_BYTES)]


def useful_kv(shape: ModelShape, k: Knobs, tp: int) -> int:
    return USEFUL_SEQS * k.max_model_len * shape.kv_bytes_per_token(k.kv_bytes) // tp


def splits_heads(shape: ModelShape, tp: int) -> bool:
    """Whether vLLM runs the model at TP `tp`: the attention heads divide among the ranks
    (`vllm/config/model.py`, `verify_with_parallel_config`), and the KV heads either
    divide too or are replicated a whole number of times."""
    return shape.num_heads % tp == 0 and (shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0)


def tp_candidates(target: Target, shape: ModelShape) -> list[int]:
    """TP sizes inside one node that split the attention heads."""
    return [t for t in range(1, target.gpus_per_node + 1) if target.gpus_per_node % t == 0 and splits_heads(shape, t)]


def sync_bucket(shape: ModelShape, k: Knobs) -> int:
    """A bucket of the weight sync: the configured size, or the largest tensor alone; a
    LoRA sync sends the adapters alone, all of them when they are smaller than a bucket."""
    if k.lora_rank:
        return min(k.weight_bucket_bytes, trainable_params(shape, k) * k.trainable_bytes[0])
    return max(k.weight_bucket_bytes, shape.largest_tensor * k.master_bytes)


def host_processes(trainer_gpus: int, rollout_gpus: int, sizes: Sequence[int]) -> tuple[Resident, ...]:
    """What a node's processes hold whatever the moment: a trainer rank per trainer GPU,
    every layout's replicas (engine core and a worker per GPU) over the rollout GPUs."""
    return (
        Resident("trainer", "processes", trainer_gpus * TRAINER_HOST_BYTES),
        Resident("vllm", "processes", sum(
            rollout_gpus // t * (VLLM_ENGINE_HOST_BYTES + t * VLLM_WORKER_HOST_BYTES) for t in sizes)),
    )


def model_load(shape: ModelShape, k: Knobs) -> Resident:
    """Rank 0 alone reads the whole model on host in the trainer's dtype (rpk.train.load):
    float32, or bf16 for a LoRA run's frozen base."""
    return Resident("trainer", "model_load", shape.params * (k.compute_bytes if k.lora_rank else k.master_bytes))


def checkpoint_bucket(shape: ModelShape, k: Knobs) -> Resident:
    return Resident("trainer", "checkpoint_bucket", max(CHECKPOINT_BUCKET_BYTES, shape.largest_tensor * k.master_bytes))


def pinned(blocks: Iterable[int]) -> int:
    """Pinned host memory for blocks of these sizes: torch's caching host allocator
    rounds each up to a power of two, and keeps it (cached, still pinned) once freed."""
    return sum(1 << (b - 1).bit_length() for b in blocks if b)
