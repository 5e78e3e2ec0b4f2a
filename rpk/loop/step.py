"""One RL step: a rollout round (with reward overlapped), training on its groups as they
complete (streaming), one optimizer step once the round is over, weight sync to the
engine. Every sample is trained under the weights that generated it: gradients pile up
during the round and the optimizer steps only after its last group.

Streaming modes: `none` trains after the round; `thread` trains completed groups on the
trainer thread beside the engine while the tail generates; `borrow` (the paper's stream
trainer) waits for the trigger (`rpk.sched.borrow`), has the fleet lend half its
replicas (their requests move to the others, `Fleet.lend`), and only then trains, on
the devices those replicas freed; the fleet takes them back after the round."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator, Callable, Mapping, Protocol, Sequence

from rpk.core.protocols import Engine, Scorer, Trainer, WeightBucket
from rpk.core.records import FinishReason, Group, RoundKind, TrainSample
from rpk.loop.rollout import RoundObserver, run_round
from rpk.sched.borrow import BorrowRule, BorrowTrigger, lenders
from rpk.sched.policy import Policy
from rpk.sched.round import RoundPlan, RoundResult


class StepObserver(RoundObserver, Protocol):
    def training(self, done_samples: int, total_samples: int) -> None: ...


Weights = Callable[[], AsyncIterable[WeightBucket]]


class BetweenRounds(Protocol):
    """What changes the engine between rounds (elastic TP: `rpk.loop.elastic`)."""

    async def before_round(self, plan: RoundPlan) -> None:
        """The round is planned and about to start."""
        ...

    async def after_round(
        self, result: RoundResult, rollout_s: float, next_kind: RoundKind,
        weights: Weights, version: int,
    ) -> bool:
        """The round is over and trained, the weights of `version` are ready, and the
        next round will be of `next_kind`. True: the engine now serves `version` (it
        read `weights()` itself), so the step's own weight sync is skipped."""
        ...


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step: int
    round: RoundResult
    train: Mapping[str, float]
    time_rollout_s: float
    time_train_s: float
    time_sync_s: float
    time_step_s: float
    version: int  # the policy version after this step's update
    capacity: int  # the engine's concurrency during the round (its layout's, if elastic)
    time_train_busy_s: float = 0.0  # trainer busy, streamed part included
    time_train_hidden_s: float = 0.0  # trainer busy while the round still generated
    sync_bytes: int = 0  # weights sent to the engine after the update
    sync_buckets: int = 0
    time_regroup_s: float = 0.0  # `before_round`: the engine regrouped for this round
    # (a regroup `after_round` makes for the next round is in time_sync_s: it replaces
    # the weight sync)
    # borrow mode: the trigger's fraction of responses done (None: it did not fire),
    # and the migration `Fleet.lend` reported
    borrow_frac: float | None = None
    time_migrate_s: float = 0.0  # from the first abort to every moved request re-added
    migrated_requests: int = 0
    migrated_tokens: int = 0


def train_samples(groups: Sequence[Group]) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_ids=g.prompt.token_ids,
            response_ids=m.response.token_ids,
            old_logprobs=m.response.logprobs,
            advantage=a,
            truncated=m.response.finish_reason is FinishReason.LENGTH,
        )
        for g in groups
        for m, a in zip(g.members, g.advantages)
    ]


