"""Completed groups on their way into the trainer while the round still generates.

Stream modes (`StreamMode`): `none` trains after the round; `thread` trains completed
groups on the trainer thread beside the engine while the tail generates; `borrow` (the
paper's stream trainer) waits for the trigger (`rpk.sched.borrow`), has the fleet lend
half its replicas (their requests move to the others, `Lending.lend`), and only then
trains, on the devices those replicas freed; the fleet takes them back after the round.
`Feed` is the queue and the trainer's side of a round; `Borrow` the lending.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from rpk.core.modes import StreamMode
from rpk.core.outcomes import MigrationReport, RoundPlan
from rpk.core.protocols import Lending, StepTrainer
from rpk.core.records import FinishReason, Group, TrainSample
from rpk.loop.rollout import RoundObserver
from rpk.sched.borrow import BorrowRule, BorrowTrigger, lenders


class StepObserver(RoundObserver, Protocol):
    def training(self, done_samples: int, total_samples: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Streaming:
    """When and where the trainer starts on a round's completed groups.

    `none`: after rollout. `thread`: once `start_frac` of the round's groups are
    complete (the paper starts between 20% and 50%: early enough to hide the trainer
    behind the tail, late enough that groups keep arriving so it does not idle), on the
    trainer thread, while the rest of the round generates. `borrow`: once `borrow`'s
    trigger fires and the fleet has lent half its replicas. Either way in chunks of about
    `chunk_tokens` tokens; what is still waiting when the round ends is trained after
    it, exposed: smaller chunks leave less, at some cost in micro-batch efficiency."""

    mode: StreamMode = StreamMode.THREAD
    start_frac: float = 0.0
    chunk_tokens: int = 1024
    borrow: BorrowRule = BorrowRule()
    # borrow, sharded trainer: the ranks on the lent replicas' devices (replica names ->
    # ranks, or None where they cannot compute alone); they alone train until the round
    # ends, every rank after it. None: the trainer computes where it always does.
    trainer_ranks: Callable[[Sequence[str]], Sequence[int] | None] | None = None

    def __post_init__(self) -> None:
        if self.mode not in set(StreamMode):
            raise ValueError(
                f"mode must be one of {', '.join(StreamMode)}, got {self.mode!r}"
            )
        object.__setattr__(self, "mode", StreamMode(self.mode))
        if not 0 <= self.start_frac <= 1:
            raise ValueError(f"start_frac must be in [0, 1], got {self.start_frac!r}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens!r}")


def can_borrow(fleet: Lending | None) -> bool:
    """borrow mode needs a fleet that can lend and a replica left to generate."""
    return fleet is not None and len(fleet.in_flight) >= 2


def train_samples(groups: Sequence[Group]) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_ids=g.prompt.token_ids,
            response_ids=m.response.token_ids,
            old_logprobs=m.response.logprobs,
            advantage=a,
            truncated=m.response.finish_reason is FinishReason.LENGTH,
            loss_mask=m.response.loss_mask,
        )
        for g in groups
        for m, a in zip(g.members, g.advantages)
    ]


class Feed:
    """Completed groups on their way into the trainer: filled by the round's `on_group`
    callback, drained by `train`, which runs beside the round in the step's TaskGroup."""

    def __init__(
        self, trainer: StepTrainer, streaming: Streaming, groups_needed: int,
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
        if self.s.mode is StreamMode.BORROW:
            return self.borrowed
        return self.s.mode is StreamMode.THREAD and self.groups_seen >= self.start_at

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
                await self._accumulate(chunk)
                continue
            if self.round_over:
                break
            self.arrived.clear()
            await self.arrived.wait()
        started = self.clock()
        stats = await self.trainer.finish_step()
        self.busy_s += self.clock() - started
        return stats

    async def _accumulate(self, chunk: list[TrainSample]) -> None:
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


class Borrow:
    """borrow mode's driver for one round: feeds the trigger each accepted response;
    once it fires, has the fleet lend and opens the feed."""

    def __init__(self, fleet: Lending, rule: BorrowRule, plan: RoundPlan, feed: Feed,
                 clock: Callable[[], float]) -> None:
        self.fleet = fleet
        self.trigger = BorrowTrigger(rule, plan.groups_needed * plan.group_size)
        self.feed = feed
        self.clock = clock
        self.done = 0
        self.wake = asyncio.Event()
        self.over = False
        self.report: MigrationReport | None = None

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
        names = self.fleet.replica_names(self.report.lent)
        if ranks_of is not None and (ranks := ranks_of(names)) is not None:
            await self.feed.trainer.compute_on(ranks)
            self.feed.narrowed = True
        self.feed.lent()

    def migration(self) -> dict[str, float | MigrationReport | None]:
        """The step outcome's borrow fields (`StepOutcome`)."""
        r = self.report
        return {"borrow_frac": self.trigger.fired_at_frac if r is not None else None, "migration": r}
