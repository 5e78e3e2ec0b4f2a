"""Round bookkeeping at the scale of a 128-GPU round: 16k+ requests.

Every event must cost the `RoundBook` O(1) (plus the ids it hands back): a scan of all
requests per event is quadratic, seconds of event-loop time per round at this size."""

from __future__ import annotations

import time
import zlib

from rpk.core.outcomes import RoundPlan
from rpk.core.records import FinishReason, Prompt, RequestState, Response, RoundKind, Scored
from rpk.loop.rollout import run_round
from rpk.sched.round import RoundBook
from rpk.sim import CostModel, SimEngine
from tests.fakes import LengthScorer, mean_centred
from tests.helpers import index_of, prompt_of


def _plan(prompts: int) -> RoundPlan:
    return RoundPlan(
        step=1, kind=RoundKind.SHORT, prompts=tuple(Prompt(f"p{i}", (7, i), "t", "") for i in range(prompts)),
        responses_per_prompt=10, group_size=8, groups_needed=prompts * 4 // 5, max_tokens=64,
    )


def _length(pos: int, j: int) -> int:
    return 8 + zlib.crc32(f"{pos}:{j}".encode()) % 40


def _drive(prompts: int) -> tuple[float, int]:
    """A whole short round of events on the book alone, in finishing order; returns the
    seconds spent in the book and the number of events."""
    plan = _plan(prompts)
    book = RoundBook(plan, mean_centred)
    order = sorted(book.requests, key=lambda rid: (_length(*_pos_j(rid)), rid))
    events = 0
    started = time.perf_counter()
    for rid in book.requests:
        book.started(rid, 0.0)
        events += 1
    for t, rid in enumerate(order):
        if book.done:
            break
        if book.requests[rid].state is not RequestState.RUNNING:
            continue
        pos, j = _pos_j(rid)
        response = Response(plan.prompts[pos], j, (1,), (-0.1,), FinishReason.STOP, 0)
        accepted, to_abort = book.finished(rid, response, float(t))
        events += 1
        for other in to_abort:
            book.aborted(other, float(t))
            events += 1
        if accepted:
            book.scored(pos, Scored(response, float(j % 2), bool(j % 2)))
            events += 1
    for rid in book.unfinished():
        book.aborted(rid, float(len(order)))
        events += 1
    took = time.perf_counter() - started
    assert book.done and not book.any_unfinished
    assert book.count(RequestState.FINISHED) + book.count(RequestState.ABORTED) == len(book.requests)
    return took, events


def _pos_j(rid: str) -> tuple[int, int]:
    _, p, r = rid.split("-")
    return int(p[1:]), int(r[1:])


def test_bookkeeping_cost_per_event_does_not_grow_with_the_round() -> None:
    small_s, small_n = min(_drive(205) for _ in range(3))  # 2,050 requests
    big_s, big_n = min(_drive(1640) for _ in range(3))  # 16,400 requests
    per_small, per_big = small_s / small_n, big_s / big_n
    # Linear bookkeeping keeps the per-event cost flat; a scan per event makes it grow
    # with the round (8x here). 3x leaves room for a noisy machine.
    assert per_big < 3 * per_small, (per_small, per_big)
    assert per_big < 100e-6, per_big


async def test_a_16k_request_round_on_virtual_time() -> None:
    plan = _plan(1640)
    engine = SimEngine(
        lambda r: _length(prompt_of(r), index_of(r)), cost=CostModel(base_s=0.01, per_seq_s=0.0),
        max_concurrency=20_000, chunk=16,
    )
    try:
        result = await run_round(plan, engine, LengthScorer(30), mean_centred, version=0, clock=engine.clock)
    finally:
        await engine.shutdown()
    assert result.launched == 16_400
    assert len(result.groups) == plan.groups_needed
    assert result.finished + result.aborted == result.launched
    assert not engine.running and not engine.waiting
    # The round ends at the plan's groups: with 10 launched for 8, no group waits for
    # its slowest responses, so the longest possible (47 tokens) is never needed.
    assert result.ended_at < 47 * 0.01
