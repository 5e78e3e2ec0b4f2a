"""The virtual-time engine on its own: batching, admission, step-time accounting, aborts,
failures, determinism and its own lifecycle."""

from __future__ import annotations

import asyncio
import time

import pytest

from rpk.core.records import GenRequest
from rpk.sim import CostModel, SimEngine, SimEngineError
from tests.fakes import one_bucket

FLAT = CostModel(base_s=0.01, per_seq_s=0.0)


def req(rid: str, max_tokens: int = 1000) -> GenRequest:
    return GenRequest(rid, (1, 2), max_tokens)


def lengths(table: dict[str, int]):
    return lambda r: table[r.request_id]


async def consume(engine: SimEngine, request: GenRequest, log: list | None = None):
    """Stream one request; returns (deltas, virtual time of the last one)."""
    deltas = []
    stream = (await engine.start([request]))[request.request_id]
    async for d in stream:
        deltas.append(d)
        if log is not None:
            log.append((engine.clock.now(), d.request_id, len(d.token_ids), d.finish_reason))
    return deltas, engine.clock.now()


async def test_one_request_of_100_tokens_takes_100_steps_of_virtual_time():
    engine = SimEngine(lengths({"a": 100}), cost=FLAT, chunk=16)
    t0 = time.perf_counter()
    deltas, done_at = await consume(engine, req("a"))
    assert time.perf_counter() - t0 < 0.5  # no real sleeping
    assert done_at == pytest.approx(1.0)
    assert [len(d.token_ids) for d in deltas] == [16] * 6 + [4]
    assert sum((d.token_ids for d in deltas), ()) == tuple(range(100))
    assert all(lp == -0.5 for d in deltas for lp in d.logprobs)
    assert [d.finished for d in deltas] == [False] * 6 + [True]
    assert deltas[-1].finish_reason == "stop"
    assert engine.steps == 100 and engine.tokens_generated == 100
    await engine.shutdown()


async def test_max_tokens_caps_the_response_with_finish_reason_length():
    engine = SimEngine(lengths({"a": 500}), cost=FLAT)
    deltas, done_at = await consume(engine, req("a", max_tokens=40))
    assert sum(len(d.token_ids) for d in deltas) == 40
    assert deltas[-1].finish_reason == "length" and done_at == pytest.approx(0.4)
    await engine.shutdown()


async def test_step_time_depends_on_the_batch():
    # a=0.01, b=0.005: 10 steps of two sequences (0.02 s each), then 10 of one (0.015 s)
    engine = SimEngine(lengths({"a": 10, "b": 20}), cost=CostModel(base_s=0.01, per_seq_s=0.005))
    (_, a_at), (_, b_at) = await asyncio.gather(
        consume(engine, req("a")), consume(engine, req("b"))
    )
    assert a_at == pytest.approx(0.2)
    assert b_at == pytest.approx(0.35)
    assert engine.decode_s == pytest.approx(0.35) and engine.steps == 20
    await engine.shutdown()


async def test_prefill_is_paid_once_per_admitted_sequence_in_its_first_step():
    cost = CostModel(base_s=0.01, per_seq_s=0.0, prefill_s=0.1)
    engine = SimEngine(lengths({"a": 10, "b": 10}), cost=cost)
    (_, a_at), (_, b_at) = await asyncio.gather(
        consume(engine, req("a")), consume(engine, req("b"))
    )
    assert a_at == b_at == pytest.approx(2 * 0.1 + 10 * 0.01)
    await engine.shutdown()


async def test_concurrency_cap_and_fifo_admission():
    # one slot: requests run one after another in arrival order, the short last one too
    table = {"a": 30, "b": 20, "c": 5}
    engine = SimEngine(lengths(table), cost=FLAT, max_concurrency=1)
    results = await asyncio.gather(*(consume(engine, req(r)) for r in table))
    assert [t for _, t in results] == pytest.approx([0.3, 0.5, 0.55])
    assert engine.admitted_at == pytest.approx({"a": 0.0, "b": 0.3, "c": 0.5})
    assert engine.peak_running == 1

    engine2 = SimEngine(lambda r: 10, cost=FLAT, max_concurrency=4)
    results = await asyncio.gather(*(consume(engine2, req(f"r{i}")) for i in range(10)))
    # 10 requests through 4 slots: three waves of 10 steps
    assert [t for _, t in results] == pytest.approx([0.1] * 4 + [0.2] * 4 + [0.3] * 2)
    assert engine2.peak_running == 4 and engine2.steps == 30
    await engine.shutdown()
    await engine2.shutdown()


async def test_abort_frees_the_slot_for_the_next_waiting_request():
    engine = SimEngine(lengths({"long": 1000, "short": 10}), cost=FLAT, max_concurrency=1)
    log: list = []
    long_task = asyncio.create_task(consume(engine, req("long"), log))
    short_task = asyncio.create_task(consume(engine, req("short"), log))
    await engine.clock.sleep_until(0.05)
    assert engine.clock.now() == pytest.approx(0.05)  # the engine stopped at the deadline
    assert engine.running == {"long"} and engine.waiting == ("short",)
    await engine.abort("long")
    deltas, _ = await long_task
    assert deltas[-1].finish_reason == "abort" and sum(len(d.token_ids) for d in deltas) == 5
    _, short_at = await short_task
    assert short_at == pytest.approx(0.15)
    assert engine.aborted == ["long"] and engine.steps == 15
    await engine.shutdown()


