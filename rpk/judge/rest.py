"""The judge's rest while the trainer trains: the plan's rest.

Colocated, the rollout replicas sleep so that the trainer has their GPUs
(`rpk.engine.fleet.Fleet.rest`), and the judge engines beside them sleep with them
(`FleetAndJudge`). A judge always sleeps at level 1 (`RestLevel.KEEP_WEIGHTS`: its
weights backed up to host memory, its KV cache dropped), whatever the fleet's level,
as the memory plan prices it: its weights never change, so dropping them (level 2) would
only reload the same weights from disk every step; and with vLLM's prefetch offload
(the judge's streamed layers) the reload leaves the shared layer buffer holding another
layer's weights, so the first verdict after each wake would be computed wrong, silently
(../shared/GPU-AUDIT-2.md M1).

A judge wakes when it is next asked (`EngineRest.wake`, through the scorer's `ready`,
outside a verdict's timeout), after the fleet's KV cache is back: its share was planned
beside it. A rest that comes while a wake is in flight waits for it and then sleeps. vLLM's
CPU worker has no sleep mode: a judge started without it keeps its memory, and resting
says so once.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from rpk.core.modes import RestLevel
from rpk.core.protocols import Resting
from rpk.reward.judge import JudgeEngine, JudgeScorer

# The one level a judge sleeps at (see the module docstring).
JUDGE_REST = RestLevel.KEEP_WEIGHTS


class RestState(enum.Enum):
    AWAKE = "awake"
    ASLEEP = "asleep"


class EngineRest:
    """A judge engine's side of resting (`llm`: its AsyncLLM). One move (a sleep or a
    wake) at a time: a sleep or a wake asked while one is in flight waits for it, then
    does what is still needed; a waiter cancelled meanwhile does not cancel the move
    (the others still need it)."""

    def __init__(self, llm: Any, can_sleep: bool, name: str) -> None:
        self.llm = llm
        self.can_sleep = can_sleep
        self.name = name
        self.state = RestState.AWAKE
        self._moving: asyncio.Future[None] | None = None

    async def sleep(self) -> None:
        if not self.can_sleep:
            raise RuntimeError(f"{self.name} was started without vLLM's sleep mode")
        await self._settle()
        if self.state is RestState.ASLEEP:
            # A judge on a GPU that got no verdict since the fleet's last rest has its
            # memory off the GPU already.
            return
        if busy := self.llm.get_num_unfinished_requests():
            raise RuntimeError(f"{self.name} cannot sleep with {busy} requests in flight")
        await self._move(lambda: self.llm.sleep(level=int(JUDGE_REST)), RestState.ASLEEP)

    async def wake(self) -> None:
        await self._settle()
        if self.state is RestState.ASLEEP:
            await self._move(lambda: self.llm.wake_up(tags=None), RestState.AWAKE)

    async def _settle(self) -> None:
        """Until no move is in flight (each waiter looks again: another may have started
        one the moment the last ended)."""
        while self._moving is not None:
            try:
                await asyncio.shield(self._moving)
            except Exception:  # the move's own caller has its failure
                pass

    async def _move(self, step: Callable[[], Awaitable[Any]], to: RestState) -> None:
        async def run() -> None:
            try:
                await step()
                self.state = to
            finally:
                self._moving = None

        self._moving = asyncio.ensure_future(run())
        await asyncio.shield(self._moving)


class RestsThroughEngine:
    """The resting face of an engine that rests through its `EngineRest` (`self.rest`)."""

    rest: EngineRest

    @property
    def can_sleep(self) -> bool:
        return self.rest.can_sleep

    async def sleep(self) -> None:
        await self.rest.sleep()


@runtime_checkable
class SleepingJudge(JudgeEngine, Protocol):
    """A judge engine that can rest (`VLLMJudge`, `VLLMRewardModel`, `JudgePool`,
    `RemoteJudge`): at level 1 always, `JUDGE_REST`."""

    @property
    def can_sleep(self) -> bool: ...

    async def sleep(self) -> None: ...


class FleetAndJudge:
    """`rpk.core.protocols.Resting` over the colocated fleet and the judge beside it."""

    def __init__(self, fleet: Resting, judge: JudgeScorer, log: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.judge = judge
        self.log = log
        self._said = False

    @property
    def rest_level(self) -> RestLevel | None:
        return self.fleet.rest_level

    @property
    def resting(self) -> RestLevel | None:
        return self.fleet.resting

    async def rest(self, level: RestLevel) -> None:
        await self.fleet.rest(level)
        engine = self.judge.engine
        if engine is None:
            return
        if isinstance(engine, SleepingJudge) and engine.can_sleep:
            await engine.sleep()
        elif not self._said:
            self._said = True
            self.log("judge: its engine runs without sleep mode (vLLM has none on CPU): it keeps "
                     "its memory while the trainer trains")

    async def wake_from_rest(self) -> None:
        # The judge wakes when it is next asked, not here: the fleet also wakes through
        # its weight sync, which never passes by this object.
        await self.fleet.wake_from_rest()


def with_judge(fleet: Resting, judge: JudgeScorer | None, log: Callable[[str], None]) -> Resting:
    """What rests while the trainer trains: the fleet, and the judge when there is one."""
    return fleet if judge is None else FleetAndJudge(fleet, judge, log)
