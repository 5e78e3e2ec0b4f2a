"""The judge's engines on the GPUs: where they go, how they start, one engine per rollout
GPU of every engine node, and the pool the scorer asks them through, which restarts an
engine that dies.

The controller works the placement out once from the memory plan (`JudgePlan`: the
judge's settings, its per-GPU engine settings and the rollout GPUs) and every engine
node starts the same engines from it: node 0 in the controller's process, every other
node in its engine host (`rpk.cluster.host`), which receives the launch in the engine
spec. The only thing a node adds is its own `CUDA_VISIBLE_DEVICES`, through which each
engine is pinned to its GPU exactly as the rollout replicas are (`device_env`).

On every rollout GPU of every engine node one judge engine (the memory plan prices one
per GPU; another node's are served by its engine host, `rpk.cluster.remote_judge.RemoteJudge`):
`JudgePool` sends each verdict to the live engine with the fewest requests in flight,
ties to the next one after the last chosen (`least_loaded`), so that under the scorer's
cap of `max_concurrency` no engine holds more than ceil(cap / engines), the
`max_num_seqs` its KV cache was sized for (x `votes`: each of a verdict's votes is a
request of its own). The engines rest together and wake together, at the first verdict
after a rest (`rpk.judge.rest`).

A judge's weights never change, so an engine that dies is started again from its
directory with its own settings and place, while the others serve (`RESTARTS`, a `Backoff`): it
leaves the pool at once, the verdicts it held are asked again of another engine (within
their own timeout, which the scorer keeps), and it rejoins once it is up. Starts are
one at a time and wait while the pool rests (the trainer has the GPUs); one that ends
after the pool went to rest sleeps before it rejoins. The run stops,
in one line naming every engine's state, only when an engine has used up its restarts
or none is left to serve or come back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from rpk.core.backoff import Backoff
from rpk.core.records import IllegalTransition
from rpk.engine.placement import ReplicaPlace, device_env
from rpk.judge.rest import SleepingJudge
from rpk.judge.vllm import JudgeDevice, engine_class
from rpk.reward.functions import describe
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeSettings
from rpk.reward.verdict import Reading

# A dead engine in, a live one out: the same engine started again where it ran.
Relaunch = Callable[[SleepingJudge], Awaitable[SleepingJudge]]


def least_loaded(loads: Sequence[float], after: int) -> int:
    """The index of the smallest load; among equals the first after index `after`
    (round-robin while every engine is idle)."""
    if not loads:
        raise ValueError("no judge engines to choose from")
    n = len(loads)
    return min(((after + 1 + k) % n for k in range(n)), key=lambda i: loads[i])


class EngineState(enum.Enum):
    LIVE = "live"  # serving verdicts
    DOWN = "down"  # died; its restart is under way (a backoff, then a start)
    GONE = "gone"  # died with no restart left: the run stops
    CLOSED = "closed"

    def can_become(self, new: EngineState) -> bool:
        return new in _MOVES[self]


_MOVES: dict[EngineState, frozenset[EngineState]] = {
    EngineState.LIVE: frozenset({EngineState.DOWN, EngineState.GONE, EngineState.CLOSED}),
    EngineState.DOWN: frozenset({EngineState.LIVE, EngineState.GONE, EngineState.CLOSED}),
    EngineState.GONE: frozenset({EngineState.CLOSED}),
    EngineState.CLOSED: frozenset(),
}


# How dead engines come back: each engine is started again at most `limit` times over
# the run (a start that fails counts), each death's tries waiting as a `Backoff` does.
# `limit` 0: a death stops the run, as a crash-looping engine does once its restarts
# are spent.
RESTARTS = Backoff(limit=3, backoff_s=2.0, max_backoff_s=60.0)


@dataclass(eq=False, slots=True)
class _Engine:
    engine: SleepingJudge
    where: str
    relaunch: Relaunch | None
    state: EngineState = EngineState.LIVE
    load: int = 0
    restarts: int = 0  # starts tried over the run
    last_error: str = ""

    def move(self, new: EngineState) -> None:
        if not self.state.can_become(new):
            raise IllegalTransition(f"judge engine on {self.where}: {self.state.value} -> {new.value}")
        self.state = new


@dataclass(frozen=True, slots=True)
class Member:
    """One engine of a pool, as it stood when asked: its place, how it is started again,
    its state and its verdicts in flight."""

    engine: SleepingJudge
    where: str
    relaunch: Relaunch | None
    state: EngineState
    load: int


def _quiet(line: str) -> None:
    pass


class JudgePool:
    """`JudgeEngine` over the judge engines on the rollout GPUs; `where[i]` names engine
    i's place (`GPU 3`) in what it says. `relaunch[i]` starts engine i again after it
    died (None: it cannot be); `log` gets one line per death and rejoin."""

    def __init__(self, engines: Sequence[SleepingJudge], where: Sequence[str], *,
                 relaunch: Sequence[Relaunch | None] | None = None, restarts: Backoff = RESTARTS,
                 log: Callable[[str], None] = _quiet) -> None:
        if not engines or len(engines) != len(where):
            raise ValueError(f"{len(engines)} judge engines for {len(where)} places")
        self._engines: list[_Engine] = []
        self.restarts = restarts
        self.log = log
        self._last = -1
        self._failure: str | None = None  # set once: every later verdict raises it
        self._changed = asyncio.Event()  # replaced on every change; its waiters re-check
        self._awake = asyncio.Event()  # cleared while the pool rests: no start then
        self._awake.set()
        self._starting = asyncio.Lock()  # two vLLM engines must not start side by side
        self._tasks: set[asyncio.Task[None]] = set()
        self.restarted = 0
        self._reported = 0
        self.join(engines, where, relaunch)

    def join(self, engines: Sequence[SleepingJudge], where: Sequence[str],
             relaunch: Sequence[Relaunch | None] | None = None) -> None:
        """More engines, started elsewhere (the other nodes' judges, once their engine
        hosts serve them): asked, rested, restarted and closed with the rest."""
        relaunch = list(relaunch) if relaunch is not None else [None] * len(engines)
        if not len(engines) == len(where) == len(relaunch):
            raise ValueError(f"{len(engines)} judge engines for {len(where)} places")
        self._engines.extend(_Engine(e, w, r) for e, w, r in zip(engines, where, relaunch, strict=True))

    @property
    def engines(self) -> list[SleepingJudge]:
        return [e.engine for e in self._engines]

    @property
    def members(self) -> tuple[Member, ...]:
        """Each engine as the pool sees it now."""
        return tuple(Member(e.engine, e.where, e.relaunch, e.state, e.load) for e in self._engines)

    @property
    def can_sleep(self) -> bool:
        return all(e.engine.can_sleep for e in self._engines)

    async def sleep(self) -> None:
        """The live engines sleep together; one found dead meanwhile is restarted, not
        fatal."""
        self._awake.clear()
        await self._each(lambda engine: engine.sleep())

    async def ready(self) -> None:
        """Every live engine awake: all wake at the first verdict of a round, in
        parallel, rather than each at its own first verdict (a late one would still be
        waking when the round ends and the fleet rests). One that dies waking is
        restarted (it comes back awake); the verdicts then go to the others."""
        self._awake.set()  # asked for a verdict: the fleet is awake again, restarts may start
        if self._failure is not None:
            raise JudgeDied(self._failure)
        await self._each(lambda engine: engine.ready())

    async def _each(self, call: Callable[[SleepingJudge], Awaitable[None]]) -> None:
        """`call` on every live engine at once; a death starts that engine's restart,
        any other failure is raised (the first) once all have ended."""
        live = [(i, e.engine) for i, e in enumerate(self._engines) if e.state is EngineState.LIVE]
        done = await asyncio.gather(*(call(engine) for _, engine in live), return_exceptions=True)
        errors = []
        for (i, engine), result in zip(live, done, strict=True):
            if isinstance(result, JudgeDied):
                self._died(i, engine, result)
            elif isinstance(result, BaseException):
                errors.append(result)
        if errors:
            raise errors[0]

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        while True:
            changed = self._changed
            if self._failure is not None:
                raise JudgeDied(self._failure)
            live = [e.load if e.state is EngineState.LIVE else math.inf for e in self._engines]
            if min(live) == math.inf:
                await changed.wait()  # every engine is restarting: the first back serves
                continue
            i = self._last = least_loaded(live, self._last)
            slot, engine = self._engines[i], self._engines[i].engine
            slot.load += 1
            try:
                return await engine.judge(request, request_id)
            except JudgeDied as e:
                self._died(i, engine, e)  # then asked again of another engine
            finally:
                slot.load -= 1

    def _died(self, i: int, engine: SleepingJudge, error: JudgeDied) -> None:
        slot = self._engines[i]
        if slot.engine is not engine or slot.state is not EngineState.LIVE:
            return  # another verdict on the same engine saw its death first
        slot.last_error = " ".join(str(error).split())
        what = f"judge engine {i} of {len(self._engines)} ({slot.where}): {slot.last_error}"
        if slot.relaunch is None or slot.restarts >= self.restarts.limit:
            slot.move(EngineState.GONE)
            why = ("it cannot be restarted" if slot.relaunch is None else
                   f"its restarts are spent ({slot.restarts} of reward.judge.restarts={self.restarts.limit})")
            self._fail(f"{what}; {why}")
            return
        slot.move(EngineState.DOWN)
        self.log(f"judge: {what}; restarting it, {self._roll()}")
        task = asyncio.create_task(self._restart(i), name=f"judge-restart-{slot.where}")
        self._tasks.add(task)
        task.add_done_callback(self._restart_done)
        self._pulse()

    def _restart_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._fail(f"judge: restarting an engine failed: {describe(task.exception())}")

    async def _restart(self, i: int) -> None:
        slot = self._engines[i]
        assert slot.relaunch is not None
        dead, attempt = slot.engine, 0
        while slot.restarts < self.restarts.limit:
            attempt += 1
            slot.restarts += 1
            await asyncio.sleep(self.restarts.delay(attempt))
            await self._awake.wait()
            async with self._starting:
                try:
                    engine = dead = await slot.relaunch(dead)
                    if not self._awake.is_set() and engine.can_sleep:
                        await engine.sleep()  # the pool went to rest while it started
                except Exception as e:
                    slot.last_error = f"its restart failed: {describe(e)}"
                    self.log(f"judge: engine {i} ({slot.where}): {slot.last_error} "
                             f"({slot.restarts} of {self.restarts.limit} tries)")
                    continue
            slot.engine = engine
            slot.move(EngineState.LIVE)
            self.restarted += 1
            self.log(f"judge: engine {i} ({slot.where}) is back ({slot.restarts} of "
                     f"{self.restarts.limit} restarts used), {self._roll()}")
            self._pulse()
            return
        slot.move(EngineState.GONE)
        self._fail(f"judge engine {i} of {len(self._engines)} ({slot.where}) stays dead: "
                   f"{slot.last_error}; its restarts are spent (reward.judge.restarts={self.restarts.limit})")

    def _fail(self, what: str) -> None:
        if self._failure is None:
            self._failure = f"{what} [{self._roll()}]"
        self._pulse()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _roll(self) -> str:
        """Every engine's place by state, in one line: `live: GPU 0, GPU 2; down: GPU 1`."""
        by: dict[str, list[str]] = {}
        for e in self._engines:
            by.setdefault(e.state.value, []).append(e.where)
        return "; ".join(f"{state}: {', '.join(places)}" for state, places in by.items())

    def metrics(self) -> dict[str, float]:
        """The restarts since the last step's record, and their total."""
        step, self._reported = self.restarted - self._reported, self.restarted
        return {
            "reward_judge_restarts": float(step),
            "reward_judge_restarts_total": float(self.restarted),
            "reward_judge_engines_live": float(sum(e.state is EngineState.LIVE for e in self._engines)),
        }

    async def aclose(self) -> None:
        """Stops the restarts, then every engine, even past one that fails to stop;
        raises the first failure."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        first: BaseException | None = None
        for slot in reversed(self._engines):
            if slot.state is EngineState.CLOSED:
                continue
            slot.move(EngineState.CLOSED)
            try:
                await slot.engine.aclose()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


async def start_pool(
    launchers: Sequence[Callable[[], Awaitable[SleepingJudge]]], where: Sequence[str], *,
    relaunch: Sequence[Relaunch | None] | None = None, restarts: Backoff = RESTARTS,
    log: Callable[[str], None] = _quiet,
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
    return JudgePool(started, where, relaunch=relaunch, restarts=restarts, log=log)


def relaunch_with(launch: Callable[[], Awaitable[SleepingJudge]]) -> Relaunch:
    """A restart that stops what is left of the dead engine (its processes), then starts
    it as `launch` says."""

    async def relaunch(dead: SleepingJudge) -> SleepingJudge:
        try:
            await dead.aclose()
        except Exception:
            pass  # a dead engine may fail to stop cleanly; its processes are gone either way
        return await launch()

    return relaunch


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

    def launcher(self, visible: str | None, node: int | None = None, *, restarts: Backoff = RESTARTS,
                 log: Callable[[str], None] = _quiet) -> Callable[[JudgeSettings], Awaitable[JudgePool]]:
        """What starts this node's engines: one engine per place, started one after
        another (`start_pool`), or the one engine of the settings; always in a
        `JudgePool`, so that one that dies is started again in its place with its own
        settings (its model loading in a thread: the run goes on meanwhile)."""
        places = self.places(visible, node)

        async def launch(settings: JudgeSettings) -> JudgePool:
            kind = engine_class(settings)

            def one(place: JudgePlace | None, in_thread: bool) -> Callable[[], Awaitable[SleepingJudge]]:
                where = {} if place is None else {"device": place.device, "env": place.env}
                return functools.partial(kind.launch, settings, hub_cache=self.hub_cache, seed=self.seed,
                                         in_thread=in_thread, **where)

            at: list[JudgePlace | None] = list(places) or [None]
            return await start_pool([one(p, False) for p in at],
                                    [p.name if p is not None else "this process" for p in at],
                                    relaunch=[relaunch_with(one(p, True)) for p in at],
                                    restarts=restarts, log=log)

        return launch

    async def start(self, visible: str | None, node: int | None = None) -> JudgePool:
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
