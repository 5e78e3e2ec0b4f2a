"""The real rollout driver, step and policies on the virtual-time engine: what scheduling
costs in (simulated) seconds, not just which prompts go where.

Prompts have token ids (7, i); a response's length is a function of (i, response index),
so the same response has the same length whatever round or policy launches it."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpk.core.outcomes import RoundPlan
from rpk.core.records import RoundKind
from rpk.loop.rollout import run_round
from rpk.obs.metrics import bubble_ratio
from rpk.sched.policy import LengthAwarePolicy, OversamplePolicy, Sampling, SyncPolicy, TailPolicy
from rpk.sched.provision import EtaBounds
from rpk.sim import CostModel, SimEngine, SimEngineError
from tests.fakes import LengthScorer, make_prompts, mean_centred
from tests.helpers import FLAT, assert_idle, index_of, prompt_of, run_steps, waiting


def jittered(base: dict[int, int]):
    """Each prompt has a base length; its responses spread 0..6 tokens above it."""
    return lambda r: base[prompt_of(r)] + zlib.crc32(f"{prompt_of(r)}:{index_of(r)}".encode()) % 7


def epoch_over(policy, p0: int):
    """Stop at the epoch boundary unless the queue still makes a long round (or, for
    length_aware, the last draw still has rounds to run)."""
    return lambda: policy.cursor.epoch >= 1 and len(waiting(policy)) < p0


def bubble(outcome, capacity: int) -> float:
    r = outcome.round
    return bubble_ratio(r.timeline, r.started_at, r.last_response_at, capacity)


async def test_short_round_ends_at_the_step_its_p0th_group_completes():
    # 5 prompts x 5 responses for P0=4 groups of R0=4. Response j of prompt i is
    # 10*(i+1) + 10*j tokens, prompt 4 is long: groups complete at steps 40, 50, 60, 70.
    prompts = make_prompts(5)
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=1024)
    policy = TailPolicy(prompts, sampling, shuffle=False)

    def length(r):
        i = prompt_of(r)
        return (500 if i == 4 else 10 * (i + 1)) + 10 * index_of(r)

    engine = SimEngine(length, cost=FLAT, max_concurrency=64, chunk=10)
    (outcome,) = await run_steps(policy, engine, 1)
    r = outcome.round
    assert r.plan.kind is RoundKind.SHORT
    assert sorted(g.prompt.uid for g in r.groups) == ["p0", "p1", "p2", "p3"]
    assert r.ended_at - r.started_at == pytest.approx(0.70)
    assert engine.steps == 70  # not one step after the round was done
    # each fast prompt's 5th response is cut off when its group completes; prompt 4 at the end
    assert r.finished == 16 and r.aborted == 9
    # the engine decoded every token of the cut-off requests up to step 70; the driver
    # counts those it received (a delta of the step that completes a group can arrive late)
    finished_tokens = sum(4 * 10 * (i + 1) + 60 for i in range(4))
    assert engine.tokens_generated == finished_tokens + 40 + 50 + 60 + 70 + 5 * 70
    assert r.tokens_generated - r.tokens_aborted == finished_tokens
    assert sorted(engine.aborted) == sorted(
        [f"s1-p{i}-r4" for i in range(4)] + [f"s1-p4-r{j}" for j in range(5)]
    )
    assert_idle(engine)
    assert list(policy.queue) == [4]
    await engine.shutdown()


async def test_long_tail_goes_to_the_queue_and_tail_takes_a_third_of_syncs_time():
    # prompts 0, 5, 10, 15 are slow (400 tokens); every short round defers exactly one.
    prompts = make_prompts(20)
    base = {i: 400 if i % 5 == 0 else 20 for i in range(20)}

    def length(r):
        return base[prompt_of(r)] + 5 * index_of(r)

    sampling = Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=1024)
    tail = TailPolicy(prompts, sampling, shuffle=False)
    tail_engine = SimEngine(length, cost=FLAT, max_concurrency=64)
    queue_sizes = []
    outcomes = []
    for step in range(1, 6):
        outcomes += await run_steps(tail, tail_engine, 1, first=step)
        queue_sizes.append(tail.metrics()["queue_size"])
    assert [o.round.plan.kind for o in outcomes] == [RoundKind.SHORT] * 4 + [RoundKind.LONG]
    assert queue_sizes == [1, 2, 3, 4, 0]
    # a short round ends with its 4th response of the fast prompts (20 + 5*3 tokens)
    for o in outcomes[:4]:
        assert o.time_rollout_s == pytest.approx(0.35)
        assert all(base[g.prompt.token_ids[1]] == 20 for g in o.round.groups)
    long_round = outcomes[4].round
    assert sorted(g.prompt.uid for g in long_round.groups) == ["p0", "p10", "p15", "p5"]
    assert long_round.launched == 16 and long_round.aborted == 0
    assert outcomes[4].time_rollout_s == pytest.approx(4.15)  # its longest: 400 + 5*3

    sync = SyncPolicy(prompts, sampling, shuffle=False)
    sync_engine = SimEngine(length, cost=FLAT, max_concurrency=64)
    sync_outcomes = await run_steps(sync, sync_engine, 5)
    # sync's first four rounds each hold one slow prompt and wait for it
    assert [o.time_rollout_s for o in sync_outcomes] == pytest.approx([4.15] * 4 + [0.35])
    tail_time = sum(o.time_rollout_s for o in outcomes)
    sync_time = sum(o.time_rollout_s for o in sync_outcomes)
    assert (tail_time, sync_time) == pytest.approx((4 * 0.35 + 4.15, 4 * 4.15 + 0.35))
    assert_idle(tail_engine)
    await tail_engine.shutdown()
    await sync_engine.shutdown()


async def test_bubble_ratio_on_virtual_time_is_the_hand_count():
    # 2 slots, responses of 10 and 40 steps: busy 2*0.1 + 1*0.3 = 0.5 of 2*0.4
    engine = SimEngine(lambda r: 10 if index_of(r) == 0 else 40, cost=FLAT, max_concurrency=2)
    plan = RoundPlan(step=1, kind=RoundKind.SYNC, prompts=tuple(make_prompts(1)),
                     responses_per_prompt=2, group_size=2, groups_needed=1, max_tokens=64)
    r = await run_round(plan, engine, LengthScorer(), mean_centred, version=0, clock=engine.clock)
    assert (r.started_at, r.last_response_at) == (0.0, pytest.approx(0.4))
    assert bubble_ratio(r.timeline, r.started_at, r.last_response_at, 2) == pytest.approx(0.375)
    await engine.shutdown()


def long_tail_lengths(n: int, seed: int) -> dict[int, float]:
    """One prompt in five is hard (500-900 tokens), the rest 60-250."""
    rng = random.Random(1000 + seed)  # not the cursor's seed: hard prompts land anywhere
    hard = set(rng.sample(range(n), n // 5))
    return {i: rng.uniform(500, 900) if i in hard else rng.uniform(60, 250) for i in range(n)}


async def one_epoch(policy, base: dict[int, float], capacity: int):
    def length(r):
        spread = 0.6 + (zlib.crc32(f"{prompt_of(r)}:{index_of(r)}".encode()) % 81) / 100
        return int(base[prompt_of(r)] * spread)

    engine = SimEngine(length, cost=CostModel(), max_concurrency=capacity)
    outcomes = await run_steps(policy, engine, 40, stop=epoch_over(policy, 8))
    assert_idle(engine)
    await engine.shutdown()
    return outcomes


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_tail_needs_less_rollout_time_per_trained_prompt_than_sync(seed):
    # 80 prompts, P0=8, R0=4: sync runs 10 rounds; tail 8 short rounds (10 prompts, 8
    # trained) and 2 long rounds for the 16 deferred. Both train the same epoch.
    n, capacity = 80, 32  # capacity: a sync round's 32 requests; short rounds queue FIFO
    base = long_tail_lengths(n, seed)
    sampling = Sampling(prompts_per_step=8, responses_per_prompt=4, max_tokens=1024, seed=seed)
    sync = await one_epoch(SyncPolicy(make_prompts(n), sampling), base, capacity)
    tail_policy = TailPolicy(make_prompts(n), sampling)
    tail = await one_epoch(tail_policy, base, capacity)
    for outcomes in (sync, tail):
        trained = [g.prompt.uid for o in outcomes for g in o.round.groups]
        assert sorted(trained) == sorted(p.uid for p in make_prompts(n))
    assert not tail_policy.queue
    per_prompt = {
        name: sum(o.time_rollout_s for o in out) / n for name, out in (("sync", sync), ("tail", tail))
    }
    ratio = per_prompt["tail"] / per_prompt["sync"]
    bubbles = {
        kind: [bubble(o, capacity) for o in sync + tail if o.round.plan.kind is kind]
        for kind in (RoundKind.SYNC, RoundKind.SHORT, RoundKind.LONG)
    }
    means = {k.value: round(statistics.fmean(v), 3) for k, v in bubbles.items()}
    print(f"seed {seed}: rollout s/prompt {per_prompt}, tail/sync {ratio:.3f}, mean bubble {means}")
    assert ratio < 0.85
    assert all(0.0 <= b < 1.0 for v in bubbles.values() for b in v)
    assert means["short"] < means["sync"] - 0.2 and means["long"] < means["sync"]
    assert len(bubbles[RoundKind.LONG]) == 2 and len(bubbles[RoundKind.SHORT]) == 8


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.integers(min_value=1, max_value=120), min_size=12, max_size=12),
    st.sampled_from(["sync", (1.25, 1.25), (1.5, 1.0), (1.0, 1.5), (2.0, 2.0),
                     ("length_aware", 1), ("length_aware", 2), ("length_aware", 3)]),
    st.sampled_from([1, 3, 64]),
)
async def test_no_prompt_is_lost_or_trained_twice_in_an_epoch(lengths, policy_kind, capacity):
    # 12 prompts: a whole number of rounds (2, 3 or 4 prompts each) and of length_aware's
    # draws (2, 4 or 6 prompts) per epoch, so stopping at the epoch boundary leaves no
    # prompt of the next epoch in play. Small capacities keep most requests waiting in
    # the engine while others are aborted. length_aware speculates as its chooser sees
    # fit (a flat cost makes speculation free: up to eta 2 and a defer_after cap).
    prompts = make_prompts(12)
    sampling = Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=100)
    if policy_kind == "sync":
        policy = SyncPolicy(prompts, sampling)
    elif policy_kind[0] == "length_aware":
        policy = LengthAwarePolicy(prompts, sampling, lookahead_rounds=policy_kind[1],
                                   bounds=EtaBounds((1.0, 2.0), (1.0, 2.0)), concurrency=capacity)
    else:
        eta_p, eta_r = policy_kind
        policy = TailPolicy(prompts, sampling, eta_prompts=eta_p, eta_responses=eta_r)
    length = jittered(dict(enumerate(lengths)))
    engine = SimEngine(length, cost=FLAT, max_concurrency=capacity, chunk=4)
    outcomes = await run_steps(policy, engine, 60, stop=epoch_over(policy, 2))
    trained = [g.prompt.uid for o in outcomes for g in o.round.groups]
    queued = [f"p{i}" for i in waiting(policy)]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert len(queued) == len(set(queued)) and not set(queued) & set(trained)
    assert set(trained) | set(queued) == {p.uid for p in prompts}, "a prompt was lost"
    for o in outcomes:
        assert 0.0 <= bubble(o, capacity) <= 1.0
        assert o.round.ended_at >= o.round.last_response_at >= o.round.started_at
    # virtual time is all decode time: nothing else moves the clock
    assert engine.clock.now() == pytest.approx(engine.decode_s)
    assert_idle(engine)
    await engine.shutdown()


async def test_a_checkpoint_mid_epoch_resumes_the_same_rounds_and_timings():
    prompts = make_prompts(30)
    base = {i: (200 if i % 3 == 0 else 8) for i in range(30)}
    sampling = Sampling(prompts_per_step=3, responses_per_prompt=2, max_tokens=256, seed=4)
    a = TailPolicy(prompts, sampling)
    await run_steps(a, SimEngine(jittered(base), max_concurrency=8), 3)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["queue"]
    b = TailPolicy(prompts, sampling)
    b.load_state_dict(state)

    def summary(outcomes):
        return [(o.round.plan.kind, [p.uid for p in o.round.plan.prompts],
                 sorted(g.prompt.uid for g in o.round.groups), o.round.tokens_generated,
                 o.time_rollout_s) for o in outcomes]

    rest_a = await run_steps(a, SimEngine(jittered(base), max_concurrency=8), 6, first=4)
    rest_b = await run_steps(b, SimEngine(jittered(base), max_concurrency=8), 6, first=4)
    assert summary(rest_a) == summary(rest_b)
    assert RoundKind.LONG in [o.round.plan.kind for o in rest_a]


async def test_oversample_is_fastest_because_it_drops_the_long_tail():
    prompts = make_prompts(40)
    base = {i: 300 if i % 5 == 0 else 20 for i in range(40)}
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=512)
    policy = OversamplePolicy(prompts, sampling, shuffle=False)
    engine = SimEngine(jittered(base), cost=FLAT, max_concurrency=64)
    outcomes = await run_steps(policy, engine, 8)
    trained = {g.prompt.uid for o in outcomes for g in o.round.groups}
    assert len(trained) == 32 and policy.metrics() == {"prompts_dropped_total": 8.0}
    assert not trained & {f"p{i}" for i in range(0, 40, 5)}  # every slow prompt, never trained
    # no round ever waits for a slow response: each ends within the fast prompts' lengths
    assert all(o.time_rollout_s < 0.3 for o in outcomes)
    assert all(o.round.plan.kind is RoundKind.SHORT and o.round.aborted >= 5 for o in outcomes)
    restored = OversamplePolicy(prompts, sampling)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.dropped == 8 and restored.cursor.position == policy.cursor.position
    assert_idle(engine)
    await engine.shutdown()


async def test_cancelling_a_running_step_leaves_the_engine_idle():
    prompts = make_prompts(8)
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=2048)
    policy = TailPolicy(prompts, sampling)
    # 25 requests of ~1000 tokens through 10 slots: mid-way some run, some wait
    engine = SimEngine(jittered({i: 1000 for i in range(8)}), cost=FLAT, max_concurrency=10)
    task = asyncio.create_task(run_steps(policy, engine, 1))
    await engine.clock.sleep_until(5.0)
    assert len(engine.running) == 10 and len(engine.waiting) == 15
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_idle(engine)
    assert sorted(engine.aborted) == sorted(engine.seen) and len(engine.seen) == 25
    steps, now = engine.steps, engine.clock.now()
    for _ in range(50):
        await asyncio.sleep(0)
    assert (engine.steps, engine.clock.now()) == (steps, now)  # nothing decodes any more
    await engine.shutdown()


async def test_a_failing_request_stops_the_round_and_the_engine_serves_the_next():
    prompts = make_prompts(4)
    plan = RoundPlan(step=1, kind=RoundKind.SYNC, prompts=tuple(prompts), responses_per_prompt=4,
                     group_size=4, groups_needed=4, max_tokens=256)
    engine = SimEngine(lambda r: 100, cost=FLAT, max_concurrency=6,
                       fail_after=lambda r: 30 if r.request_id == "s1-p1-r2" else None)
    with pytest.raises(ExceptionGroup) as info:
        await run_round(plan, engine, LengthScorer(), mean_centred, version=0, clock=engine.clock)
    assert info.group_contains(SimEngineError, match="after 30 tokens")
    # p1-r2 is admitted at 1.0 s (after the first wave of 6 requests) and fails 30 steps later
    assert engine.failed == ["s1-p1-r2"] and engine.clock.now() == pytest.approx(1.3)
    assert_idle(engine)
    assert len(engine.aborted) == 15 - 6  # the first six had finished
    again = await run_round(
        RoundPlan(step=2, kind=RoundKind.SYNC, prompts=tuple(prompts[:1]), responses_per_prompt=2,
                  group_size=2, groups_needed=1, max_tokens=256),
        engine, LengthScorer(), mean_centred, version=0, clock=engine.clock,
    )
    assert len(again.groups) == 1 and again.ended_at - again.started_at == pytest.approx(1.0)
    await engine.shutdown()
