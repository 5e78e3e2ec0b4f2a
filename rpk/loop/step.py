"""One RL step: a rollout round (with reward overlapped), training on its groups as they
complete (streaming, `rpk.loop.feed`), one optimizer step once the round is over, weight
sync to the engine. Every sample is trained under the weights that generated it:
gradients pile up during the round and the optimizer steps only after its last group.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from rpk.core.modes import StreamMode
from rpk.core.outcomes import RoundPlan, RoundResult, StepOutcome
from rpk.core.protocols import Engine, GroupScorer, Lending, Resting, Scorer, StepTrainer, WeightBucket
from rpk.core.records import RoundKind
from rpk.loop.feed import Borrow, Feed, StepObserver, Streaming, can_borrow
from rpk.loop.rollout import run_round
from rpk.loop.speculate import SpecTail
from rpk.loop.trainer import WeightTally
from rpk.sched.policy import Policy

Weights = Callable[[], AsyncIterable[WeightBucket]]
T = TypeVar("T")


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


@dataclass(slots=True)
class _Times:
    """The step's clock readings: start, round start, round end, trained, synced."""

    start: float
    round: float = 0.0
    rolled: float = 0.0
    trained: float = 0.0
    synced: float = 0.0


async def run_step(
    step: int, policy: Policy, engine: Engine, scorer: Scorer, trainer: StepTrainer,
    advantages: Callable[[Sequence[float]], list[float]], *, version: int,
    clock: Callable[[], float] = time.monotonic, observer: StepObserver | None = None,
    streaming: Streaming = Streaming(), overlap_reward: bool = True,
    weight_bucket_bytes: int = 256 * 2**20, between: BetweenRounds | None = None,
    lending_fleet: Lending | None = None, resting_fleet: Resting | None = None,
    groups: GroupScorer | None = None, beside_round: Callable[[], Awaitable[None]] | None = None,
    spec: SpecTail | None = None,
) -> StepOutcome:
    """`between` hears when a round is planned and when it is over (elastic TP:
    `rpk.loop.elastic`). `lending_fleet`: in borrow mode, the fleet behind `engine` (>= 2
    replicas, `can_borrow`). `resting_fleet`: the fleet, when it shares the trainer's devices.
    `groups`: scores the rows it names a group at a time (`run_round`). `beside_round`:
    work run while the round runs (the judge's canaries), done before the fleet rests.
    `spec`: the speculative tail, which hands the replicas their drafts around the round."""
    lending = lending_fleet if streaming.mode is StreamMode.BORROW else None
    if streaming.mode is StreamMode.BORROW and not can_borrow(lending):
        raise ValueError("stream mode borrow needs a fleet of >= 2 replicas (see can_borrow)")
    times = _Times(clock())
    plan = policy.plan(step)
    if between is not None:
        await between.before_round(plan)
    if spec is not None:
        await spec.before_round(plan)
    times.round = clock()
    await trainer.begin_step()
    feed = Feed(trainer, streaming, plan.groups_needed, observer, clock)
    borrow = Borrow(lending, streaming.borrow, plan, feed, clock) if lending is not None else None

    async def rollout() -> RoundResult:
        async with _beside(beside_round, f"beside-round:{step}"):
            result = await run_round(
                plan, engine, scorer, advantages, version=version, clock=clock,
                on_group=feed.add, observer=observer, overlap_reward=overlap_reward,
                on_response=borrow.on_response if borrow else None, groups=groups,
                on_finished=spec.finished if spec else None,
            )
        if spec:
            spec.end_round()
        if borrow:
            borrow.end_round()
        if resting_fleet is not None and resting_fleet.rest_level is not None:
            # Colocated: the rest of the training gets the devices vLLM had.
            await resting_fleet.rest(resting_fleet.rest_level)
        # Only a completed round releases the optimizer step: after a failure the feed
        # waits until cancelled, so no step is taken on a partial round's gradients.
        feed.end_round()
        return result

    result, stats, times.rolled = await _round_beside_training(step, rollout(), feed, borrow, lending_fleet, spec)
    if spec is not None:
        await spec.after_round(result)
    times.trained = clock()
    lent = borrow is not None and borrow.report is not None
    if lent and lending_fleet is not None:
        await lending_fleet.reclaim()
    capacity = engine.max_concurrency  # before a regroup for the next round
    policy.commit(result)
    sent = await _sync_weights(result, times, policy.next_kind(), engine, trainer, between,
                               weight_bucket_bytes, version, lent, resting_fleet)
    times.synced = clock()
    return _outcome(step, result, stats, times, trainer.version, capacity, feed, sent, borrow)


