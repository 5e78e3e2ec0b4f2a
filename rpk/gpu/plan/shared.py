"""The plan as a record, and what the colocated and the split layout build alike: the
TP search's candidates, vLLM's share of a GPU, the training row (deferred reduction where
it fits) and the host rows (each node at its worst moment)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rpk.gpu.plan.pricing import PCIE_BYTES_PER_S, HostPlan, Phase, PhasePlan, tp_candidates, trainer_state
from rpk.gpu.shape import PlanRefused

# Types the record and the helpers only annotate with; the layouts compute with them.
if TYPE_CHECKING:
    from rpk.core.modes import Offload, RestLevel
    from rpk.gpu.plan.judge import JudgeLayout
    from rpk.gpu.plan.pricing import Knobs, Resident, Stream
    from rpk.gpu.shape import ModelShape, Target


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
    rest_level: RestLevel | None  # vLLM's sleep while the trainer runs; None: it never sleeps
    stream: Stream
    stream_gpus: tuple[int, ...]
    kv_cache_bytes: int  # per GPU, the awake layout
    gpu_memory_utilization: float
    phases: tuple[PhasePlan, ...] = field(default=())
    host: tuple[HostPlan, ...] = ()  # a row per node
    judge: JudgeLayout | None = None  # the colocated judge's layers: how many stream from host

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
        return trainer_state(self.shape, self.knobs, self.fsdp, self.offload)[1]


def tp_choices(shape: ModelShape, target: Target, k: Knobs) -> list[int]:
    """The TPs the search tries, smallest first: the given one, else those that split the
    heads within a node, among the configured layouts where there are any."""
    return [k.tp] if k.tp else [t for t in tp_candidates(target, shape) if not k.tp_sizes or t in k.tp_sizes]


def vllm_share(target: Target, fixed: Sequence[Resident], room: int) -> tuple[float, int]:
    """(`gpu_memory_utilization`, KV bytes): vLLM is given a fraction of the GPU (three
    decimals); the KV cache is what that fraction leaves once its weights and reserve are in."""
    base = sum(r.bytes for r in fixed)
    util = math.floor((base + room) / target.gpu_bytes * 1000) / 1000
    return util, int(util * target.gpu_bytes) - base


def train_row(
    target: Target, k: Knobs, gpus: tuple[int, ...], residents: Callable[[bool], Sequence[Resident]],
    moved_out: tuple[str, ...],
) -> tuple[PhasePlan, bool]:
    """The trainer on one micro-batch, with deferred reduction where it fits (or as the
    knobs say); where nothing fits, the last option's row."""
    options = [k.defer_reduction] if k.defer_reduction is not None else [True, False]
    row = None
    for defer in options:
        row = PhasePlan(Phase.TRAIN, gpus, tuple(residents(defer)), moved_out, target.gpu_bytes)
        if row.fits:
            return row, defer
    assert row is not None
    return row, options[-1]


def host_rows(target: Target, moments: Callable[[int], Mapping[str, Sequence[Resident]]]) -> tuple[HostPlan, ...]:
    """Each node's row at its worst moment (`moments(node)`: the moments it goes through)."""
    rows = []
    for node in range(target.nodes):
        moment, residents = max(moments(node).items(), key=lambda m: sum(r.bytes for r in m[1]))
        rows.append(HostPlan(node, moment, tuple(residents), target.host_bytes))
    return tuple(rows)


def check_dp(k: Knobs, gpus: int, where: str) -> int:
    """The FSDP degree over `gpus` trainer GPUs, or refused where HSDP does not divide them."""
    if gpus % k.dp_replicate:
        raise PlanRefused(f"dist.dp_replicate={k.dp_replicate} does not divide {where}")
    return gpus // k.dp_replicate


def first_over(plan: MemoryPlan) -> PhasePlan | None:
    return next((p for p in plan.phases if not p.fits), None)