class AsyncTrainer:
    """A blocking `Trainer` driven from the event loop. Every call runs on one dedicated
    thread, in the order made, so the event loop keeps serving the engine and torch's
    per-thread state stays on one thread. `thread_init` runs once on that thread: on
    GPU it makes a side CUDA stream current there (rpk.gpu.streams), so trainer kernels
    queue apart from the engine's."""

    def __init__(self, trainer: Trainer, thread_init: Callable[[], None] | None = None) -> None:
        self.trainer = trainer
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rpk-trainer", initializer=thread_init
        )

    @property
    def version(self) -> int:
        return self.trainer.version

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def begin_step(self) -> None:
        await self.call(self.trainer.begin_step)

    async def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        return await self.call(self.trainer.accumulate, samples)

    async def finish_step(self) -> Mapping[str, float]:
        return await self.call(self.trainer.finish_step)

    async def abandon_step(self) -> None:
        await self.call(self.trainer.abandon_step)

    async def compute_on(self, ranks: Sequence[int] | None) -> None:
        """A sharded trainer's `compute_on` (`rpk.gpu.commands.DistTrainer`): only
        `ranks` compute chunks until the step ends."""
        await self.call(self.trainer.compute_on, ranks)  # type: ignore[attr-defined]

    async def weight_buckets(self, max_bytes: int) -> AsyncIterator[WeightBucket]:
        """The trainer's `weight_buckets`, each bucket made on the trainer thread."""
        buckets = await self.call(self.trainer.weight_buckets, max_bytes)
        while (bucket := await self.call(next, buckets, None)) is not None:
            yield bucket

    async def offload(self, what: str) -> None:
        """The trainer's state to host (`none`, `optimizer`, `all`) while vLLM generates;
        it comes back with the first micro-batch (`TorchTrainer.offload`)."""
        await self.call(self.trainer.offload, what)  # type: ignore[attr-defined]

    async def save(self, directory: Path) -> None:
        await self.call(self.trainer.save, directory)

    async def load(self, directory: Path) -> None:
        await self.call(self.trainer.load, directory)

    async def aclose(self) -> None:
        """After whatever call is running: the trainer's `close`, then the thread."""
        try:
            await self.call(self.trainer.close)
        finally:
            self._pool.shutdown(wait=False)


STREAM_MODES = ("none", "thread", "borrow")


@dataclass(frozen=True, slots=True)
class Streaming:
    """When and where the trainer starts on a round's completed groups.

    `none`: after rollout, as veRL does. `thread`: once `start_frac` of the round's
    groups are complete (the paper starts between 20% and 50%: early enough to hide the
    trainer behind the tail, late enough that groups keep arriving so it does not
    idle), on the trainer thread, while the rest of the round generates. `borrow`: once
    `borrow`'s trigger fires and the fleet has lent half its replicas. Either way in
    chunks of about `chunk_tokens` tokens; what is still waiting when the round ends is
    trained after it, exposed: smaller chunks leave less, at some cost in micro-batch
    efficiency."""

    mode: str = "thread"
    start_frac: float = 0.0
    chunk_tokens: int = 1024
    borrow: BorrowRule = BorrowRule()
    # borrow, sharded trainer: the ranks on the lent replicas' devices (replica names ->
    # ranks, or None where they cannot compute alone); they alone train until the round
    # ends, every rank after it. None: the trainer computes where it always does.
    trainer_ranks: Callable[[Sequence[str]], Sequence[int] | None] | None = None

    def __post_init__(self) -> None:
        if self.mode not in STREAM_MODES:
            raise ValueError(f"mode must be one of {', '.join(STREAM_MODES)}, got {self.mode!r}")
        if not 0 <= self.start_frac <= 1:
            raise ValueError(f"start_frac must be in [0, 1], got {self.start_frac!r}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens!r}")


