"""The disaggregated GPU layout: the trainer's ranks on the first `dist.trainer_gpus`
GPUs of every node, the rollout's replicas on the others, as plain arithmetic.

Nothing moves back and forth between the phases of a step: vLLM never sleeps for the
trainer and the trainer never offloads for vLLM. Each side's GPUs hold only that side,
so the plan is two independent budgets (`rpk.gpu.memory` prices the residents):

- a rollout GPU: vLLM's context, its weight shard and reserve, and the KV cache the rest
  leaves (`gpu_memory_utilization` gives vLLM exactly that), in every phase, the sync
  included (a weight arrives whole only where vLLM loads it through `load_weights`,
  one tensor at a time);
- a trainer GPU: the trainer's context, its state (FSDP over the trainer GPUs alone) and
  one micro-batch (the `train` row); during the sync its state and the shards in flight.

Host RAM per node (`MemoryPlan.host`): each process's baseline, and on node 0 at its
worst the model load (rank 0 alone reads the whole model in float32 and sends the other
ranks their shards) or the checkpoint bucket. Nothing is offloaded and vLLM never rests,
so nothing else.

This is the layout `nccl_m2n` is for: with no trainer rank on a rollout GPU every rank
and a replica's workers can share one NCCL communicator, so `auto` sends each rank's own
shards (`rpk.engine.vllm_fleet.transfer_backend`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from rpk.gpu.memory import (
    CHECKPOINT_BUCKET_BYTES,
    HEADROOM_FRAC,
    HOST_HEADROOM_FRAC,
    TRAINER_HOST_BYTES,
    VLLM_ENGINE_HOST_BYTES,
    VLLM_WORKER_HOST_BYTES,
    HostPlan,
    PROCESS_BYTES,
    GiB,
    Knobs,
    MemoryPlan,
    ModelShape,
    Offload,
    Phase,
    PhasePlan,
    PlanRefused,
    Resident,
    Stream,
    USEFUL_SEQS,
    Target,
    _state_residents,
    _tp_candidates,
    _trainer_residents,
    _useful_kv,
    _vllm_fixed,
)


def split_gpus(gpus_per_node: int, trainer_gpus: int, rollout: Sequence[int] = ()) -> tuple[int, ...]:
    """The rollout's GPUs of each node (local ids): `rollout`, else every GPU after the
    trainer's; refused, naming the values, where the two sides overlap or one is empty."""
    if not 0 < trainer_gpus < gpus_per_node:
        raise PlanRefused(f"dist.trainer_gpus={trainer_gpus}: the trainer takes 1..{gpus_per_node - 1} "
                          f"of the {gpus_per_node} GPUs per node, the rollout the rest")
    devices = tuple(rollout) or tuple(range(trainer_gpus, gpus_per_node))
    shared = sorted(set(devices) & set(range(trainer_gpus)))
    outside = sorted(d for d in devices if not 0 <= d < gpus_per_node)
    if shared or outside:
        raise PlanRefused(
            f"rollout.devices={list(devices)} with dist.trainer_gpus={trainer_gpus}: "
            + (f"GPUs {shared} are the trainer's (0..{trainer_gpus - 1})" if shared else
               f"GPUs {outside} are not among the node's 0..{gpus_per_node - 1}"))
    return devices


