"""The judge on every rollout GPU: one engine per GPU, as the memory plan prices it
(`rpk.gpu.plan.judge`), behind the one `JudgeEngine` the scorer asks.

Each verdict goes to the engine with the fewest requests in flight, ties to the next
one after the last chosen (`least_loaded`): with the scorer's cap of `max_concurrency`
in flight in all, no engine holds more than ceil(cap / engines), the `max_num_seqs`
each engine's KV cache was sized for. The engines rest together with the fleet, and
one that dies stops the run in one line that names its GPU.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Mapping, Protocol, Sequence

from rpk.reward.judge import JudgeDied, JudgeEngine, Reading


def least_loaded(loads: Sequence[int], after: int) -> int:
    """The index of the smallest load; among equals the first after index `after`
    (round-robin while every engine is idle)."""
    if not loads:
        raise ValueError("no judge engines to choose from")
    n = len(loads)
    return min(((after + 1 + k) % n for k in range(n)), key=lambda i: loads[i])


class RestingJudge(JudgeEngine, Protocol):
    """A judge engine that can sleep with the fleet (`rpk.reward.judge_vllm.VLLMJudge`)."""

    @property
    def can_sleep(self) -> bool: ...

    async def sleep(self, level: int) -> None: ...


class JudgePool:
    """`JudgeEngine` over the judge engines on the rollout GPUs; `where[i]` names engine
    i's place (`GPU 3`) in what it says."""

    def __init__(self, engines: Sequence[RestingJudge], where: Sequence[str]) -> None:
        if not engines or len(engines) != len(where):
            raise ValueError(f"{len(engines)} judge engines for {len(where)} places")
        self.engines = list(engines)
        self.where = list(where)
        self.loads = [0] * len(engines)
        self.asked = [0] * len(engines)
        self._last = -1

    @property
    def can_sleep(self) -> bool:
        return all(e.can_sleep for e in self.engines)

    async def sleep(self, level: int) -> None:
        await asyncio.gather(*(e.sleep(level) for e in self.engines))

    async def judge(self, messages: Sequence[Mapping[str, str]], request_id: str) -> Reading:
        i = self._last = least_loaded(self.loads, self._last)
        self.loads[i] += 1
        self.asked[i] += 1
        try:
            return await self.engines[i].judge(messages, request_id)
        except JudgeDied as e:
            raise JudgeDied(f"judge engine {i} of {len(self.engines)} ({self.where[i]}): {e}") from None
        finally:
            self.loads[i] -= 1

    async def aclose(self) -> None:
        """Stops every engine, even past one that fails to stop; raises the first failure."""
        first: BaseException | None = None
        for engine in reversed(self.engines):
            try:
                await engine.aclose()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


async def start_pool(
    launchers: Sequence[Callable[[], Awaitable[RestingJudge]]], where: Sequence[str]
) -> JudgePool:
    """The engines started one after another (two vLLM engines must not start side by
    side); a failure stops those already started, newest first, and is raised."""
    started: list[RestingJudge] = []
    try:
        for launch in launchers:
            started.append(await launch())
    except BaseException:
        if started:
            await JudgePool(started, where[:len(started)]).aclose()
        raise
    return JudgePool(started, where)
