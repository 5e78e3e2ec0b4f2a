"""Layouts: sets of replicas that each cover the rollout devices at one TP size (TP 1, 2
and 4 on 8 devices: 8, 4 and 2 replicas). The layouts a planner may use are started
once; one is awake, the others asleep (vLLM's level-2 sleep on GPU: weights dropped, KV
cache freed; on CPU vLLM's sleep frees nothing, so there the layouts coexist in memory
and switching is routing plus a weight sync).

Where sleeping layouts do not fit beside the awake one, restart-on-switch stops the
awake layout's replicas and starts the target's anew (`relaunch`).

`Layouts.switch` changes which layout is awake; the fleet then brings the woken
replicas' weights up to date and routes to them (`Fleet.regroup`).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from rpk.core.records import IllegalTransition
from rpk.engine.replica import Replica


class LayoutState(enum.Enum):
    AWAKE = "awake"  # serving
    ASLEEP = "asleep"  # started, sleeping: woken in seconds
    STOPPED = "stopped"  # not running (restart-on-switch): started again to wake

    def can_become(self, new: LayoutState) -> bool:
        return new in _LAYOUT_MOVES[self]


_LAYOUT_MOVES: dict[LayoutState, frozenset[LayoutState]] = {
    LayoutState.AWAKE: frozenset({LayoutState.ASLEEP, LayoutState.STOPPED}),
    LayoutState.ASLEEP: frozenset({LayoutState.AWAKE, LayoutState.STOPPED}),
    LayoutState.STOPPED: frozenset({LayoutState.AWAKE}),
}

# Starts the replicas of the layout of a TP size (restart-on-switch).
Relaunch = Callable[[int], Awaitable[Sequence[Replica]]]


@dataclass(eq=False, slots=True)
class Layout:
    tp: int
    names: tuple[str, ...]  # one per replica, e.g. "tp2.0"
    replicas: list[Replica]  # empty while stopped
    state: LayoutState

    def move(self, new: LayoutState) -> None:
        if not self.state.can_become(new):
            raise IllegalTransition(f"layout tp{self.tp}: {self.state.value} -> {new.value}")
        self.state = new


class Layouts:
    """The layouts of a fleet, exactly one awake."""

    def __init__(self, layouts: Sequence[Layout], relaunch: Relaunch | None = None) -> None:
        self._by_tp = {layout.tp: layout for layout in layouts}
        if len(self._by_tp) != len(layouts):
            raise ValueError(f"one layout per TP size, got {[layout.tp for layout in layouts]}")
        awake = [layout.tp for layout in layouts if layout.state is LayoutState.AWAKE]
        if len(awake) != 1:
            raise ValueError(f"exactly one layout must be awake, got tp {awake}")
        for layout in layouts:
            running = layout.state is not LayoutState.STOPPED
            if running != bool(layout.replicas) or (running and len(layout.replicas) != len(layout.names)):
                raise ValueError(f"layout tp{layout.tp} is {layout.state.value} with "
                                 f"{len(layout.replicas)} of {len(layout.names)} replicas")
        if relaunch is None and any(layout.state is LayoutState.STOPPED for layout in layouts):
            raise ValueError("stopped layouts need a relaunch")
        self._awake = self._by_tp[awake[0]]
        self.relaunch = relaunch

    @property
    def awake(self) -> Layout:
        return self._awake

    @property
    def all(self) -> tuple[Layout, ...]:
        return tuple(self._by_tp[tp] for tp in sorted(self._by_tp))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._by_tp))

    async def switch(self, tp: int, wake: bool = True) -> tuple[Layout, bool]:
        """Make the layout of `tp` the awake one; whether it had to be started anew.
        Nothing may be running on the awake layout. `wake=False`: the caller wakes the
        target's replicas (in parts, around a weight sync: colocation); a layout already
        resting is not put to sleep again."""
        if tp not in self._by_tp:
            raise ValueError(f"no layout of tp {tp}; built: {self.sizes}")
        current, target = self._awake, self._by_tp[tp]
        if target is current:
            return target, False
        if self.relaunch is None:
            if wake:
                await asyncio.gather(*(r.sleep() for r in current.replicas))
            current.move(LayoutState.ASLEEP)
        else:
            await _shutdown_all(current.replicas)
            current.replicas = []
            current.move(LayoutState.STOPPED)
        restarted = target.state is LayoutState.STOPPED
        if restarted:
            assert self.relaunch is not None
            target.replicas = list(await self.relaunch(tp))
        elif wake:
            await asyncio.gather(*(r.wake() for r in target.replicas))
        target.move(LayoutState.AWAKE)
        self._awake = target
        return target, restarted

    async def shutdown(self) -> None:
        """Stop every replica of every layout (all are tried; the first error is raised)."""
        replicas = [r for layout in self._by_tp.values() for r in layout.replicas]
        await _shutdown_all(replicas)


async def _shutdown_all(replicas: Sequence[Replica]) -> None:
    results = await asyncio.gather(*(r.shutdown() for r in replicas), return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    if errors:
        raise errors[0]
