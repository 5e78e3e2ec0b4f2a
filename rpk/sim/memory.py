"""Simulated GPU memory: each device's capacity, and the allocations and frees that the
real choreography makes, with the sizes the memory plan (`rpk.gpu.plan`) gives.

`GpuMemory` is a ledger per device; a hold past a device's capacity raises `OverCommit`
naming the phase, the device and what it holds. `watch` wires it to a simulated fleet
and trainer driven by the real loop (`run_step`, `Fleet.rest`, regroups, borrowing):
vLLM's weights and KV cache come and go with the replicas' sleep and wake calls, the
trainer's state with its offloads, first micro-batch and checkpoint saves, its training
memory with each accumulate call.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rpk.core.modes import Offload, RestLevel
from rpk.gpu.plan import HEADROOM_FRAC, MemoryPlan, Phase, Stream
from rpk.gpu.plan.pricing import offloaded_names


class OverCommit(RuntimeError):
    """A device was asked for more memory than it has; the message names the phase."""


@dataclass(slots=True)
class GpuMemory:
    capacity: int  # bytes per device (after the plan's headroom)
    devices: int
    held: list[dict[str, int]] = field(default_factory=list)  # per device: resident -> bytes
    peak: list[int] = field(default_factory=list)
    log: list[tuple[str, str, int]] = field(default_factory=list)  # (phase, what, device)

    def __post_init__(self) -> None:
        self.held = [{} for _ in range(self.devices)]
        self.peak = [0] * self.devices

    def used(self, device: int) -> int:
        return sum(self.held[device].values())

    def hold(self, phase: str, what: str, nbytes: int, devices: Iterable[int]) -> None:
        for d in devices:
            if what in self.held[d]:
                continue
            if self.used(d) + nbytes > self.capacity:
                top = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in sorted(self.held[d].items()))
                raise OverCommit(
                    f"{phase} phase, GPU {d}: {what} ({nbytes / 2**30:.1f} GiB) does not fit "
                    f"beside {top} GiB in {self.capacity / 2**30:.1f} GiB"
                )
            self.held[d][what] = nbytes
            self.peak[d] = max(self.peak[d], self.used(d))
            self.log.append((phase, "+" + what, d))

    def free(self, phase: str, what: str, devices: Iterable[int]) -> None:
        for d in devices:
            if self.held[d].pop(what, None) is not None:
                self.log.append((phase, "-" + what, d))


def _bytes(plan: MemoryPlan, phase: Phase, owner: str, name: str) -> int:
    for p in plan.phases:
        if p.phase is phase and (b := p.bytes_of(owner, name)):
            return b
    return 0


def watch(ledger: GpuMemory, plan: MemoryPlan, fleet: Any, trainer: Any) -> None:
    """Wrap the replicas of every layout of `fleet` and the simulated `trainer` so that
    their calls hold and free the plan's bytes on their devices."""
    gpus = range(plan.target.gpus)
    for layout in fleet.layouts.all:
        per = plan.target.gpus // len(layout.replicas)
        for i, replica in enumerate(layout.replicas):
            _watch_replica(ledger, plan, replica, tuple(range(i * per, (i + 1) * per)), layout.tp)
        if layout is fleet.layouts.awake:
            for i in range(len(layout.replicas)):
                devs = tuple(range(i * per, (i + 1) * per))
                ledger.hold("rollout", f"vllm.tp{layout.tp}.weights", _weights(plan, layout.tp), devs)
                ledger.hold("rollout", f"vllm.tp{layout.tp}.kv_cache", plan.kv_cache_bytes, devs)
    ledger.hold("rollout", "contexts", 2 * _bytes(plan, Phase.ROLLOUT, "vllm", "context"), gpus)
    ledger.hold("rollout", "vllm.reserve", _bytes(plan, Phase.ROLLOUT, "vllm", "reserve"), gpus)
    _watch_trainer(ledger, plan, fleet, trainer, gpus)


def _weights(plan: MemoryPlan, tp: int) -> int:
    return -(-plan.shape.params * plan.knobs.engine_bytes // tp)


def _watch_replica(ledger: GpuMemory, plan: MemoryPlan, replica: Any, devs: Sequence[int], tp: int) -> None:
    sleep, wake = replica.sleep, replica.wake
    weights, kv = f"vllm.tp{tp}.weights", f"vllm.tp{tp}.kv_cache"

    @functools.wraps(sleep)
    async def sleeping(level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
        await sleep(level)
        # Level 1 moves the weights to host, level 2 drops them: either way off the GPU.
        ledger.free("train", weights, devs)
        ledger.free("train", kv, devs)

    @functools.wraps(wake)
    async def waking(tags: Sequence[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            ledger.hold("sync" if tags else "regroup", weights, _weights(plan, tp), devs)
        if tags is None or "kv_cache" in tags:
            ledger.hold("rollout", kv, plan.kv_cache_bytes, devs)
        await wake(tags)

    replica.sleep, replica.wake = sleeping, waking


def _watch_trainer(ledger: GpuMemory, plan: MemoryPlan, fleet: Any, trainer: Any, gpus: range) -> None:
    state = {name: _bytes(plan, Phase.TRAIN, "trainer", name) for name in ("params", "adamw")}
    grads = next(r for p in plan.phases if p.phase is Phase.TRAIN
                 for r in p.residents if r.name.startswith("grads"))
    working = sum(_bytes(plan, Phase.TRAIN, "trainer", n)
                  for n in ("fsdp_gathered", "activations", "logprob_head"))
    for name, nbytes in state.items():
        if name not in offloaded_names(plan.knobs, plan.offload):  # moved out before vLLM started
            ledger.hold("rollout", f"trainer.{name}", nbytes, gpus)
    accumulate, finish, save = trainer.accumulate, trainer.finish_step, trainer.save

    def phase() -> str:
        return "train" if getattr(fleet, "resting", None) else "stream"

    def restore() -> None:
        for name, nbytes in state.items():
            ledger.hold(phase(), f"trainer.{name}", nbytes, gpus)
        ledger.hold(phase(), "trainer." + grads.name, grads.bytes, gpus)

    async def accumulating(samples: Any) -> Any:
        # Streamed beside the tail on lent replicas' devices, only those compute.
        on = plan.stream_gpus if phase() == "stream" and plan.stream is Stream.LENT else gpus
        restore()
        ledger.hold(phase(), "trainer.working", working, on)
        try:
            return await accumulate(samples)
        finally:
            ledger.free(phase(), "trainer.working", on)

    async def finishing() -> Any:
        restore()
        return await finish()

    async def saving(directory: Any) -> Any:
        # A save gathers the weights and writes the optimizer's shards: the whole state
        # comes back onto the devices, until the next offload moves it out again.
        for name, nbytes in state.items():
            ledger.hold("checkpoint", f"trainer.{name}", nbytes, gpus)
        return await save(directory)

    async def offloading(what: Offload) -> None:
        ledger.free("sync", "trainer." + grads.name, gpus)
        for name in offloaded_names(plan.knobs, what):
            ledger.free("sync", f"trainer.{name}", gpus)
        trainer.offloads.append(what)

    trainer.accumulate, trainer.finish_step, trainer.offload = accumulating, finishing, offloading
    trainer.save = saving
    trainer.offloads = []


def capacity_of(plan: MemoryPlan) -> int:
    """A device's memory as the plan counts it: less the allocator's headroom."""
    return int(plan.target.gpu_bytes * (1 - HEADROOM_FRAC))
