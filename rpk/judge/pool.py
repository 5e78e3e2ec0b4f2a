"""The judge's engines on the GPUs: where they go, how they start, one engine per rollout
GPU of every engine node, and the pool the scorer asks them through.

The controller works the placement out once from the memory plan (`JudgePlan`: the
judge's settings, its per-GPU engine settings and the rollout GPUs) and every engine
node starts the same engines from it: node 0 in the controller's process, every other
node in its engine host (`rpk.cluster.host`), which receives the launch in the engine
spec. The only thing a node adds is its own `CUDA_VISIBLE_DEVICES`, through which each
engine is pinned to its GPU exactly as the rollout replicas are (`device_env`).

On every rollout GPU of every engine node one judge engine (the memory plan prices one
per GPU; another node's are served by its engine host, `rpk.cluster.remote.RemoteJudge`):
`JudgePool` sends each verdict to the engine with the fewest requests in flight, ties to
the next one after the last chosen (`least_loaded`), so that under the scorer's cap of
`max_concurrency` no engine holds more than ceil(cap / engines), the `max_num_seqs` its
KV cache was sized for (x `votes`: each of a verdict's votes is a request of its own). The
engines rest together and wake together, at the first verdict after a rest; one that
dies stops the run in one line naming its GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpk.engine.placement import ReplicaPlace, device_env
from rpk.judge.rest import SleepingJudge
from rpk.judge.vllm import JudgeDevice, engine_class
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeSettings, first_error
from rpk.reward.verdict import Reading


def least_loaded(loads: Sequence[int], after: int) -> int:
    """The index of the smallest load; among equals the first after index `after`
    (round-robin while every engine is idle)."""
    if not loads:
        raise ValueError("no judge engines to choose from")
    n = len(loads)
    return min(((after + 1 + k) % n for k in range(n)), key=lambda i: loads[i])


class JudgePool:
    """`JudgeEngine` over the judge engines on the rollout GPUs; `where[i]` names engine
    i's place (`GPU 3`) in what it says."""

    def __init__(self, engines: Sequence[SleepingJudge], where: Sequence[str]) -> None:
        if not engines or len(engines) != len(where):
            raise ValueError(f"{len(engines)} judge engines for {len(where)} places")
        self.engines = list(engines)
        self.where = list(where)
        self.loads = [0] * len(engines)
        self._last = -1

    def join(self, engines: Sequence[SleepingJudge], where: Sequence[str]) -> None:
        """More engines, started elsewhere (the other nodes' judges, once their engine
        hosts serve them): asked, rested and closed with the rest."""
        if len(engines) != len(where):
            raise ValueError(f"{len(engines)} judge engines for {len(where)} places")
        self.engines.extend(engines)
        self.where.extend(where)
        self.loads.extend([0] * len(engines))

    @property
    def can_sleep(self) -> bool:
        return all(e.can_sleep for e in self.engines)

    async def sleep(self) -> None:
        await self._each(lambda e: e.sleep())

    async def ready(self) -> None:
        """Every engine awake: all wake at the first verdict of a round, in parallel,
        rather than each at its own first verdict (a late one would still be waking
        when the round ends and the fleet rests)."""
        await self._each(lambda e: e.ready())

    async def _each(self, call: Callable[[SleepingJudge], Awaitable[None]]) -> None:
        """`call` on every engine at once; a dead one is named by its place."""
        try:
            async with asyncio.TaskGroup() as tg:
                for i, e in enumerate(self.engines):
                    tg.create_task(self._named(i, call(e)), name=f"judge engine {i} ({self.where[i]})")
        except BaseExceptionGroup as group:
            raise first_error(group) from None

    async def _named(self, i: int, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except JudgeDied as e:
            raise JudgeDied(f"judge engine {i} of {len(self.engines)} ({self.where[i]}): {e}") from None

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        i = self._last = least_loaded(self.loads, self._last)
        self.loads[i] += 1
        try:
            return await self._named(i, self.engines[i].judge(request, request_id))
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
    launchers: Sequence[Callable[[], Awaitable[SleepingJudge]]], where: Sequence[str]
) -> JudgePool:
    """The engines started one after another (two vLLM engines must not start side by
    side); a failure stops those already started, newest first, and is raised."""
    started: list[SleepingJudge] = []
    try:
        for launch in launchers:
            started.append(await launch())
    except BaseException:
        if started:
            await JudgePool(started, where[:len(started)]).aclose()
        raise
    return JudgePool(started, where)


@dataclass(frozen=True, slots=True)
class JudgePlace:
    """One judge engine's GPU: the device id (this process's index), what pins it there,
    its settings, and its node where the run has several (None: one node)."""

    gpu: int
    env: Mapping[str, str | None]
    device: JudgeDevice
    node: int | None = None

    @property
    def name(self) -> str:
        where = f"GPU {self.gpu}"
        return where if self.node is None else f"node {self.node} {where}"


@dataclass(frozen=True, slots=True)
class JudgePlan:
    """The run's judge engines, worked out once (`rpk.assembly.box.judge_plan`) and the
    same on every engine node: the judge's settings and, where the memory plan places the
    judge on the GPUs, its per-GPU engine (`device`) on each rollout GPU (`devices`: the
    same ids on every node); without a device (CPU), one engine with the settings' own.
    A node adds only its own CUDA_VISIBLE_DEVICES (`visible`)."""

    settings: JudgeSettings
    device: JudgeDevice | None = None
    devices: tuple[int, ...] = ()
    hub_cache: str | None = None
    seed: int = 0

    def places(self, visible: str | None, node: int | None = None) -> list[JudgePlace]:
        """A judge engine on each rollout GPU, pinned as a TP-1 replica there would be;
        none without a device."""
        if self.device is None:
            return []
        return [JudgePlace(d, device_env(ReplicaPlace(1, i, (d,)), "cuda", visible), self.device, node)
                for i, d in enumerate(self.devices)]

    def launcher(self, visible: str | None, node: int | None = None
                 ) -> Callable[[JudgeSettings], Awaitable[SleepingJudge]]:
        """What `JudgeScorer.start` calls: one engine per place, started one after
        another (`start_pool`), or the one engine of the settings."""
        places = self.places(visible, node)

        async def launch(settings: JudgeSettings) -> SleepingJudge:
            kind = engine_class(settings)
            if not places:
                return await kind.launch(settings, hub_cache=self.hub_cache, seed=self.seed)
            return await start_pool(
                [functools.partial(kind.launch, settings, hub_cache=self.hub_cache, seed=self.seed,
                                   device=p.device, env=p.env) for p in places],
                [p.name for p in places])

        return launch

    async def start(self, visible: str | None, node: int | None = None) -> SleepingJudge:
        """This node's engines (another node's engine host starts its own from the plan)."""
        return await self.launcher(visible, node)(self.settings)

    def describe(self, visible: str | None) -> str:
        """The judge's line in the run's log."""
        places, where = self.places(visible), ""
        if places and self.device is not None:
            d = self.device
            where = (f"; an engine on each of GPUs {[p.gpu for p in places]} (gpu_memory_utilization "
                     f"{d.gpu_memory_utilization}, {d.offloaded} of {d.layers} layers streamed from host, "
                     f"max_num_seqs {d.max_num_seqs})")
        return f"judge: {self.settings.model} ({self.settings.verdict} verdicts){where}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> JudgePlan:
        d = json.loads(text)
        device = JudgeDevice(**d["device"]) if d["device"] is not None else None
        return cls(JudgeSettings.from_dict(d["settings"]), device, tuple(d["devices"]), d["hub_cache"], d["seed"])
