"""The disaggregated GPU layout: the trainer's ranks on the first `dist.trainer_gpus`
GPUs of every node, the rollout's replicas on the others, as plain arithmetic.

Nothing moves back and forth between the phases of a step: vLLM never sleeps for the
trainer and the trainer never offloads for vLLM. Each side's GPUs hold only that side,
so the plan is two independent budgets (`pricing` prices the residents):

- a rollout GPU: vLLM's context, its weight shard and reserve, the contexts and graph
  pools of the elastic layouts asleep beside it, and the KV cache the rest leaves
  (`gpu_memory_utilization` gives vLLM exactly that), in every phase, the sync included
  (a weight arrives whole only where vLLM loads it through `load_weights`, one tensor at
  a time);
- a trainer GPU: the trainer's context, its state (FSDP over the trainer GPUs alone) and
  one micro-batch (the `train` row); during the sync its state and the shards in flight.

Host RAM per node (`MemoryPlan.host`): each process's baseline, and on node 0 at its
worst the model load (rank 0 alone reads the whole model in float32 and sends the other
ranks their shards) or the checkpoint bucket. Nothing is offloaded and vLLM never rests,
so nothing else.

This is the layout `nccl_m2n` is for: with no trainer rank on a rollout GPU every rank
and a replica's workers can share one NCCL communicator, so `auto` sends each rank's own
shards (`rpk.sync.backends.resolve`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from rpk.core.modes import Offload
from rpk.gpu.plan import explain
from rpk.gpu.plan.pricing import (
    ASLEEP_LAYOUT_BYTES,
    PROCESS_BYTES,
    Knobs,
    Phase,
    PhasePlan,
    Resident,
    Stream,
    checkpoint_bucket,
    host_processes,
    model_load,
    state_residents,
    trainer_residents,
    usable,
    useful_kv,
    vllm_fixed,
)
from rpk.gpu.plan.shared import MemoryPlan, check_dp, first_over, host_rows, tp_choices, train_row, vllm_share
from rpk.gpu.shape import ModelShape, PlanRefused, Target


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
    if k.judge is not None:
        raise PlanRefused(f"reward.judge with dist.trainer_gpus={trainer_gpus}: the memory plan colocates a "
                          f"judge on GPUs the trainer shares; unset dist.trainer_gpus to judge beside the rollout")
    devices = split_gpus(target.gpus_per_node, trainer_gpus, rollout)
    G = target.gpus_per_node
    train_ids = tuple(n * G + d for n in range(target.nodes) for d in range(trainer_gpus))
    roll_ids = tuple(n * G + d for n in range(target.nodes) for d in devices)
    fsdp = check_dp(k, len(train_ids), f"the {len(train_ids)} trainer GPUs "
                                       f"(dist.trainer_gpus={trainer_gpus} x {target.nodes} nodes)")

    # Rollout: the smallest TP (dividing the node's rollout GPUs) whose KV cache is useful.
    tps = tp_choices(shape, replace(target, gpus_per_node=len(devices)), k)
    tp = next((t for t in tps if _kv_room_split(shape, target, k, t) >= useful_kv(shape, k, t)), None)
    if tp is None or len(devices) % tp:
        t = max(tps[-1] if tps else k.tp, 1)
        raise PlanRefused(explain.short_kv(
            roll_ids[0], t, _kv_room_split(shape, target, k, t), useful_kv(shape, k, t), k,
            f", and no TP among {tps or [k.tp]} divides the {len(devices)} rollout GPUs per node better; "
            f"give the rollout more GPUs (lower dist.trainer_gpus={trainer_gpus}) or lower rollout.max_tokens"))
    contexts, fixed = [Resident("vllm", "context", PROCESS_BYTES), *_asleep(k, tp)], vllm_fixed(shape, k, tp)
    util, kv = vllm_share(target, fixed, _kv_room_split(shape, target, k, tp))
    rollout_row = PhasePlan(Phase.ROLLOUT, roll_ids, (*contexts, *fixed, Resident("vllm", "kv_cache", kv)), (),
                            target.gpu_bytes)

    # Training: deferred reduction where it fits, as on a shared GPU.
    trainer_context = Resident("trainer", "context", PROCESS_BYTES)
    train, defer = train_row(target, k, train_ids,
                             lambda defer: (trainer_context, *trainer_residents(shape, k, fsdp, defer)), ())
    bucket = max(k.weight_bucket_bytes // max(fsdp, 1), math.ceil(shape.largest_tensor * k.master_bytes / fsdp))
    sync_row = PhasePlan(Phase.SYNC, train_ids, (
        trainer_context, *state_residents(shape, k, fsdp),
        Resident("trainer", "sync_shards", 2 * bucket)), ("trainer.grads freed",), target.gpu_bytes)
    sizes = tuple(sorted(set(k.tp_sizes) | {tp}))
    base = host_processes(trainer_gpus, len(devices), sizes)
    plan = MemoryPlan(
        shape=shape, target=target, knobs=k, tp=tp, tp_sizes=sizes, fsdp=fsdp, offload=Offload.NONE,
        defer_reduction=defer, rest_level=None, stream=Stream.BESIDE, stream_gpus=train_ids,
        kv_cache_bytes=kv, gpu_memory_utilization=util, phases=(rollout_row, train, sync_row),
        # Rank 0 alone reads the model on host and sends the others their shards (rpk.train.load).
        host=host_rows(target, lambda node: {"load": (*base, model_load(shape, k)),
                                             "checkpoint": (*base, checkpoint_bucket(shape, k))}
                       if node == 0 else {"load": base}),
    )
    over = first_over(plan)
    if over is not None:
        raise PlanRefused(explain.gpu_refusal(
            over, "trainer GPU", False, f" with FSDP over {fsdp} GPUs; raise dist.trainer_gpus="
            f"{trainer_gpus} or lower train.micro_batch_tokens={k.micro_batch_tokens}"))
    short = next((h for h in plan.host if not h.fits), None)
    if short is not None:
        # Fewer trainer GPUs would not help: rank 0 alone loads the model, and a GPU given
        # to the rollout instead keeps at least a trainer rank's RAM in vLLM's processes.
        need = explain.host_ram_needed([plan])[0][0]
        raise PlanRefused(explain.host_refusal(short, [f"nodes with {need} GB of RAM or more"]))
    return plan


def _asleep(k: Knobs, tp: int) -> list[Resident]:
    """The elastic layouts other than the awake one's (TP `tp`), asleep on a rollout GPU."""
    asleep = len(set(k.tp_sizes) | {tp}) - 1
    return [Resident("vllm", "asleep_layouts", asleep * ASLEEP_LAYOUT_BYTES)] if asleep else []


def _kv_room_split(shape: ModelShape, target: Target, k: Knobs, tp: int) -> int:
    """KV bytes a rollout GPU has once vLLM's context, weight shard and reserve, and the
    layouts asleep beside it, are in."""
    fixed = (*_asleep(k, tp), *vllm_fixed(shape, k, tp))
    return usable(target) - PROCESS_BYTES - sum(r.bytes for r in fixed)
