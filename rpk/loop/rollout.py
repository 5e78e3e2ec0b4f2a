"""The async driver of one rollout round.

One task per request, all owned by one TaskGroup. Each task streams its response from
the engine, reports to the `RoundBook`, and scores its response the moment it is
accepted, so reward overlaps the rest of the round. When the book says a request is no
longer needed its task is cancelled, which aborts the request in the engine. Whatever
way the round ends (done, an engine error, outside cancellation) no request is left
running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Protocol

from rpk.core.outcomes import RoundPlan, RoundResult
from rpk.core.protocols import Engine, GroupScorer, Scorer
from rpk.core.records import (
    Carried,
    FinishReason,
    GenDelta,
    Group,
    RequestState,
    Response,
    TurnStats,
)
from rpk.sched.round import RequestRecord, RoundBook


class EngineError(RuntimeError):
    """The engine broke a promise of the Engine protocol; the run stops."""


class Received:
    """What one request's stream has delivered so far: tokens, their log-probs and text,
    which of them are observations (a multi-turn trajectory's), and the finish reason
    and turn counts once a delta carried them."""

    __slots__ = ("token_ids", "logprobs", "text", "reason", "observed", "turns", "accepted")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.reason: FinishReason | None = None
        self.observed: list[tuple[int, int]] = []  # (start, end) of each observation
        self.turns: TurnStats | None = None
        self.accepted = 0  # drafted tokens accepted (speculative decoding)

    def add(self, delta: GenDelta) -> None:
        if delta.observation:
            self.observed.append((len(self.token_ids), len(self.token_ids) + len(delta.token_ids)))
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.text.append(delta.text)
        if delta.finished:
            self.reason = delta.finish_reason
            self.turns = delta.turns
            self.accepted = delta.accepted

    def loss_mask(self) -> tuple[int, ...]:
        """0 on observation tokens, 1 on the model's; empty when all are the model's."""
        if not self.observed:
            return ()
        mask = [1] * len(self.token_ids)
        for start, end in self.observed:
            mask[start:end] = [0] * (end - start)
        return tuple(mask)

    def finish(self, rid: str) -> FinishReason:
        """The finish reason; EngineError when the stream ended without one (or aborted)."""
        if self.reason is None or self.reason is FinishReason.ABORT:
            raise EngineError(f"request {rid}: stream ended without a finished output ({self.reason})")
        return self.reason


def _behind(total: int, mask: tuple[int, ...]) -> tuple[int, ...]:
    """A mask of the tokens received, behind a carried prefix (the model's own tokens)."""
    return (1,) * (total - len(mask)) + mask if mask else ()


class RoundObserver(Protocol):
    """Progress hooks (the live display); all optional work, never awaited."""

    def round_started(self, plan: RoundPlan) -> None: ...

    def response_finished(self, tokens: int) -> None: ...

    def group_completed(self, group: Group) -> None: ...


@dataclass(eq=False, slots=True)
class _Driver:
    book: RoundBook
    engine: Engine
    scorer: Scorer
    version: int
    clock: Callable[[], float]
    on_group: Callable[[Group], None] | None
    observer: RoundObserver | None
    overlap_reward: InitVar[bool]
    on_response: Callable[[], None] | None = None
    on_finished: Callable[[Response], None] | None = None
    groups: GroupScorer | None = None
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Accepted responses of the prompts scored a group at a time, until the last comes.
    waiting: dict[int, list[Response]] = field(default_factory=dict)
    reward_busy_s: float = 0.0
    last_response_at: float = 0.0
    last_scored_at: float = 0.0
    # Scoring waits for this when reward does not overlap generation (the baseline).
    generation_over: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self, overlap_reward: bool) -> None:
        if overlap_reward:
            self.generation_over.set()

    async def run(self) -> None:
        requests = [rec.request for rec in self.book.requests.values()]
        streams = await self.engine.start(requests) if requests else {}
        try:
            async with asyncio.TaskGroup() as tg:
                for pos, response in self.book.carried_finished:
                    tg.create_task(
                        self._score(pos, response, self.clock()),
                        name=f"score:s{self.book.plan.step}-p{pos}-r{response.index}",
                    )
                for rid, stream in streams.items():
                    self.tasks[rid] = tg.create_task(self._request(rid, stream), name=f"rollout:{rid}")
                self._check_generation_over()
        finally:
            # Tasks cancelled before they ever ran never reached their own bookkeeping,
            # and their requests still run in the engine.
            for rid in self.book.unfinished():
                self.book.aborted(rid, self.clock())
                await asyncio.shield(self.engine.abort(rid))

    def _cancel(self, rids: Sequence[str]) -> None:
        for rid in rids:
            task = self.tasks.get(rid)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _check_generation_over(self) -> None:
        if self.book.generation_complete or not self.book.any_unfinished:
            self.generation_over.set()

    def _cut(self, rec: RequestRecord, got: Received) -> Carried:
        p = rec.prefix
        return Carried(
            index=rec.index,
            token_ids=(p.token_ids if p else ()) + tuple(got.token_ids),
            logprobs=(p.logprobs if p else ()) + tuple(got.logprobs),
            versions=(p.versions if p else ()) + (self.version,) * len(got.token_ids),
            text=(p.text if p else "") + "".join(got.text),
        )

    async def _request(self, rid: str, stream: AsyncIterator[GenDelta]) -> None:
        rec = self.book.requests[rid]
        got = Received()
        self.book.started(rid, self.clock())
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    got.add(delta)
                    # An observation is context the model did not generate: not counted
                    # as generated (nor, aborted, as wasted) work.
                    sampled = 0 if delta.observation else len(delta.token_ids)
                    to_abort = self.book.progressed(rid, sampled)
                    if to_abort:
                        self._cancel(to_abort)
                        if rid in to_abort:  # this response can no longer be accepted
                            await self._abort(rec, got)
                            return
                    if delta.finished:
                        break
        except asyncio.CancelledError:
            # A request that gave itself up may be cancelled while its stream closes (a
            # trajectory's close waits on its environment): it is aborted already.
            if rec.state is not RequestState.ABORTED:
                await self._abort(rec, got)
            raise
        except BaseException:
            self.book.failed(rid, self.clock())
            raise
        try:
            reason = got.finish(rid)
            if len(got.logprobs) != len(got.token_ids):
                raise EngineError(
                    f"request {rid}: {len(got.token_ids)} tokens but {len(got.logprobs)} logprobs")
        except EngineError:
            self.book.failed(rid, self.clock())
            raise
        now = self.clock()
        whole = self._cut(rec, got)
        response = Response(
            prompt=self.book.plan.prompts[rec.prompt_pos],
            index=rec.index,
            token_ids=whole.token_ids,
            logprobs=whole.logprobs,
            finish_reason=reason,
            version=self.version,
            text=whole.text,
            token_versions=whole.versions if rec.prefix else (),
            loss_mask=_behind(len(whole.token_ids), got.loss_mask()),
            turns=got.turns,
        )
        accepted, to_abort = self.book.finished(rid, response, now, got.accepted)
        if self.on_finished:
            self.on_finished(response)
        if self.observer:
            self.observer.response_finished(len(got.token_ids))
        self._cancel(to_abort)
        self._check_generation_over()
        if accepted:
            self.last_response_at = now
            if self.on_response:
                self.on_response()
            await self._score(rec.prompt_pos, response, now)

    async def _abort(self, rec: RequestRecord, got: Received) -> None:
        rid = rec.request.request_id
        self.book.aborted(rid, self.clock(), self._cut(rec, got))
        self._check_generation_over()
        await asyncio.shield(self.engine.abort(rid))

    async def _score(self, pos: int, response: Response, finished_at: float) -> None:
        await self.generation_over.wait()
        if self.groups is not None and self.groups.by_group(response.prompt):
            # The book accepts at most a group's worth of a prompt's responses: the last
            # of them scores them all. A prompt the round leaves short is never scored.
            waiting = self.waiting.setdefault(pos, [])
            waiting.append(response)
            if len(waiting) < self.book.plan.group_size:
                return
            members = sorted(self.waiting.pop(pos), key=lambda r: r.index)
            started = self.clock()
            scored = await self.groups.score_group(members)
        else:
            started = self.clock()
            scored = [await self.scorer.score(response)]
        done_at = self.clock()
        self.reward_busy_s += done_at - started
        self.last_scored_at = max(self.last_scored_at, done_at)
        group = None
        for one in scored:
            group = self.book.scored(pos, one) or group
        if group is None:
            return
        if self.on_group:
            self.on_group(group)
        if self.observer:
            self.observer.group_completed(group)
        if self.book.done:
            self._cancel([r for r, t in self.tasks.items() if not t.done()])


async def run_round(
    plan: RoundPlan,
    engine: Engine,
    scorer: Scorer,
    advantages: Callable[[Sequence[float]], list[float]],
    *,
    version: int,
    clock: Callable[[], float] = time.monotonic,
    on_group: Callable[[Group], None] | None = None,
    observer: RoundObserver | None = None,
    overlap_reward: bool = True,
    on_response: Callable[[], None] | None = None,
    on_finished: Callable[[Response], None] | None = None,
    groups: GroupScorer | None = None,
) -> RoundResult:
    """Run one round to its plan's end; complete groups also go to `on_group` as they
    complete, which is where streaming hand-offs attach, and each accepted response
    calls `on_response` (the borrowing trainer's trigger counts them); every finished
    response, accepted or not, goes to `on_finished` (the speculative tail's draft
    feed: a finished sibling is a draft for those still running). With
    `overlap_reward=False` (a baseline for benchmarks) nothing is scored until
    generation is over. `groups` scores the rows it names a group at a time (group
    judging), once a prompt's last response has finished."""
    book = RoundBook(plan, advantages)
    driver = _Driver(book, engine, scorer, version, clock, on_group, observer, overlap_reward,
                     on_response, on_finished, groups)
    if observer:
        observer.round_started(plan)
    started = clock()
    await driver.run()
    ended = clock()
    # Under dynamic sampling a round may run out of requests with groups dropped.
    if not book.done and not plan.drop_zero_variance:
        raise EngineError(
            f"round of step {plan.step} ended with {len(book.groups)} of "
            f"{plan.groups_needed} groups complete"
        )
    return RoundResult(
        plan=plan,
        groups=tuple(book.groups),
        timeline=tuple(book.timeline),
        launched=len(book.requests),
        finished=book.count(RequestState.FINISHED),
        aborted=book.count(RequestState.ABORTED),
        tokens_generated=book.tokens_generated,
        tokens_aborted=book.tokens_aborted,
        started_at=started,
        ended_at=ended,
        last_response_at=driver.last_response_at or ended,
        reward_busy_s=driver.reward_busy_s,
        reward_exposed_s=max(0.0, driver.last_scored_at - driver.last_response_at),
        incomplete=tuple(book.incomplete_prompts()),
        carry=book.carry_over() if plan.keep_partial else (),
        dropped=tuple(book.dropped),
        tokens_carried=book.tokens_carried,
        version=version,
        finishes=tuple(book.finishes),
        lengths=book.prompt_lengths(),
    )
