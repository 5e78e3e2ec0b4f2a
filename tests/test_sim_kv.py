"""The virtual-time engine's KV memory, preemption and tensor parallelism, and several
replicas decoding side by side on one node."""

from __future__ import annotations

import asyncio

import pytest

from rpk.core.records import GenRequest, ReplicaStats
from rpk.sim import CostModel, SimEngine, SimEngineError, SimNode

FLAT = CostModel(base_s=0.01, per_seq_s=0.0)


def req(rid: str, max_tokens: int = 1000, prompt: int = 2) -> GenRequest:
    return GenRequest(rid, tuple(range(prompt)), max_tokens)


async def run_all(engine: SimEngine, requests: list[GenRequest]) -> dict[str, float]:
    """Every request to its end; the virtual time each finished at."""
    streams = await engine.start(requests)
    done: dict[str, float] = {}

    async def consume(rid: str) -> None:
        tokens = 0
        async for d in streams[rid]:
            tokens += len(d.token_ids)
        done[rid] = engine.clock.now()
        assert tokens == engine.length_of(next(r for r in requests if r.request_id == rid))

    await asyncio.gather(*(consume(r.request_id) for r in requests))
    return done


def test_kv_capacity_grows_with_tp_by_more_than_the_devices():
    cost = CostModel(kv_tokens=1000, weight_tokens=600)
    assert [cost.kv_capacity(tp) for tp in (1, 2, 4)] == [1000, 2600, 5800]
    assert CostModel().kv_capacity(4) is None
    assert CostModel(base_s=0.01, per_seq_s=0.0, tp_comm_s=0.001).step_s(10, tp=2) == pytest.approx(0.006)
    with pytest.raises(ValueError, match="kv_tokens"):
        CostModel(kv_tokens=0)


def test_tp_communication_pays_latency_per_device_and_bytes_per_sequence():
    # A ring all-reduce moves 2 (tp - 1) / tp of each sequence's activations per device.
    cost = CostModel(base_s=0.012, per_seq_s=0.0, tp_comm_s=0.001, tp_comm_per_seq_s=1e-4)
    assert cost.step_s(10, tp=1) == 0.012
    assert cost.step_s(10, tp=2) == pytest.approx(0.006 + 0.001 + 10 * 1e-4)
    assert cost.step_s(10, tp=4) == pytest.approx(0.003 + 0.003 + 10 * 1e-4 * 1.5)


async def test_without_room_the_last_admitted_request_is_preempted_and_recomputed():
    # Two requests of 2 + 60 tokens in a cache of 100: both fit until their 49th step
    # (2 x (2 + 48) = 100); then b, admitted last, is preempted and waits for a.
    cost = CostModel(base_s=0.01, per_seq_s=0.0, kv_tokens=100, prefill_token_s=0.001)
    engine = SimEngine(lambda r: 60, cost=cost, max_concurrency=8)
    done = await run_all(engine, [req("a", 64), req("b", 64)])
    assert engine.preemptions == 1
    # a: prefill of 2 tokens with b's (4 x 1 ms), then 60 steps
    assert done["a"] == pytest.approx(0.004 + 0.6)
    # b: 48 tokens before it was preempted; back when a ended, recomputing 2 + 48 tokens,
    # then its last 12 steps
    assert done["b"] == pytest.approx(done["a"] + 0.01 + 0.050 + 11 * 0.01)
    assert engine.tokens_generated == 120 and engine.kv_used == 0
    stats = engine.take_stats()
    assert stats == ReplicaStats(preemptions=1, kv_usage_max=1.0, tokens_generated=120)
    assert engine.take_stats() == ReplicaStats(0, 0.0, 0)  # read since the last call
    await engine.shutdown()


async def test_the_same_requests_preempt_less_at_tp2():
    cost = CostModel(base_s=0.01, per_seq_s=1e-4, kv_tokens=400, weight_tokens=200,
                     prefill_token_s=1e-4, tp_comm_s=0.001)
    requests = [req(f"r{i}", max_tokens=200, prompt=16) for i in range(16)]
    counts = {}
    for tp in (1, 2):
        engine = SimEngine(lambda r: 100 + int(r.request_id[1:]) * 5, cost=cost, tp=tp)
        await run_all(engine, requests)
        counts[tp] = (engine.preemptions, engine.clock.now())
        await engine.shutdown()
    (pre1, t1), (pre2, t2) = counts[1], counts[2]
    assert pre1 > pre2 and t2 < t1


async def test_a_request_larger_than_the_cache_is_refused():
    engine = SimEngine(lambda r: 10, cost=CostModel(kv_tokens=100), tp=1)
    with pytest.raises(ValueError, match="exceeds the KV cache of a TP-1 replica"):
        await engine.start([req("big", max_tokens=99, prompt=2)])
    await engine.shutdown()


async def test_replicas_on_one_node_decode_side_by_side():
    node = SimNode()
    a = SimEngine(lambda r: 100, cost=FLAT, node=node)
    b = SimEngine(lambda r: 50, cost=FLAT, node=node)
    assert a.clock is b.clock
    (done_a, done_b) = await asyncio.gather(run_all(a, [req("x")]), run_all(b, [req("y")]))
    assert done_a["x"] == pytest.approx(1.0) and done_b["y"] == pytest.approx(0.5)
    assert a.steps == 100 and b.steps == 50
    await a.shutdown()
    assert node.running  # b still holds the node
    await b.shutdown()
    assert not node.running


async def test_an_abort_on_one_replica_lands_mid_way_through_anothers_steps():
    # a steps every 30 ms; b every 10 ms: b's finishing at 0.1 s (mid-step for a)
    # triggers the abort of a's request, which keeps the 3 steps a completed.
    node = SimNode()
    a = SimEngine(lambda r: 1000, cost=CostModel(base_s=0.03, per_seq_s=0.0), node=node, chunk=1000)
    b = SimEngine(lambda r: 10, cost=FLAT, node=node)
    streams = await a.start([req("long")])

    async def abort_when_b_done() -> None:
        await run_all(b, [req("short")])
        await a.abort("long")

    deltas, _ = await asyncio.gather(
        asyncio.ensure_future(_collect(streams["long"])), abort_when_b_done()
    )
    assert deltas[-1].finish_reason == "abort" and sum(len(d.token_ids) for d in deltas) == 3
    assert node.clock.now() == pytest.approx(0.1)
    await a.shutdown()
    await b.shutdown()


async def _collect(stream):
    return [d async for d in stream]


async def test_operations_of_replicas_together_overlap_in_time():
    node = SimNode()
    cost = CostModel(base_s=0.01, per_seq_s=0.0, sync_s=2.0, sleep_s=0.5, wake_s=1.0)
    replicas = [SimEngine(lambda r: 1, cost=cost, node=node) for _ in range(4)]
    await asyncio.gather(*(r.load_weights(3) for r in replicas))
    assert node.clock.now() == pytest.approx(2.0) and {r.weight_version for r in replicas} == {3}
    await asyncio.gather(*(r.sleep() for r in replicas))
    assert node.clock.now() == pytest.approx(2.5) and {r.weight_version for r in replicas} == {None}
    with pytest.raises(SimEngineError, match="asleep"):
        await replicas[0].start([req("z")])
    await asyncio.gather(*(r.wake() for r in replicas))
    assert node.clock.now() == pytest.approx(3.5)
    for r in replicas:
        await r.shutdown()
