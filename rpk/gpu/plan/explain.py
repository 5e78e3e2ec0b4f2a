"""The plan told: its tables and JSON, and the one-line refusals with the changes that
would fit. Each suggested change is checked by planning again with it: the caller hands
in `fits` (does the plan fit with these inputs) and `fitting` (the plan where its GPUs
fit, host rows unchecked), so this module does no arithmetic of its own."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rpk.core.modes import Offload
from rpk.gpu.plan import judge
from rpk.gpu.plan.judge import JudgeLayout
from rpk.gpu.plan.pricing import (
    HEADROOM_FRAC,
    HOST_HEADROOM_FRAC,
    LIGHTER,
    PROCESS_BYTES,
    USEFUL_SEQS,
    GiB,
    HostPlan,
    JudgeKnobs,
    Knobs,
    PhasePlan,
    Resident,
)
from rpk.gpu.plan.shared import MemoryPlan
from rpk.gpu.shape import ModelShape, Target

Fits = Callable[[ModelShape, Target, Knobs], bool]
Fitting = Callable[[ModelShape, Target, Knobs], MemoryPlan | None]


def as_dict(plan: MemoryPlan) -> dict[str, Any]:
    return {
        "model_params": plan.shape.params,
        "gpus": plan.target.gpus,
        "gpu_gb": round(plan.target.gpu_bytes / 1e9, 1),
        "rollout_tp": plan.tp,
        "tp_sizes": list(plan.tp_sizes),
        "replicas": len(plan.phases[0].gpus) // plan.tp if plan.phases else plan.target.gpus // plan.tp,
        "fsdp": plan.fsdp,
        "dp_replicate": plan.knobs.dp_replicate,
        "offload_during_rollout": plan.offload.value,
        "offload_gb_per_gpu": round(plan.offloaded_bytes / 1e9, 2),
        "offload_s_each_way": round(plan.offload_s, 2),
        "defer_reduction": plan.defer_reduction,
        "activation_checkpointing": plan.knobs.activation_checkpointing,
        "train_sleep_level": int(plan.rest_level or 0),  # 0: vLLM never sleeps
        "stream": plan.stream.value,
        "stream_gpus": list(plan.stream_gpus),
        "kv_cache_gb_per_gpu": round(plan.kv_cache_bytes / 1e9, 2),
        "kv_tokens_per_replica": plan.kv_tokens_per_replica,
        "gpu_memory_utilization": plan.gpu_memory_utilization,
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
            for p in plan.phases
        ],
        "host": [  # GB per node; available and fits None: the RAM is unknown
            {"node": h.node, "moment": h.moment, "needed_gb": round(h.total / 1e9, 2),
             "available_gb": round(h.capacity / 1e9, 2) if h.capacity else None,
             "fits": h.fits if h.capacity else None,
             "residents_gb": {f"{r.owner}.{r.name}": round(r.bytes / 1e9, 2) for r in h.residents}}
            for h in plan.host
        ],
        **({"judge": judge_dict(plan)} if plan.judge is not None else {}),
    }


def judge_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The colocated judge: its layers on host, its KV cache, and its engine's arguments."""
    j, layout = plan.knobs.judge, plan.judge
    assert j is not None and layout is not None
    layers = j.shape.num_layers
    return {
        "model_params": j.shape.params,
        "replicas_per_node": plan.target.gpus_per_node,
        "layers": layers,
        "offloaded_layers": layout.offloaded(layers),
        "resident_gb": round(judge.resident_bytes(j, layout) / 1e9, 2),
        "kv_cache_gb": round(judge.kv_bytes(j) / 1e9, 2),
        "engine_args": {
            "max_model_len": j.max_model_len, "max_num_seqs": j.max_num_seqs, "tensor_parallel_size": 1,
            "gpu_memory_utilization": judge.gpu_memory_utilization(j, layout, plan.target.gpu_bytes),
            "enable_sleep_mode": True, **layout.engine_args(),
        },
    }