@contextlib.asynccontextmanager
async def _beside(work: Callable[[], Awaitable[None]] | None, name: str) -> AsyncIterator[None]:
    """`work` runs while the body does; the body's end waits for it (a judge asked for a
    verdict cannot sleep with the fleet), and a body that fails takes it with it."""
    if work is None:
        yield
        return
    task = asyncio.create_task(work(), name=name)
    try:
        yield
    except BaseException:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # the body's error counts
            await task
        raise
    await task


async def _round_beside_training(
    step: int, rollout: Coroutine[object, None, RoundResult], feed: Feed, borrow: Borrow | None,
    lending_fleet: Lending | None, spec: SpecTail | None = None,
) -> tuple[RoundResult, Mapping[str, float], float]:
    """The round and the trainer's feed side by side (and the lending, when borrowing,
    and the draft feed, when speculating), and when the round ended; on any failure the
    trainer drops the step and lent replicas come back."""
    try:
        async with asyncio.TaskGroup() as tg:
            round_task = tg.create_task(rollout, name=f"round:{step}")
            train_task = tg.create_task(feed.train(), name=f"train:{step}")
            if borrow:
                tg.create_task(borrow.run(), name=f"borrow:{step}")
            if spec:
                tg.create_task(spec.feed(), name=f"drafts:{step}")
            result = await round_task
            rolled = feed.clock()
    except BaseException:
        # The trainer thread finishes whatever call it was in, then drops the step's
        # gradients; shielded, so an interrupt still leaves the trainer reusable. Lent
        # replicas wake; their weights were dropped, so the fleet refuses to start a
        # round before a weight update reaches them.
        await asyncio.shield(feed.trainer.abandon_step())
        if borrow and borrow.report is not None and lending_fleet is not None:
            await asyncio.shield(lending_fleet.reclaim())
        raise
    return result, train_task.result(), rolled


async def _sync_weights(
    result: RoundResult, times: _Times, next_kind: RoundKind, engine: Engine,
    trainer: StepTrainer, between: BetweenRounds | None, bucket_bytes: int, version: int,
    lent: bool, resting_fleet: Resting | None,
) -> WeightTally:
    """The new weights into the engine: by the regroup `between` makes for the next
    round, or by the engine's update."""
    sent = WeightTally()
    new_version = trainer.version

    def weights() -> AsyncIterable[WeightBucket]:
        return sent.count(trainer.weight_buckets(bucket_bytes))

    synced = False
    if between is not None:
        rollout_s = times.rolled - times.round
        synced = await between.after_round(result, rollout_s, next_kind, weights, new_version)
    # A step with nothing to learn from takes no update, unless replicas dropped their
    # weights while lent or resting at level 2; replicas resting with their weights just wake.
    resting = resting_fleet.resting if resting_fleet is not None else None
    if not synced and (new_version != version or lent or (resting is not None and resting.drops_weights)):
        await engine.update_weights(weights(), new_version)
    elif not synced and resting_fleet is not None and resting:
        await resting_fleet.wake_from_rest()
    return sent


async def while_resting(
    resting_fleet: Resting | None, work: Callable[[], Awaitable[T]], resync: Callable[[], Awaitable[None]],
) -> T:
    """`work` that reads the trainer's whole state back onto its devices (a checkpoint's
    save) with the colocated fleet resting: beside an awake vLLM's KV cache that state
    does not fit, which is why it was moved out. The fleet rests as it does for training
    (level 2: the weights dropped, no host copy of them) and wakes as after every step,
    through `resync`, the weight sync (the trainer's state moves out again before the KV
    cache comes back). Resting at level 1 instead would back up every replica's weights
    to pinned host memory for the save, one copy per GPU: 236 GB a node for a 14B model
    on 8 GPUs, more than the sync it saves costs."""
    if resting_fleet is None or resting_fleet.rest_level is None:
        return await work()
    await resting_fleet.rest(resting_fleet.rest_level)
    try:
        return await work()
    finally:
        if resting_fleet.resting is not None and resting_fleet.resting.drops_weights:
            await resync()
        else:
            await resting_fleet.wake_from_rest()


def _outcome(
    step: int, result: RoundResult, stats: Mapping[str, float], times: _Times, version: int,
    capacity: int, feed: Feed, sent: WeightTally, borrow: Borrow | None,
) -> StepOutcome:
    return StepOutcome(
        step=step,
        round=result,
        train=stats,
        time_rollout_s=times.rolled - times.round,
        time_train_s=times.trained - times.rolled,
        time_sync_s=times.synced - times.trained,
        time_step_s=times.synced - times.start,
        version=version,
        capacity=capacity,
        time_train_busy_s=feed.busy_s,
        time_train_hidden_s=feed.hidden_s,
        sync_bytes=sent.bytes,
        sync_buckets=sent.buckets,
        time_regroup_s=times.round - times.start,
        **(borrow.migration() if borrow else {}),
    )
