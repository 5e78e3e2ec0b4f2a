"""The colocated memory plan: rollout and training share every GPU (veRL's hybrid
engine, the paper's setting) and hand the memory back and forth each step.

From the model's `config.json` and the layout alone (no device is touched) it says the
bytes of every resident on a GPU in each phase, what moves out of the GPU for it (vLLM's
sleep level, the trainer state offloaded to host), the KV cache that fits, and the
`gpu_memory_utilization` that gives vLLM exactly that. A config that does not fit is
refused before anything starts, in one line naming the phase, the GPU and what to change.

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

A judge beside the rollout (`Knobs.judge`, `judge`) is awake in `rollout` and `stream`
and asleep (its context alone) in the others; the plan picks how many of its layers
stream from host.

Host RAM, per node (`MemoryPlan.host`), at the worst moment: `rollout` (the offloaded
trainer state), `checkpoint` (the trainer's state back on the GPUs for the save while
vLLM rests; node 0 writes a bucket from host) or `load` (node 0 alone: rank 0 reads the
whole model in float32 on host and sends each rank its shards, rpk.train.load; a KL
reference is read so mid-run). docs/gpu-box.md has the residents. vLLM rests at level 2,
for training and for a save alike: its weights are discarded, never copied to host;
except in a LoRA run, whose sync sends the adapter alone: level 1 backs every GPU's
weight shard up to host (a `train` moment) and wakes it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from rpk.core.modes import Offload, RestLevel, StreamMode
from rpk.gpu.plan import explain, judge
from rpk.gpu.plan.pricing import (
    BESIDE_ALLOCATOR_FRAC,
    BESIDE_MIN_KV_SHARE,
    LIGHTER,
    OFFLOAD_MIN_FRAC,
    PARAM_STATE,
    GiB,
    HostPlan,
    Knobs,
    Phase,
    PhasePlan,
    Resident,
    Stream,
    beyond_rollout,
    checkpoint_bucket,
    context,
    host_processes,
    model_load,
    offloaded_names,
    pinned,
    reference,
    resting,
    state_residents,
    sync_bucket,
    trainable_tensors,
    trainer_residents,
    trainer_state,
    usable,
    useful_kv,
    vllm_fixed,
)
from rpk.gpu.plan.shared import MemoryPlan, check_dp, first_over, host_rows, tp_choices, train_row, vllm_share
from rpk.gpu.shape import ModelShape, PlanRefused, Target


def plan_memory(shape: ModelShape, target: Target, knobs: Knobs) -> MemoryPlan:
    """The plan, or `PlanRefused` naming the phase and the GPU (or the node, for host
    RAM) and what to change."""
    plan, over = _plan(shape, target, knobs)
    if isinstance(over, PhasePlan):
        raise PlanRefused(explain.gpu_refusal(over, "GPU", True, "; " + " or ".join(explain.fixes(plan, fits))))
    if over is not None:
        raise PlanRefused(explain.host_refusal(over, explain.host_fixes(plan, fits, _fitting_gpus)))
    return plan


def fits(shape: ModelShape, target: Target, knobs: Knobs) -> bool:
    try:
        return _plan(shape, target, knobs)[1] is None
    except PlanRefused:
        return False


def _plan(shape: ModelShape, target: Target, knobs: Knobs) -> tuple[MemoryPlan, PhasePlan | HostPlan | None]:
    """The plan and its first phase, or else node, that does not fit (None: all fit).
    Where the plan chose the offload and a node's RAM cannot hold it, a lighter one that
    still fits the GPUs is taken."""
    plan, over = _plan_gpus(shape, target, knobs)
    short = next((h for h in plan.host if not h.fits), None)
    if over is not None or short is None:
        return plan, over
    if knobs.offload is None:
        for lighter in LIGHTER[plan.offload]:
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


def _plan_gpus(shape: ModelShape, target: Target, k: Knobs) -> tuple[MemoryPlan, PhasePlan | None]:
    """The plan (host rows included) and its first phase that does not fit on the GPUs."""
    fsdp = check_dp(k, target.gpus, f"{target.gpus} GPUs")
    gpus = tuple(range(target.gpus))
    rest = RestLevel.for_sync(adapter=bool(k.lora_rank))
    asleep = "sleep level 1: to host" if rest is RestLevel.KEEP_WEIGHTS else "sleep level 2"
    judge_asleep = ("judge.weights (sleep level 1: to host)", "judge.kv_cache") if k.judge is not None else ()
    state, _ = trainer_state(shape, k, fsdp, Offload.NONE)
    offloads = ([k.offload] if k.offload is not None else
                [Offload.NONE] if state < OFFLOAD_MIN_FRAC * target.gpu_bytes else
                [Offload.ALL])
    tp, offload = _pick_tp(shape, target, k, fsdp, offloads)
    train, defer = train_row(
        target, k, gpus, lambda defer: (*context(k, tp), *resting(k), *trainer_residents(shape, k, fsdp, defer)),
        (f"vllm.weights ({asleep})", "vllm.kv_cache", *judge_asleep))
    training = trainer_residents(shape, k, fsdp, defer)
    if _fits_beside(shape, target, k, fsdp, tp, offload, training):
        offload, stream, stream_gpus = Offload.NONE, Stream.BESIDE, gpus
    else:
        stream, stream_gpus = _lent_stream(target, k, tp, train)
    room = _kv_room_colocated(shape, target, k, fsdp, tp, offload)
    if stream is Stream.BESIDE:
        room -= beyond_rollout(shape, k, fsdp, training) + int(BESIDE_ALLOCATOR_FRAC * target.gpu_bytes)
    layout = _judge_layout(k, room, useful_kv(shape, k, tp))
    judging = judge.awake(k.judge, layout) if k.judge is not None and layout is not None else []
    util, kv = vllm_share(target, vllm_fixed(shape, k, tp), room - _judge_extra(k, layout))
    on_host = offloaded_names(k, offload)
    kept = [*(r for r in state_residents(shape, k, fsdp) if r.name not in on_host), *reference(shape, k, fsdp)]
    awake = (*context(k, tp), *vllm_fixed(shape, k, tp), Resident("vllm", "kv_cache", kv), *judging)
    rollout = PhasePlan(
        Phase.ROLLOUT, gpus, (*awake, *kept),
        tuple(f"trainer.{n} -> host" for n in on_host) + ("trainer.grads freed",), target.gpu_bytes,
    )
    stream_rows = {
        Stream.BESIDE: [PhasePlan(Phase.STREAM, gpus, (*awake, *training), (), target.gpu_bytes)],
        Stream.LENT: [PhasePlan(Phase.STREAM, stream_gpus, (*train.residents, *judging),
                                ("vllm.weights (lent: sleep level 2)", "vllm.kv_cache"), target.gpu_bytes)],
        Stream.AFTER: [],
    }[stream]
    sizes = tuple(sorted(set(k.tp_sizes) | {tp})) if k.tp_sizes else (tp,)
    sync_rows = [
        _sync_phase(shape, target, k, fsdp, t, sizes, Phase.SYNC if t == tp else Phase.REGROUP)
        for t in sizes if t == tp or t == max(sizes)
    ]
    plan = MemoryPlan(
        shape=shape, target=target, knobs=k, tp=tp, tp_sizes=sizes, fsdp=fsdp, offload=offload,
        defer_reduction=defer, rest_level=rest, stream=stream, stream_gpus=stream_gpus,
        kv_cache_bytes=kv, gpu_memory_utilization=util, phases=(rollout, *stream_rows, train, *sync_rows),
        host=_host_rows(shape, target, k, fsdp, offload, sizes, tp, layout), judge=layout,
    )
    return plan, first_over(plan)


def _host_rows(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, offload: Offload, sizes: Sequence[int], tp: int,
    layout: judge.JudgeLayout | None,
) -> tuple[HostPlan, ...]:
    """Each node's host RAM at its worst moment (the module's docstring lists them)."""
    g = target.gpus_per_node
    base = host_processes(g, g, sizes)
    half = k.trainable_bytes[2] // 2  # one AdamW moment's bytes per element
    moments = 2 * pinned(math.ceil(rows / fsdp) * cols * half for rows, cols in trainable_tensors(shape, k))
    adamw = (Resident("trainer", "adamw_pinned", g * moments),) if offload.moves_optimizer else ()
    moved = sum(r.bytes for r in state_residents(shape, k, fsdp) if r.name in PARAM_STATE)
    params = (Resident("trainer", "params", g * moved),) if offload.moves_params else ()
    # Level 1 (LoRA): each GPU's weight shard waits on host while the trainer works.
    backup = ((Resident("vllm", "weights_backup", g * math.ceil(shape.params * k.engine_bytes / tp)),)
              if k.lora_rank else ())
    # Rank 0 alone reads a model (rpk.train.load): one whole model, on node 0 only. A KL
    # reference is read at the first step, the moments pinned by the offloads before it.
    if k.judge is not None and layout is not None:
        always, asleep = judge.host(k.judge, layout, g)
        base, resting = (*base, *always), (*backup, *asleep)
    else:
        resting = backup
    load = (*base, *(adamw if k.kl_reference else ()), model_load(shape, k))

    def moments_of(node: int) -> dict[str, tuple[Resident, ...]]:
        return {
            "rollout": (*base, *adamw, *params),
            **({"train": (*base, *adamw, *resting)} if resting else {}),
            # vLLM rests for a save as for training (rpk.loop.step.while_resting): at level
            # 2 no host copy of its weights, which the sync after the save sends again.
            "checkpoint": (*base, *adamw, *resting, *((checkpoint_bucket(shape, k),) if node == 0 else ())),
            **({"load": load} if node == 0 else {}),
        }

    return host_rows(target, moments_of)


def _fits_beside(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, tp: int, offload: Offload,
    training: Sequence[Resident],
) -> bool:
    """Whether the whole trainer fits beside an awake vLLM of `tp` (streamed training on
    every GPU, nothing offloaded) and leaves it at least BESIDE_MIN_KV_SHARE of the KV
    cache it has with the trainer state on host."""
    if k.stream_mode is StreamMode.NONE or k.offload not in (None, Offload.NONE):
        return False
    extra = beyond_rollout(shape, k, fsdp, training) + int(BESIDE_ALLOCATOR_FRAC * target.gpu_bytes)
    room = _kv_room_colocated(shape, target, k, fsdp, tp, Offload.NONE) - extra
    return room >= max(useful_kv(shape, k, tp),
                       BESIDE_MIN_KV_SHARE * _kv_room_colocated(shape, target, k, fsdp, tp, offload))


def _pick_tp(
    shape: ModelShape, target: Target, k: Knobs, fsdp: int, offloads: Sequence[Offload]
) -> tuple[int, Offload]:
    """The given TP, or the smallest whose weights plus a useful KV cache fit; with the
    least offload that lets it."""
    tps = tp_choices(shape, target, k)
    if not tps:
        raise PlanRefused(
            f"rollout: no TP among {list(k.tp_sizes)} divides {target.gpus_per_node} GPUs per node"
        )
    for tp in tps:
        for offload in offloads:
            if _kv_room_colocated(shape, target, k, fsdp, tp, offload) >= useful_kv(shape, k, tp):
                return tp, offload
    tp, offload = tps[-1], offloads[-1]
    raise PlanRefused(explain.short_kv(
        0, tp, _kv_room_colocated(shape, target, k, fsdp, tp, offload), useful_kv(shape, k, tp), k,
        (explain.judge_beside(k.judge, judge.streamed_all(k.judge.shape.num_layers)) if k.judge else "")
        + f"; lower rollout.max_tokens or use GPUs with more memory than {target.gpu_bytes / GiB:.0f} GiB"
        + ("" if k.offload is None or k.offload is Offload.ALL else ", or offload all")
        + (explain.judge_fixes(k.judge) if k.judge else "")))


def _kv_room_colocated(shape: ModelShape, target: Target, k: Knobs, fsdp: int, tp: int, offload: Offload) -> int:
    """KV bytes that fit on one GPU during rollout (beside a judge streaming every layer)."""
    total, moved = trainer_state(shape, k, fsdp, offload)
    fixed = (*context(k, tp), *vllm_fixed(shape, k, tp), *reference(shape, k, fsdp))
    least = judge.awake(k.judge, judge.streamed_all(k.judge.shape.num_layers)) if k.judge is not None else []
    return usable(target) - sum(r.bytes for r in (*fixed, *least)) - (total - moved)


def _judge_layout(k: Knobs, room: int, useful: int) -> judge.JudgeLayout | None:
    """The fewest judge layers on host that leave the rollout `ROLLOUT_KV_SHARE` of
    `room` (its KV cache beside a judge streaming every layer), and a useful cache."""
    if k.judge is None:
        return None
    options = judge.layouts(k.judge.shape.num_layers)
    for layout in options:
        if room - _judge_extra(k, layout) >= max(useful, judge.ROLLOUT_KV_SHARE * room):
            return layout
    return options[-1]


def _judge_extra(k: Knobs, layout: judge.JudgeLayout | None) -> int:
    """What the judge's `layout` holds awake beyond its least one (`_kv_room_colocated` took that)."""
    if k.judge is None or layout is None:
        return 0
    least = judge.streamed_all(k.judge.shape.num_layers)
    return sum(r.bytes for r in judge.awake(k.judge, layout)) - sum(r.bytes for r in judge.awake(k.judge, least))


