"""One RL step: a rollout round (with reward overlapped), training on its groups as they
complete (streaming), one optimizer step once the round is over, weight sync to the
engine. Every sample is trained under the weights that generated it: gradients pile up
during the round and the optimizer steps only after its last group."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Protocol, Sequence

from rpk.core.protocols import Engine, Scorer, Trainer, WeightBucket
from rpk.core.records import FinishReason, Group, TrainSample
from rpk.loop.rollout import RoundObserver, run_round
from rpk.sched.policy import Policy
from rpk.sched.round import RoundPlan, RoundResult


class StepObserver(RoundObserver, Protocol):
    def training(self, done_samples: int, total_samples: int) -> None: ...


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
    time_train_busy_s: float = 0.0  # trainer busy, streamed part included
    time_train_hidden_s: float = 0.0  # trainer busy while the round still generated
    sync_bytes: int = 0  # weights sent to the engine after the update
    sync_buckets: int = 0
    time_regroup_s: float = 0.0  # `before_round`: the engine regrouped for this round


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

    async def weight_buckets(self, max_bytes: int) -> AsyncIterator[WeightBucket]:
        """The trainer's `weight_buckets`, each bucket made on the trainer thread."""
        buckets = await self.call(self.trainer.weight_buckets, max_bytes)
        while (bucket := await self.call(next, buckets, None)) is not None:
            yield bucket

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


@dataclass(frozen=True, slots=True)
class Streaming:
    """When the trainer starts on a round's completed groups.

    Off: after rollout, as veRL does. On: once `start_frac` of the round's groups are
    complete (the paper starts between 20% and 50%: early enough to hide the trainer
    behind the tail, late enough that groups keep arriving so it does not idle), in
    chunks of about `chunk_tokens` tokens, while the rest of the round generates. What
    is still waiting when the round ends is trained after it, exposed: smaller chunks
    leave less, at some cost in micro-batch efficiency."""

    enabled: bool = True
    start_frac: float = 0.0
    chunk_tokens: int = 1024

    def __post_init__(self) -> None:
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

    def add(self, group: Group) -> None:
        self.groups_seen += 1
        self.pending.extend(train_samples([group]))
        self.arrived.set()

    def end_round(self) -> None:
        self.round_over = True
        self.arrived.set()

    def _ready_chunk(self) -> list[TrainSample]:
        if self.round_over:
            chunk, self.pending = self.pending, []
            return chunk
        if not self.s.enabled or self.groups_seen < self.start_at:
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
    before_round: Callable[[RoundPlan], Awaitable[None]] | None = None,
) -> StepOutcome:
    """`before_round(plan)` runs once the round is planned and before it starts: where
    the rollout TP changes for the round's kind (`rpk.loop.elastic`)."""
    t0 = clock()
    plan = policy.plan(step)
    if before_round is not None:
        await before_round(plan)
    t_round = clock()
    await trainer.begin_step()
    feed = _Feed(trainer, streaming, plan.groups_needed, observer, clock)

    async def rollout() -> RoundResult:
        result = await run_round(
            plan, engine, scorer, advantages, version=version, clock=clock,
            on_group=feed.add, observer=observer, overlap_reward=overlap_reward,
        )
        # Only a round that completed releases the optimizer step; after a failure the
        # feed is left waiting and the TaskGroup cancels it, so no step is taken on a
        # partial round's gradients.
        feed.end_round()
        return result

    try:
        async with asyncio.TaskGroup() as tg:
            round_task = tg.create_task(rollout(), name=f"round:{step}")
            train_task = tg.create_task(feed.train(), name=f"train:{step}")
            result = await round_task
            t1 = clock()
    except BaseException:
        # The trainer thread finishes whatever call it was in, then drops the step's
        # gradients; shielded, so an interrupt still leaves the trainer reusable.
        await asyncio.shield(trainer.abandon_step())
        raise
    stats = train_task.result()
    t2 = clock()
    new_version = trainer.version
    sent = WeightTally()
    if new_version != version:  # a step with nothing to learn from takes no update
        await engine.update_weights(sent.count(trainer.weight_buckets(weight_bucket_bytes)), new_version)
    t3 = clock()
    policy.commit(result)
    return StepOutcome(
        step=step,
        round=result,
        train=stats,
        time_rollout_s=t1 - t_round,
        time_train_s=t2 - t1,
        time_sync_s=t3 - t2,
        time_step_s=t3 - t0,
        version=new_version,
        time_train_busy_s=feed.busy_s,
        time_train_hidden_s=feed.hidden_s,
        sync_bytes=sent.bytes,
        sync_buckets=sent.buckets,
        time_regroup_s=t_round - t0,
    )


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
