"""Devices on one virtual clock: the task that steps every replica (`SimEngine`) of a
simulated machine.

Replicas and nodes. Several engines (the replicas of a rollout fleet) can share one
`SimNode`: one virtual clock and one stepping task, so replicas decode side by side in
virtual time. An engine built without a node gets a node of its own. Work that is not
decoding (a weight load, a sleep, the simulated trainer's chunks) waits on the node's
clock (`SimNode.sleep_until`) without stalling the replicas that decode; with nothing
decoding the clock jumps to it. A replica on a remote machine (`call_latency_s`) pays
that much of virtual time on every `add` and `abort`: the engine host's round trip.

How it runs. Before each decision the node lets the event loop drain, so every
consumer's reaction to the last event (scoring, cancelling siblings, aborts, new
requests) lands first, as if instantaneous. Between decisions nothing can change a
replica's batch, so each replica jumps across steps in O(1): to its next step where a
sequence finishes, a delta is due (every `chunk` steps) or its KV cache fills. The node
moves the clock to the earliest such point (or a clock sleeper's deadline). A replica
touched in the middle of a step (a request added or aborted there while another replica
or a sleeper was due) keeps its completed steps and starts a fresh step then: at most
one step's time is lost per such touch. With one replica the trajectory is the one of
stepping one token at a time, only reported more coarsely.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from rpk.sim.cost import EPS, VirtualClock


class SimEngineError(RuntimeError):
    """A simulated failure of one request (`fail_after`), or the engine shut down."""


class _Due(Protocol):
    @property
    def end(self) -> float: ...


class Stepped(Protocol):
    """What a node asks of a replica it steps (`rpk.sim.engine.SimEngine`, the only one;
    a Protocol so that this module need not import it): the steps under way (`_jump`,
    None when none is planned), to plan them, to finish them, to fail its consumers."""

    closed: bool
    _jump: _Due | None

    def _schedule(self, now: float) -> None: ...

    def _complete(self) -> None: ...

    def _fail_all(self, why: str, cause: BaseException | None) -> None: ...


class SimNode:
    """Devices on one virtual clock: steps every attached engine (replica) from one
    owned task, so replicas decode side by side in virtual time.

    `settle_turns` bounds the event-loop turns the node lets consumers react before its
    next decision; where the loop's ready queue is not visible (uvloop) it always waits
    that many."""

    def __init__(self, settle_turns: int = 64) -> None:
        if settle_turns < 1:
            raise ValueError(f"SimNode needs settle_turns >= 1, got {settle_turns}")
        self.settle_turns = settle_turns
        self.clock = VirtualClock()
        self.engines: list[Stepped] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _attach(self, engine: Stepped) -> None:
        self.engines.append(engine)

    def _poke(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        elif self._task.done():
            raise SimEngineError("the engine loop has failed") from self._task.exception()
        self._wake.set()

    async def _stop_if_unused(self) -> None:
        if any(not e.closed for e in self.engines):
            return
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise SimEngineError("the engine loop had failed") from task.exception()

    async def _run(self) -> None:
        try:
            while True:
                await self._settle()
                now = self.clock.now()
                ends = []
                for engine in self.engines:
                    if engine._jump is None:
                        engine._schedule(now)
                    if engine._jump is not None:
                        ends.append(engine._jump.end)
                deadline = self.clock.next_deadline()
                if not ends and deadline is not None:
                    self.clock.advance(max(0.0, deadline - now))  # nothing decodes meanwhile
                    continue
                if not ends:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                t = min(ends) if deadline is None else min(min(ends), deadline)
                self.clock.advance(max(0.0, t - now))
                for engine in self.engines:
                    if engine._jump is not None and engine._jump.end <= t + EPS:
                        engine._complete()
        except BaseException as exc:
            # Shut down or broken: no consumer may wait forever for its next delta.
            shut = isinstance(exc, asyncio.CancelledError)
            for engine in self.engines:
                engine._fail_all("the engine shut down" if shut else "the engine loop failed",
                                 None if shut else exc)
            raise

    async def sleep_until(self, t: float) -> None:
        """Wait for virtual time `t`, decoding or not."""
        self._poke()
        await self.clock.sleep_until(t)

    async def _settle(self) -> None:
        """Yield until every other ready callback has run: the consumers have taken their
        deltas and acted on them. asyncio's ready queue is the only place that tells
        whether anything else is runnable; it is not public, hence the getattr."""
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
        for _ in range(self.settle_turns):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                return