class _Feed:
    """Completed groups on their way into the trainer: filled by the round's `on_group`
    callback, drained by `train`, which runs beside the round in the step's TaskGroup."""

    def __init__(
        self, trainer: AsyncTrainer, streaming: Streaming, groups_needed: int,
        observer: StepObserver | None, clock: Callable[[], float],
    ) -> None:
        self.trainer = trainer
        self.s = streaming
        self.start_at = max(1, round(streaming.start_frac * groups_needed))
        self.observer = observer
        self.clock = clock
        self.pending: list[TrainSample] = []
        self.groups_seen = 0
        self.samples_done = 0
        self.arrived = asyncio.Event()
        self.round_over = False
        self.busy_s = 0.0  # trainer time spent on accumulate calls
        self.hidden_s = 0.0  # ... of which while the round was still generating
        self.borrowed = False  # borrow mode: the fleet has lent the trainer its devices
        self.narrowed = False  # ... and only the lent devices' ranks compute

    def add(self, group: Group) -> None:
        self.groups_seen += 1
        self.pending.extend(train_samples([group]))
        self.arrived.set()

    def end_round(self) -> None:
        self.round_over = True
        self.arrived.set()

    def lent(self) -> None:
        self.borrowed = True
        self.arrived.set()

    def _streams_now(self) -> bool:
        if self.s.mode == "borrow":
            return self.borrowed
        return self.s.mode == "thread" and self.groups_seen >= self.start_at

    def _ready_chunk(self) -> list[TrainSample]:
        if self.round_over:
            chunk, self.pending = self.pending, []
            return chunk
        if not self._streams_now():
            return []
        tokens = 0
        for i, sample in enumerate(self.pending):
            tokens += len(sample.prompt_ids) + len(sample.response_ids)
            if tokens >= self.s.chunk_tokens:
                chunk, self.pending = self.pending[: i + 1], self.pending[i + 1 :]
                return chunk
        return []

    async def train(self) -> Mapping[str, float]:
        """Accumulate chunks as they become ready; after the round, the rest and the one
        optimizer step."""
        while True:
            if self.round_over and self.narrowed:
                await self.trainer.compute_on(None)  # the devices are back: all ranks
                self.narrowed = False
            chunk = self._ready_chunk()
            if chunk:
                during_round = not self.round_over
                started = self.clock()
                await self.trainer.accumulate(chunk)
                took = self.clock() - started
                self.busy_s += took
                if during_round:
                    self.hidden_s += took
                self.samples_done += len(chunk)
                if self.observer:
                    self.observer.training(self.samples_done, self.samples_done + len(self.pending))
                continue
            if self.round_over:
                break
            self.arrived.clear()
            await self.arrived.wait()
        started = self.clock()
        stats = await self.trainer.finish_step()
        self.busy_s += self.clock() - started
        return stats


