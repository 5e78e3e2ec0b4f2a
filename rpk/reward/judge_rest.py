"""The colocated judge rests with the fleet. While the trainer trains, the rollout
replicas sleep (`rpk.engine.fleet.Fleet.rest`) so that the trainer has their GPUs; the
judge lives on the same GPUs and sleeps with them, at the same level. It wakes the next
time it is asked for a verdict (`rpk.reward.judge_vllm.EngineRest`), after the fleet's
KV cache is back: its share was planned beside it.

vLLM's CPU worker has no sleep mode: a judge started without it keeps its memory, and
resting says so once.
"""

from __future__ import annotations

from typing import Callable, Protocol

from rpk.core.protocols import Resting
from rpk.reward.judge import JudgeScorer


class SleepingJudge(Protocol):
    """A judge engine that can rest (`rpk.reward.judge_vllm.VLLMJudge`)."""

    @property
    def can_sleep(self) -> bool: ...

    async def sleep(self, level: int) -> None: ...


class FleetAndJudge:
    """`rpk.core.protocols.Resting` over the colocated fleet and the judge beside it."""

    def __init__(self, fleet: Resting, judge: JudgeScorer, log: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.judge = judge
        self.log = log
        self._said = False

    @property
    def rest_level(self) -> int | None:
        return self.fleet.rest_level

    @property
    def resting(self) -> int | None:
        return self.fleet.resting

    async def rest(self, level: int) -> None:
        await self.fleet.rest(level)
        engine: SleepingJudge | None = self.judge.engine  # type: ignore[assignment]
        if engine is None:
            return
        if engine.can_sleep:
            await engine.sleep(level)
        elif not self._said:
            self._said = True
            self.log("judge: its vLLM runs without sleep mode (vLLM has none on CPU): it keeps "
                     "its memory while the trainer trains")

    async def wake_from_rest(self) -> None:
        # The judge wakes when it is next asked, not here: the fleet also wakes through
        # its weight sync, which never passes by this object.
        await self.fleet.wake_from_rest()


def with_judge(fleet: Resting, judge: JudgeScorer | None, log: Callable[[str], None]) -> Resting:
    """What rests while the trainer trains: the fleet, and the judge when there is one."""
    return fleet if judge is None else FleetAndJudge(fleet, judge, log)
