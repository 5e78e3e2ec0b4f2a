"""A rollout fleet on virtual time: `SimEngine` replicas on one `SimNode` (one virtual
clock), laid out over the devices like the real fleet (`rpk.engine.placement`), driven
by the real `Fleet`, `Router` and layouts. The devices may span `nodes` machines of
equal size: a replica on any machine but the first (where the controller and the
engine host run) pays `host_latency_s` per call to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Callable, Collection, Mapping, Sequence

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.outcomes import MigrationReport
from rpk.core.protocols import WeightBucket
from rpk.core.records import GenRequest
from rpk.engine.fleet import Fleet
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.engine.placement import plan_layouts
from rpk.sim.cost import CostModel
from rpk.sim.engine import SimEngine
from rpk.sim.node import SimNode
from rpk.sim.spec import SimSpec


class SimTransport:
    """Reads the buckets once; every replica then loads, side by side (`sync_s` each)."""

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[SimEngine], version: int
    ) -> None:
        async for _ in buckets:
            pass
        await asyncio.gather(*(r.load_weights(version) for r in replicas))

    async def close(self) -> None:
        """Nothing to end: a simulated sync holds nothing open."""


async def sim_fleet(
    length_of: Callable[[GenRequest], int],
    *,
    cost: CostModel,
    devices: int,
    tp_sizes: Sequence[int],
    tp: int,
    max_num_seqs: int,
    chunk: int = 16,
    node: SimNode | None = None,
    fail_after: Callable[[str, GenRequest], int | None] | None = None,
    nodes: int = 1,
    host_latency_s: float = 0.0,
    spec: SimSpec | None = None,
) -> Fleet:
    """Layouts of every size in `tp_sizes` over `devices` devices, the one of `tp`
    awake and the others put to sleep. A replica of TP t runs up to t * max_num_seqs
    requests (the real fleet's rule). `fail_after(replica_name, request)`: as
    `SimEngine.fail_after`, per replica. `spec`: every replica speculates, each drawing
    from its own seed."""
    if nodes < 1 or devices % nodes:
        raise ValueError(f"{devices} devices do not split over {nodes} nodes")
    per_node = devices // nodes
    node = node or SimNode()
    layouts = []
    made = 0
    for size, places in plan_layouts(range(devices), tp_sizes).items():
        replicas = [
            SimEngine(
                length_of, cost=cost, max_concurrency=max_num_seqs * size, chunk=chunk,
                tp=size, node=node,
                call_latency_s=host_latency_s if p.devices[0] >= per_node else 0.0,
                fail_after=(lambda r, n=p.name: fail_after(n, r)) if fail_after else None,
                spec=spec.for_replica(made + i) if spec is not None else None,
            )
            for i, p in enumerate(places)
        ]
        made += len(places)
        layouts.append(Layout(size, tuple(p.name for p in places), replicas, LayoutState.AWAKE))
    for layout in layouts:
        if layout.tp != tp:
            await asyncio.gather(*(r.sleep() for r in layout.replicas))
            layout.move(LayoutState.ASLEEP)
    return Fleet(Layouts(layouts), SimTransport(), version=0, clock=node.clock)


class SoloFleet:
    """One replica as the fleet the speculative tail drives (`rpk.core.protocols.
    Speculating`), for a run on a bare `SimEngine`."""

    def __init__(self, engine: SimEngine, name: str = "sim") -> None:
        self.engine = engine
        self.name = name

    def draft_targets(self) -> dict[str, int]:
        return {self.name: self.engine.max_concurrency}

    async def set_drafts(self, schedules: Mapping[str, Sequence[tuple[int, int, int]]],
                         sources: Sequence[DraftSource], prompts: Sequence[PromptDrafts]) -> None:
        if self.name in schedules:
            await self.engine.set_drafts(schedules[self.name], sources, prompts)

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        await self.engine.add_drafts(prompts)

    async def take_spec_stats(self) -> dict[str, SpecStats]:
        return {self.name: await self.engine.take_spec_stats()}

    def tail_rows(self, at: int) -> None:
        return None  # no plain twin to hand the tail over from

    async def hand_over(self, request_ids: Collection[str]) -> MigrationReport:
        return MigrationReport(())