def _lent_stream(target: Target, k: Knobs, tp: int, train: PhasePlan) -> tuple[Stream, tuple[int, ...]]:
    """Borrowing with HSDP: the lent half of the replicas train alone where their GPUs
    make whole replicate groups (the other ranks need not compute); else training waits
    for the round's end."""
    replicas = target.gpus // tp
    group = target.gpus // k.dp_replicate
    lent = tuple(range(target.gpus - (replicas // 2) * tp, target.gpus))
    if k.stream_mode is StreamMode.BORROW and k.dp_replicate > 1 and lent and len(lent) % group == 0 and train.fits:
        return Stream.LENT, lent
    return Stream.AFTER, ()


def _sync_phase(shape: ModelShape, target: Target, k: Knobs, fsdp: int, tp: int, sizes: Sequence[int],
                phase: Phase) -> PhasePlan:
    """vLLM's weights woken (not its KV cache), the trainer's parameter shards (what is
    gathered whole, tensor by tensor), the bucket being sent and the tensor being
    gathered. The gradients are freed; AdamW stays on the GPU, since the code offloads it
    at `before_kv`, after the push (rpk.engine.fleet's wake order). Where a replica of
    TP >= 2 holds the trainer's GPU, rank 0's IPC lane puts a copy of the bucket in flight
    on each of its other GPUs (`rpk.sync.lanes.IpcLane.send`)."""
    bucket = sync_bucket(shape, k)
    # The copy is of the bucket cast to the engine's dtype (rpk.sync.transport.CastTransport).
    peer = math.ceil(bucket * k.engine_bytes / k.master_bytes) if max(sizes) > 1 else 0
    residents = (
        *context(k, tp),
        *resting(k),
        Resident("vllm", "weights", math.ceil(shape.params * k.engine_bytes / tp)),
        *state_residents(shape, k, fsdp),
        *reference(shape, k, fsdp),
        Resident("trainer", "sync_buckets", 2 * bucket + peer),
    )
    moved = ("trainer.grads freed", "vllm.kv_cache (woken after the sync)")
    return PhasePlan(phase, tuple(range(target.gpus)), residents, moved, target.gpu_bytes)
