"""Which devices each rollout replica gets: pure arithmetic over device ids and TP sizes.

A layout covers the rollout's devices with replicas of one TP size, each replica a
contiguous group of `tp` devices (a TP group stays inside one node, where neighbouring
device ids share the fastest links). `plan_layouts` is the one entry point; a process
launcher that knows its node's devices calls it the same way as `rpk.assembly` does.

On CPU the devices are cores. What a replica's processes must be told to stay on their
devices is `device_env`: vLLM reads it from the environment when the replica starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Platform = Literal["cpu", "cuda"]


class PlacementError(ValueError):
    """Devices and TP sizes that do not make layouts; the message names the value, and
    `field` which choice it is about (`devices`, `tp_sizes` or `tp`)."""

    def __init__(self, message: str, field: str = "tp_sizes") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ReplicaPlace:
    tp: int
    index: int  # within its layout
    devices: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"tp{self.tp}.{self.index}"


def plan_layouts(
    devices: Sequence[int], tp_sizes: Sequence[int]
) -> dict[int, tuple[ReplicaPlace, ...]]:
    """For each TP size, its replicas over `devices` (in the order given)."""
    if not devices:
        raise PlacementError("no rollout devices", "devices")
    if len(set(devices)) != len(devices) or any(d < 0 for d in devices):
        raise PlacementError(f"devices {tuple(devices)} must be distinct ids >= 0", "devices")
    if not tp_sizes:
        raise PlacementError("no TP sizes")
    plans: dict[int, tuple[ReplicaPlace, ...]] = {}
    for tp in tp_sizes:
        if tp < 1 or len(devices) % tp:
            raise PlacementError(f"tp={tp} does not divide {len(devices)} rollout devices")
        plans[tp] = tuple(
            ReplicaPlace(tp, i, tuple(devices[i * tp : (i + 1) * tp]))
            for i in range(len(devices) // tp)
        )
    return dict(sorted(plans.items()))


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """The rollout's devices, the layouts built over them, and the one awake first."""

    devices: tuple[int, ...]
    tp_sizes: tuple[int, ...]  # ascending
    tp: int
    pinned: bool  # replicas started on their devices (`device_env`)

    def layouts(self) -> dict[int, tuple[ReplicaPlace, ...]]:
        return plan_layouts(self.devices, self.tp_sizes)


def fleet_plan(
    devices: Sequence[int], tp_sizes: Sequence[int], tp: int, elastic: bool
) -> FleetPlan:
    """Layouts from the config's choices. No `tp_sizes`: `tp` alone when fixed; when
    elastic, the powers of two up to the device count (2 without `devices`). No
    `devices`: the first max(tp_sizes) devices, and a fleet of a single TP-1 replica is
    left unpinned (rpk's default engine, where the OS puts it)."""
    if tp < 1:
        raise PlacementError(f"tp={tp} must be >= 1", "tp")
    if not tp_sizes:
        if elastic:
            top = len(devices) if devices else 2
            tp_sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
        else:
            tp_sizes = [tp]
    sizes = tuple(sorted(set(tp_sizes)))
    if tp not in sizes:
        raise PlacementError(f"tp={tp} is not among the layouts {sizes}", "tp")
    if elastic and len(sizes) < 2:
        raise PlacementError(f"elastic TP needs two layouts or more, got {sizes}")
    explicit = bool(devices)
    devs = tuple(devices) if explicit else tuple(range(max(sizes)))
    plan = FleetPlan(devs, sizes, tp, pinned=explicit or len(devs) > 1)
    plan.layouts()  # checks that every size divides the devices
    return plan


_REPLICA_NAME = re.compile(r"(?:n(\d+)\.)?tp(\d+)\.(\d+)")


def replica_devices(name: str, plan: FleetPlan) -> list[tuple[int, int]]:
    """The (node, device) pairs of the replica named `name` (`tp2.1`, or `n1.tp2.1` on
    node 1 of several): every node lays the plan's layouts over the same device ids."""
    m = _REPLICA_NAME.fullmatch(name)
    places = plan.layouts()
    if m is None or int(m[2]) not in places or int(m[3]) >= len(places[int(m[2])]):
        raise PlacementError(f"replica {name!r} is not in the layouts {tuple(places)}")
    node = int(m[1] or 0)
    return [(node, d) for d in places[int(m[2])][int(m[3])].devices]


def device_env(place: ReplicaPlace, platform: Platform, visible: str | None = None) -> Mapping[str, str | None]:
    """Environment a replica is started with (None: unset) so that its processes stay
    on its devices.

    - CPU, TP 1: vLLM's engine core holds the model worker (no multiprocessing), and
      ignores `VLLM_CPU_OMP_THREADS_BIND` there; libgomp's `GOMP_CPU_AFFINITY` pins
      every OpenMP thread of that process to the core.
    - CPU, TP > 1: vLLM starts one worker per rank and binds rank i's threads to the
      i-th entry of `VLLM_CPU_OMP_THREADS_BIND` (its `auto` needs a NUMA node per rank).
    - CUDA: `CUDA_VISIBLE_DEVICES`; the replica's ranks take its devices in order. The
      plan's ids are this process's device indices (the trainer's rank k is on index k).
      Under a mask the launcher already set (`visible`: a SLURM partial node,
      `CUDA_VISIBLE_DEVICES=4,5,6,7`), index k is the mask's k-th entry, and a new
      process given the bare index would land on another physical GPU.
    """
    ids = [str(d) for d in place.devices]
    if platform == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(_through_mask(place, visible))}
    if place.tp > 1:
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(ids), "GOMP_CPU_AFFINITY": None}
    return {"GOMP_CPU_AFFINITY": ids[0], "VLLM_CPU_OMP_THREADS_BIND": None}


def _through_mask(place: ReplicaPlace, visible: str | None) -> list[str]:
    ids = [str(d) for d in place.devices]
    if not visible or not visible.strip():
        return ids
    # Entries may be indices, UUIDs (GPU-...) or MIG ids; they are passed on as written.
    mask = [e.strip() for e in visible.split(",") if e.strip()]
    short = [d for d in place.devices if d >= len(mask)]
    if short:
        raise PlacementError(
            f"replica {place.name} is on devices {list(place.devices)}, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} shows {len(mask)} GPUs", field="devices")
    return [mask[d] for d in place.devices]