def table(plan: MemoryPlan) -> str:
    """The plan as tables: a row per phase, a column per resident (GB per GPU); then,
    where the nodes' RAM is known, a row per node (GB per node)."""
    lines = [(
        f"memory plan (GB per GPU): {plan.shape.params / 1e9:.2f}B params, {plan.target.gpus} GPUs, "
        f"rollout TP {plan.tp}, FSDP {plan.fsdp}, offload {plan.offload.value}, "
        f"KV {plan.kv_tokens_per_replica} tokens/replica, gpu_memory_utilization "
        f"{plan.gpu_memory_utilization}, stream {plan.stream.value}"
    )]
    if plan.judge is not None and plan.knobs.judge is not None:
        layers = plan.knobs.judge.shape.num_layers
        lines.append(f"judge on every GPU: {plan.judge.offloaded(layers)} of {layers} layers streamed from host "
                     f"(prefetch offload {plan.judge.engine_args() or 'off'})")
    lines += _grid(["phase", "gpus"], [
        ([p.phase.value, _ranges(p.gpus)], p.residents, f"{p.capacity / 1e9:.0f}") for p in plan.phases
    ])
    if plan.host and plan.target.host_bytes:
        lines.append(f"host RAM (GB per node, {HOST_HEADROOM_FRAC:.0%} kept free):")
        lines += _grid(["node", "moment"], [
            ([str(h.node), h.moment], h.residents, f"{h.capacity / 1e9:.0f}") for h in plan.host
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


def _largest(residents: Sequence[Resident], scale: float, unit: str) -> str:
    biggest = max(residents, key=lambda r: r.bytes)
    return f"largest: {biggest.owner}.{biggest.name} {biggest.bytes / scale:.1f} {unit}"


def gpu_refusal(p: PhasePlan, gpu: str, over: bool, then: str) -> str:
    """One line: the phase, the GPU (`gpu`: how it is named), what it needs of what it has,
    its largest resident, then `then` (what else to say and what to change)."""
    excess = f"{(p.total - p.capacity * (1 - HEADROOM_FRAC)) / GiB:.1f} GiB over; " if over else ""
    return (
        f"{p.phase.value} phase, {gpu} {p.gpus[0]}: needs {p.total / GiB:.1f} GiB of "
        f"{p.capacity / GiB:.0f} GiB ({excess}{_largest(p.residents, GiB, 'GiB')}){then}"
    )


def host_refusal(h: HostPlan, fixes: Sequence[str]) -> str:
    """One line: host, the node, the moment, the bytes needed and there, and each change."""
    return (
        f"host, node {h.node}: needs {h.total / 1e9:.1f} GB of RAM at {h.moment}, the node has "
        f"{h.capacity / 1e9:.1f} GB ({h.capacity * (1 - HOST_HEADROOM_FRAC) / 1e9:.1f} GB usable, "
        f"{HOST_HEADROOM_FRAC:.0%} kept free; {_largest(h.residents, 1e9, 'GB')}); " + " or ".join(fixes)
    )


def short_kv(gpu: int, tp: int, room: int, useful: int, k: Knobs, then: str) -> str:
    """The rollout's refusal: no TP gives the KV cache USEFUL_SEQS full-length sequences."""
    return (
        f"rollout, GPU {gpu}: at TP {tp} the KV cache gets {max(room, 0) / GiB:.1f} GiB, less than "
        f"{USEFUL_SEQS} sequences of rollout.max_model_len={k.max_model_len} ({useful / GiB:.1f} GiB){then}"
    )


def judge_beside(j: JudgeKnobs, least: JudgeLayout) -> str:
    """What the refusal adds where a judge shares the GPU: its least footprint."""
    held = PROCESS_BYTES + sum(r.bytes for r in judge.awake(j, least))
    return f", beside a judge holding {held / GiB:.1f} GiB with every layer streamed from host"


def judge_fixes(j: JudgeKnobs) -> str:
    return (f", or lower reward.judge.max_concurrency or reward.judge.max_response_chars (the judge's "
            f"KV cache: {judge.kv_bytes(j) / GiB:.1f} GiB for {j.max_num_seqs} inputs of {j.max_model_len} "
            f"tokens), or judge with a smaller model")


def host_ram_needed(plans: Sequence[MemoryPlan]) -> list[tuple[int, Offload]]:
    """For each plan: the least RAM per node (GB) that holds its worst row, and its offload."""
    return [(math.ceil(max(h.total for h in p.host) / (1 - HOST_HEADROOM_FRAC) / 1e9), p.offload) for p in plans]


def host_fixes(plan: MemoryPlan, fits: Fits, fitting: Fitting) -> list[str]:
    k, t = plan.knobs, plan.target
    lighter = [o for o in LIGHTER[k.offload] if fits(plan.shape, t, replace(k, offload=o))] if k.offload else []
    fixes = [f"--train.offload {o.value}" for o in lighter[:1]] + more_nodes(plan, fits)
    # The least RAM that fits: with the plan's offload, or a lighter one it would take.
    options = [k] if k.offload is not None else [replace(k, offload=o) for o in (plan.offload, *LIGHTER[plan.offload])]
    plans = [p for p in (fitting(plan.shape, t, o) for o in options) if p is not None]
    for gb, offload in sorted(host_ram_needed(plans), key=lambda n: n[0]):
        if fits(plan.shape, replace(t, host_bytes=gb * 10**9), k):
            then = f" (offload {offload.value} then)" if offload is not plan.offload else ""
            fixes.append(f"nodes with {gb} GB of RAM or more{then}")
            break
    return fixes


def more_nodes(plan: MemoryPlan, fits: Fits) -> list[str]:
    """The fewest nodes (up to 8 times as many) on which the plan fits, FSDP over all."""
    t, k = plan.target, replace(plan.knobs, dp_replicate=1)
    more = next((replace(t, nodes=n) for n in range(t.nodes + 1, 8 * t.nodes + 1)
                 if fits(plan.shape, replace(t, nodes=n), k)), None)
    if more is None:
        return []
    return [f"{more.gpus} GPUs ({more.nodes} nodes of {t.gpus_per_node}): FSDP divides the trainer state"]


def fixes(plan: MemoryPlan, fits: Fits) -> list[str]:
    k, t = plan.knobs, plan.target

    def ok(knobs: Knobs = k) -> bool:
        return fits(plan.shape, t, knobs)

    out = []
    if k.micro_batch_tokens > k.max_model_len and ok(replace(k, micro_batch_tokens=k.max_model_len)):
        out.append(f"--train.micro_batch_tokens {k.max_model_len}")
    if not k.activation_checkpointing and ok(replace(k, activation_checkpointing=True)):
        out.append("--train.activation_checkpointing true")
    if k.defer_reduction and ok(replace(k, defer_reduction=False)):
        out.append("--train.defer_reduction false")
    if k.offload not in (None, Offload.ALL) and ok(replace(k, offload=Offload.ALL)):
        out.append("offload all (unset the offload choice)")
    half = k.max_model_len // 2
    short = replace(k, max_model_len=half, micro_batch_tokens=min(k.micro_batch_tokens, half))
    if k.max_model_len >= 2048 and ok(short):
        out.append(f"--rollout.max_tokens below {short.max_model_len}")
    out += more_nodes(plan, fits)
    return out or [f"GPUs with more than {t.gpu_bytes / GiB:.0f} GiB"]