async def test_a_cancelled_consumer_frees_its_slot_without_an_abort_call():
    engine = SimEngine(lengths({"long": 1000, "short": 10}), cost=FLAT, max_concurrency=1)
    long_task = asyncio.create_task(consume(engine, req("long")))
    short_task = asyncio.create_task(consume(engine, req("short")))
    await engine.clock.sleep_until(0.2)
    long_task.cancel()
    _, short_at = await short_task
    assert short_at == pytest.approx(0.3)
    assert engine.running == frozenset() and engine.waiting == ()
    await engine.shutdown()


async def test_fail_after_raises_in_the_stream_at_its_virtual_time():
    engine = SimEngine(
        lengths({"bad": 100, "ok": 100}),
        cost=FLAT,
        fail_after=lambda r: 30 if r.request_id == "bad" else None,
    )
    ok_task = asyncio.create_task(consume(engine, req("ok")))
    with pytest.raises(SimEngineError, match="after 30 tokens"):
        await consume(engine, req("bad"))
    assert engine.clock.now() == pytest.approx(0.3) and engine.failed == ["bad"]
    _, ok_at = await ok_task
    assert ok_at == pytest.approx(1.0)
    await engine.shutdown()


async def test_engine_idles_without_requests_and_its_loop_is_owned():
    engine = SimEngine(lambda r: 10, cost=FLAT)
    assert not engine.loop_running  # started lazily
    await consume(engine, req("a"))
    assert engine.loop_running
    now, steps = engine.clock.now(), engine.steps
    for _ in range(100):
        await asyncio.sleep(0)
    assert engine.clock.now() == now and engine.steps == steps  # no steps without requests
    await engine.update_weights(one_bucket({}), 3)
    assert engine.weight_version == 3 and engine.weight_updates == [(now, 3)]
    await engine.shutdown()
    assert not engine.loop_running
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "sim-engine"]
    with pytest.raises(SimEngineError, match="shut down"):
        await consume(engine, req("b"))


async def test_shutdown_fails_the_streams_still_running():
    engine = SimEngine(lambda r: 10_000, cost=FLAT)
    task = asyncio.create_task(consume(engine, req("a")))
    await engine.clock.sleep_until(1.0)
    await engine.shutdown()
    with pytest.raises(SimEngineError, match="shut down"):
        await task


async def test_weight_sync_costs_virtual_time():
    engine = SimEngine(lambda r: 10, cost=CostModel(base_s=0.01, per_seq_s=0.0, sync_s=2.5))
    await engine.update_weights(one_bucket({"w": 1}), 1)
    assert engine.clock.now() == pytest.approx(2.5)
    await engine.shutdown()


def test_validation_names_the_offending_values():
    with pytest.raises(ValueError, match="per_seq_s"):
        CostModel(per_seq_s=-1.0)
    with pytest.raises(ValueError, match="must take time"):
        CostModel(base_s=0.0, per_seq_s=0.0)
    with pytest.raises(ValueError, match="max_concurrency"):
        SimEngine(lambda r: 1, max_concurrency=0)


async def test_bad_requests_fail_alone():
    engine = SimEngine(lambda r: 0 if r.request_id == "empty" else 5, cost=FLAT)
    with pytest.raises(ValueError, match="'empty'.* is 0"):
        await consume(engine, req("empty"))
    task = asyncio.create_task(consume(engine, req("dup")))
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="already in the engine"):
        await consume(engine, req("dup"))
    deltas, _ = await task
    assert deltas[-1].finish_reason == "stop"
    await engine.shutdown()


async def _mixed_workload() -> list:
    engine = SimEngine(
        lambda r: 3 + (int(r.request_id[1:]) * 37) % 90,
        cost=CostModel(base_s=0.01, per_seq_s=0.001, prefill_s=0.003),
        max_concurrency=7,
        chunk=5,
    )
    log: list = []
    tasks = [asyncio.create_task(consume(engine, req(f"r{i}"), log)) for i in range(40)]
    await engine.clock.sleep_until(0.4)
    for i in (3, 11, 12):
        tasks[i].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.shutdown()
    return log + [("end", engine.clock.now(), engine.steps, engine.tokens_generated)]


async def test_same_inputs_give_the_same_virtual_timings():
    first, second = await _mixed_workload(), await _mixed_workload()
    assert first == second
    assert len(first) > 100


async def test_a_large_round_runs_in_a_fraction_of_a_real_second():
    engine = SimEngine(lambda r: 150 + (int(r.request_id[1:]) * 7919) % 150, max_concurrency=512)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(consume(engine, req(f"r{i}", 300)) for i in range(400)))
    real = time.perf_counter() - t0
    print(f"400 requests x <=300 tokens: {real:.3f} s real, {engine.clock.now():.2f} s virtual")
    assert engine.tokens_generated == sum(sum(len(d.token_ids) for d in ds) for ds, _ in results)
    assert real < 2.0  # typically ~0.1 s; generous for shared cores
    await engine.shutdown()