class _Borrow:
    """borrow mode's driver for one round: feeds the trigger each accepted response;
    once it fires, has the fleet lend (`Fleet.lend`) and opens the feed."""

    def __init__(self, fleet: Any, rule: BorrowRule, plan: RoundPlan, feed: _Feed,
                 clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.trigger = BorrowTrigger(rule, plan.groups_needed * plan.group_size)
        self.feed = feed
        self.clock = clock
        self.done = 0
        self.wake = asyncio.Event()
        self.over = False
        self.report: Any = None

    def on_response(self) -> None:
        self.done += 1
        if self.trigger.observe(self.done, self.clock()):
            self.wake.set()

    def end_round(self) -> None:
        self.over = True
        self.wake.set()

    async def run(self) -> None:
        await self.wake.wait()
        if self.over:
            return
        self.report = await self.fleet.lend(lenders(self.fleet.in_flight))
        ranks_of = self.feed.s.trainer_ranks
        names = [self.fleet.layouts.awake.names[i] for i in self.report.lent]
        if ranks_of is not None and (ranks := ranks_of(names)) is not None:
            await self.feed.trainer.compute_on(ranks)
            self.feed.narrowed = True
        self.feed.lent()


def rest_level(engine: Any) -> int | None:
    """Colocated rollout and training (`Fleet.rest_level`): the sleep level the fleet
    rests at while the trainer trains; None: the engine keeps its devices."""
    return getattr(engine, "rest_level", None)


def can_borrow(engine: Any) -> bool:
    """borrow mode needs a fleet that can lend and a replica left to generate."""
    return hasattr(engine, "lend") and len(engine.replicas) >= 2


async def run_step(
    step: int,
    policy: Policy,
    engine: Engine,
    scorer: Scorer,
    trainer: AsyncTrainer,
    advantages: Callable[[Sequence[float]], list[float]],
    *,
    version: int,
    clock: Callable[[], float] = time.monotonic,
    observer: StepObserver | None = None,
    streaming: Streaming = Streaming(),
    overlap_reward: bool = True,
    weight_bucket_bytes: int = 256 * 2**20,
    between: BetweenRounds | None = None,
) -> StepOutcome:
    """`between` is told when a round is planned and when it is over (where the rollout
    TP changes for the next round's kind: `rpk.loop.elastic`). In borrow mode
    `engine` must be a fleet of >= 2 replicas (`can_borrow`; `rpk.build` falls back to
    thread mode otherwise)."""
    if streaming.mode == "borrow" and not can_borrow(engine):
        raise ValueError("stream mode borrow needs a fleet of >= 2 replicas (see can_borrow)")
    t0 = clock()
    plan = policy.plan(step)
    if between is not None:
        await between.before_round(plan)
    t_round = clock()
    await trainer.begin_step()
    feed = _Feed(trainer, streaming, plan.groups_needed, observer, clock)
    borrow = _Borrow(engine, streaming.borrow, plan, feed, clock) if streaming.mode == "borrow" else None

    async def rollout() -> RoundResult:
        result = await run_round(
            plan, engine, scorer, advantages, version=version, clock=clock,
            on_group=feed.add, observer=observer, overlap_reward=overlap_reward,
            on_response=borrow.on_response if borrow else None,
        )
        if borrow:
            borrow.end_round()
        if level := rest_level(engine):
            # Colocated: the rest of the training gets the devices vLLM had.
            await engine.rest(level)  # type: ignore[attr-defined]
        # Only a round that completed releases the optimizer step; after a failure the
        # feed is left waiting and the TaskGroup cancels it, so no step is taken on a
        # partial round's gradients.
        feed.end_round()
        return result

    try:
        async with asyncio.TaskGroup() as tg:
            round_task = tg.create_task(rollout(), name=f"round:{step}")
            train_task = tg.create_task(feed.train(), name=f"train:{step}")
            if borrow:
                tg.create_task(borrow.run(), name=f"borrow:{step}")
            result = await round_task
            t1 = clock()
    except BaseException:
        # The trainer thread finishes whatever call it was in, then drops the step's
        # gradients; shielded, so an interrupt still leaves the trainer reusable. Lent
        # replicas wake; their weights were dropped, so the fleet refuses to start a
        # round before a weight update reaches them.
        await asyncio.shield(trainer.abandon_step())
        if borrow and borrow.report is not None:
            await asyncio.shield(engine.reclaim())  # type: ignore[attr-defined]
        raise
    stats = train_task.result()
    t2 = clock()
    new_version = trainer.version
    sent = WeightTally()
    lent = borrow is not None and borrow.report is not None
    if lent:
        await engine.reclaim()  # type: ignore[attr-defined]
    capacity = engine.max_concurrency  # before a regroup for the next round
    policy.commit(result)

    def weights() -> AsyncIterable[WeightBucket]:
        return sent.count(trainer.weight_buckets(weight_bucket_bytes))

    synced = False
    if between is not None:
        synced = await between.after_round(result, t1 - t_round, policy.next_kind(), weights, new_version)
    # A step with nothing to learn from takes no update, unless replicas dropped their
    # weights while lent or resting; replicas resting with their weights just wake.
    resting = getattr(engine, "resting", None)
    if not synced and (new_version != version or lent or (resting or 0) >= 2):
        await engine.update_weights(weights(), new_version)
    elif not synced and resting:
        await engine.wake_from_rest()  # type: ignore[attr-defined]
    t3 = clock()
    return StepOutcome(
        step=step,
        round=result,
        train=stats,
        time_rollout_s=t1 - t_round,
        time_train_s=t2 - t1,
        time_sync_s=t3 - t2,
        time_step_s=t3 - t0,
        version=new_version,
        capacity=capacity,
        time_train_busy_s=feed.busy_s,
        time_train_hidden_s=feed.hidden_s,
        sync_bytes=sent.bytes,
        sync_buckets=sent.buckets,
        time_regroup_s=t_round - t0,
        **(_migration(borrow) if borrow else {}),
    )


def _migration(borrow: _Borrow) -> dict[str, Any]:
    r = borrow.report
    return {
        "borrow_frac": borrow.trigger.fired_at_frac if r is not None else None,
        "time_migrate_s": r.move_s if r is not None else 0.0,
        "migrated_requests": r.requests if r is not None else 0,
        "migrated_tokens": r.tokens if r is not None else 0,
    }


class WeightTally:
    """Counts the buckets and bytes of weights on their way to the engine."""

    def __init__(self) -> None:
        self.buckets = 0
        self.bytes = 0

    async def count(self, buckets: AsyncIterable[WeightBucket]) -> AsyncIterator[WeightBucket]:
        async for bucket in buckets:
            self.buckets += 1
            self.bytes += sum(_nbytes(t) for _, t in bucket)
            yield bucket


def _nbytes(tensor: Any) -> int:
    # torch tensors, without importing torch here: numel * element_size
    return int(tensor.numel() * tensor.element_size()) if hasattr(tensor, "element_size") else 0