def plan_split(shape: ModelShape, target: Target, knobs: Knobs, trainer_gpus: int,
               rollout: Sequence[int] = ()) -> MemoryPlan:
    """The memory plan of the disaggregated layout (`trainer_gpus` per node train, the
    others roll out), or `PlanRefused` naming the side, the GPU and what to change."""
    k = knobs
    devices = split_gpus(target.gpus_per_node, trainer_gpus, rollout)
    G = target.gpus_per_node
    train_ids = tuple(n * G + d for n in range(target.nodes) for d in range(trainer_gpus))
    roll_ids = tuple(n * G + d for n in range(target.nodes) for d in devices)
    if len(train_ids) % k.dp_replicate:
        raise PlanRefused(f"dist.dp_replicate={k.dp_replicate} does not divide the {len(train_ids)} "
                          f"trainer GPUs (dist.trainer_gpus={trainer_gpus} x {target.nodes} nodes)")
    fsdp = len(train_ids) // k.dp_replicate
    usable = int(target.gpu_bytes * (1 - HEADROOM_FRAC))
    context = Resident("vllm", "context", PROCESS_BYTES)

    # Rollout: the smallest TP (dividing the node's rollout GPUs) whose KV cache is useful.
    sides = replace(target, gpus_per_node=len(devices))
    tps = [k.tp] if k.tp else [t for t in _tp_candidates(sides, shape) if not k.tp_sizes or t in k.tp_sizes]
    tp = next((t for t in tps if _kv_room(shape, k, t, usable) >= _useful_kv(shape, k, t)), None)
    if tp is None or len(devices) % tp:
        t = max(tps[-1] if tps else k.tp, 1)
        raise PlanRefused(
            f"rollout, GPU {roll_ids[0]}: at TP {t} the KV cache gets "
            f"{max(_kv_room(shape, k, t, usable), 0) / GiB:.1f} GiB, less than {USEFUL_SEQS} sequences of "
            f"rollout.max_model_len={k.max_model_len} ({_useful_kv(shape, k, t) / GiB:.1f} GiB), and no TP "
            f"among {tps or [k.tp]} divides the {len(devices)} rollout GPUs per node better; give the rollout "
            f"more GPUs (lower dist.trainer_gpus={trainer_gpus}) or lower rollout.max_tokens")
    fixed = [context, *_vllm_fixed(shape, k, tp)]
    util = math.floor((sum(r.bytes for r in fixed) + _kv_room(shape, k, tp, usable)) / target.gpu_bytes * 1000) / 1000
    kv = int(util * target.gpu_bytes) - sum(r.bytes for r in fixed)
    awake = (*fixed, Resident("vllm", "kv_cache", kv))
    rollout_row = PhasePlan(Phase.ROLLOUT, roll_ids, awake, (), target.gpu_bytes)

    # Training: deferred reduction where it fits, as on a shared GPU.
    options = [k.defer_reduction] if k.defer_reduction is not None else [True, False]
    for defer in options:
        training = (Resident("trainer", "context", PROCESS_BYTES), *_trainer_residents(shape, k, fsdp, defer))
        train_row = PhasePlan(Phase.TRAIN, train_ids, training, (), target.gpu_bytes)
        if train_row.fits:
            break
    bucket = max(k.weight_bucket_bytes // max(fsdp, 1), math.ceil(shape.largest_tensor * k.master_bytes / fsdp))
    sync_row = PhasePlan(Phase.SYNC, train_ids, (
        Resident("trainer", "context", PROCESS_BYTES), *_state_residents(shape, k, fsdp),
        Resident("trainer", "sync_shards", 2 * bucket)), ("trainer.grads freed",), target.gpu_bytes)
    plan = MemoryPlan(
        shape=shape, target=target, knobs=k, tp=tp, tp_sizes=tuple(sorted(set(k.tp_sizes) | {tp})),
        fsdp=fsdp, offload=Offload.NONE, defer_reduction=defer, train_sleep_level=0,
        stream=Stream.BESIDE, stream_gpus=train_ids, kv_cache_bytes=kv, gpu_memory_utilization=util,
        phases=(rollout_row, train_row, sync_row),
        host=_host_rows(shape, target, k, trainer_gpus, len(devices), tuple(sorted(set(k.tp_sizes) | {tp}))),
    )
    over = next((p for p in plan.phases if not p.fits), None)
    if over is not None:
        biggest = max(over.residents, key=lambda r: r.bytes)
        raise PlanRefused(
            f"{over.phase.value} phase, trainer GPU {over.gpus[0]}: needs {over.total / GiB:.1f} GiB of "
            f"{over.capacity / GiB:.0f} GiB (largest: {biggest.owner}.{biggest.name} "
            f"{biggest.bytes / GiB:.1f} GiB) with FSDP over {fsdp} GPUs; raise dist.trainer_gpus="
            f"{trainer_gpus} or lower train.micro_batch_tokens={k.micro_batch_tokens}")
    short = next((h for h in plan.host if not h.fits), None)
    if short is not None:
        raise PlanRefused(_host_refusal(plan, short))
    return plan


def _host_rows(shape: ModelShape, target: Target, k: Knobs, trainer_gpus: int, rollout_gpus: int,
               sizes: Sequence[int]) -> tuple[HostPlan, ...]:
    base = (
        Resident("trainer", "processes", trainer_gpus * TRAINER_HOST_BYTES),
        Resident("vllm", "processes", sum(
            rollout_gpus // t * (VLLM_ENGINE_HOST_BYTES + t * VLLM_WORKER_HOST_BYTES) for t in sizes)),
    )
    # Rank 0 alone reads the model on host and sends the others their shards (rpk.train.load).
    load = Resident("trainer", "model_load", shape.params * k.master_bytes)
    bucket = Resident("trainer", "checkpoint_bucket",
                      max(CHECKPOINT_BUCKET_BYTES, shape.largest_tensor * k.master_bytes))
    rows = []
    for node in range(target.nodes):
        moments = {"load": (*base, load), "checkpoint": (*base, bucket)} if node == 0 else {"load": base}
        moment, residents = max(moments.items(), key=lambda m: sum(r.bytes for r in m[1]))
        rows.append(HostPlan(node, moment, residents, target.host_bytes))
    return tuple(rows)


def _host_refusal(plan: MemoryPlan, h: HostPlan) -> str:
    """One line: host, the node, the bytes needed and there, and the least RAM that holds
    this plan. Fewer trainer GPUs would not help: rank 0 alone loads the model, and a GPU
    given to the rollout instead keeps at least a trainer rank's RAM in vLLM's processes."""
    need = math.ceil(max(r.total for r in plan.host) / (1 - HOST_HEADROOM_FRAC) / 1e9)
    biggest = max(h.residents, key=lambda r: r.bytes)
    return (
        f"host, node {h.node}: needs {h.total / 1e9:.1f} GB of RAM at {h.moment}, the node has "
        f"{h.capacity / 1e9:.1f} GB ({h.capacity * (1 - HOST_HEADROOM_FRAC) / 1e9:.1f} GB usable; largest: "
        f"{biggest.owner}.{biggest.name} {biggest.bytes / 1e9:.1f} GB); nodes with {need} GB of RAM or more"
    )


def _kv_room(shape: ModelShape, k: Knobs, tp: int, usable: int) -> int:
    """KV bytes a rollout GPU has once vLLM's context, weight shard and reserve are in."""
    return usable - PROCESS_BYTES - sum(r.bytes for r in _vllm_fixed(shape, k, tp))
