"""Length-aware tail batching on virtual time: the round book's early abort past
`defer_after`, rounds packed by learned length guesses, adaptive speculation, and the
tail's guarantees (synchronous, on-policy, every prompt of a draw trained once)."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from rpk.core.outcomes import RoundPlan
from rpk.core.records import FinishReason, Prompt, Response, RoundKind
from rpk.loop.rollout import run_round
from rpk.sched.policy import LengthAwarePolicy, Sampling, SyncPolicy, TailPolicy, spread_order
from rpk.sched.provision import EtaBounds
from rpk.sched.round import RoundBook
from rpk.sim import CostModel, SimEngine
from tests.fakes import LengthScorer, make_prompts, mean_centred
from tests.helpers import FLAT, assert_idle, index_of, prompt_of, run_steps, waiting


def plan(lengths_of_prompts: int, needed: int, launch: int, group: int, defer_after: int) -> RoundPlan:
    return RoundPlan(
        step=1, kind=RoundKind.SHORT, prompts=tuple(make_prompts(lengths_of_prompts)),
        responses_per_prompt=launch, group_size=group, groups_needed=needed, max_tokens=1000,
        defer_after=defer_after,
    )


def test_past_defer_after_a_response_goes_then_its_prompt_once_it_cannot_complete():
    book = RoundBook(plan(3, needed=2, launch=3, group=2, defer_after=10), mean_centred)
    for rid in book.requests:
        book.started(rid, 0.0)
    assert book.progressed("s1-p0-r0", 10) == []  # at the limit, not past it
    assert book.progressed("s1-p0-r0", 1) == ["s1-p0-r0"]  # p0 can still make 2 of 3
    assert book.progressed("s1-p0-r0", 5) == []  # asked once
    # p0's second response past the limit: p0 can no longer complete, and the round can
    # spare it (p1 and p2 make 2 groups): every request of p0 goes now
    assert set(book.progressed("s1-p0-r1", 11)) == {"s1-p0-r0", "s1-p0-r1", "s1-p0-r2"}
    # p1 is needed now (2 groups, 2 prompts left): no limit for it, nothing aborted
    assert book.progressed("s1-p1-r0", 11) == []
    assert book.progressed("s1-p1-r1", 50) == []
    p1 = book.plan.prompts[1]
    accepted, _ = book.finished("s1-p1-r1", Response(p1, 1, (1,) * 50, (-0.1,) * 50, FinishReason.STOP, 0), 1.0)
    assert accepted
    # a response past the limit that finishes before its abort lands is not accepted
    p0 = book.plan.prompts[0]
    accepted, _ = book.finished("s1-p0-r2", Response(p0, 2, (1,) * 12, (-0.1,) * 12, FinishReason.STOP, 0), 1.0)
    assert not accepted


def test_launch_counts_per_prompt():
    p = RoundPlan(step=1, kind=RoundKind.SHORT, prompts=tuple(make_prompts(3)), responses_per_prompt=4,
                  group_size=2, groups_needed=2, max_tokens=64, launch=(2, 4, 3))
    book = RoundBook(p, mean_centred)
    assert sorted(book.requests) == sorted(
        [f"s1-p0-r{j}" for j in range(2)] + [f"s1-p1-r{j}" for j in range(4)] + [f"s1-p2-r{j}" for j in range(3)])
    with pytest.raises(ValueError, match="launch"):
        RoundPlan(step=1, kind=RoundKind.SHORT, prompts=tuple(make_prompts(2)), responses_per_prompt=4,
                  group_size=2, groups_needed=2, max_tokens=64, launch=(1, 4))


async def cap_round(lengths: dict[int, int], defer_after: int, needed: int):
    engine = SimEngine(lambda r: lengths[prompt_of(r)] + index_of(r), cost=FLAT, max_concurrency=64, chunk=1)
    p = RoundPlan(step=1, kind=RoundKind.SHORT, prompts=tuple(make_prompts(len(lengths))),
                  responses_per_prompt=3, group_size=2, groups_needed=needed, max_tokens=1000,
                  defer_after=defer_after)
    try:
        result = await run_round(p, engine, LengthScorer(1000), mean_centred, version=0, clock=engine.clock)
    finally:
        assert_idle(engine)
        await engine.shutdown()
    return result, engine


async def test_a_prompt_that_turns_out_long_is_aborted_at_the_cap_not_at_the_round_end():
    # 3 groups needed of 4 prompts; p0 and p3 pass the cap of 40 tokens in the same step.
    # p0 goes first (launch order) and is given up; the round then needs p3, which runs
    # on and ends the round (its second response, 101 tokens).
    lengths = {0: 500, 1: 20, 2: 20, 3: 100}
    capped, engine = await cap_round(lengths, defer_after=40, needed=3)
    assert sorted(g.prompt.uid for g in capped.groups) == ["p1", "p2", "p3"]
    assert [p.uid for p in capped.incomplete] == ["p0"]
    assert {f"s1-p0-r{j}" for j in range(3)} <= set(engine.aborted)
    (pl0,) = [pl for pl in capped.lengths if pl.prompt.uid == "p0"]
    # the third was cancelled before its step-41 token reached the driver
    assert not pl0.trained and pl0.finished == () and pl0.cut == (41, 41, 40)
    uncapped, _ = await cap_round(lengths, defer_after=0, needed=3)
    assert capped.ended_at == uncapped.ended_at == pytest.approx(1.01)
    (late,) = [pl for pl in uncapped.lengths if pl.prompt.uid == "p0"]
    assert min(late.cut) >= 100  # without the cap, cut at the round's end
    assert uncapped.tokens_wasted - capped.tokens_wasted == sum(late.cut) - sum(pl0.cut)


def draw_over(policy, p0: int):
    """Stop at the epoch boundary once nothing of the last draw is left."""
    return lambda: policy.cursor.epoch >= 1 and len(waiting(policy)) < p0


def noisy_lengths(n: int, seed: int, sigma_prompt=0.8, sigma_epoch=0.6, sigma_response=0.5, p0=16):
    """A prompt predicts its length only partly (log-normal prompt mean, per-epoch
    change, per-response noise); the epoch is that of the request's step."""
    rng = random.Random(seed)
    base = [math.log(40) + sigma_prompt * rng.gauss(0, 1) for _ in range(n)]

    def draw(*key) -> float:
        return random.Random(hash(key) & 0xFFFFFFFF).gauss(0, 1)

    def length(r) -> int:
        i = prompt_of(r)
        step = int(r.request_id.split("-", 1)[0][1:])
        epoch = (step - 1) * p0 // n
        return max(1, round(math.exp(base[i] + sigma_epoch * draw(seed, i, epoch)
                                     + sigma_response * draw(seed, i, step, index_of(r)))))
    return length


@pytest.mark.parametrize("seed", [0, 1])
async def test_packing_by_learned_guesses_beats_plain_tail_when_lengths_are_partly_predictable(seed):
    # GPU-like cost (flat in the batch), 3 epochs of 160 prompts, P0=16 x R0=4
    n, p0 = 160, 16
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=4, max_tokens=1024, seed=seed)
    cost = CostModel(base_s=0.015, per_seq_s=5e-5)
    per_prompt = {}
    for name, policy in (("sync", SyncPolicy(make_prompts(n), sampling)),
                         ("tail", TailPolicy(make_prompts(n), sampling)),
                         ("length_aware", LengthAwarePolicy(make_prompts(n), sampling, concurrency=512))):
        engine = SimEngine(noisy_lengths(n, seed, p0=p0), cost=cost, max_concurrency=512, chunk=8)
        outcomes = await run_steps(policy, engine, 30)
        assert_idle(engine)
        await engine.shutdown()
        trained = sum(len(o.round.groups) for o in outcomes)
        per_prompt[name] = sum(o.time_rollout_s for o in outcomes) / trained
        if name == "length_aware":
            m = policy.metrics()
            wasted = sum(o.round.tokens_wasted for o in outcomes) / sum(o.round.tokens_generated for o in outcomes)
    speedup = {k: per_prompt["sync"] / v for k, v in per_prompt.items()}
    print(f"seed {seed}: speedup over sync {speedup}, length_aware wasted {wasted:.1%}, "
          f"rank corr {m['pred_rank_corr']:.2f}")
    assert speedup["length_aware"] > speedup["tail"] > 1
    assert 0.2 < m["pred_rank_corr"] < 0.9  # history helps, but only partly
    assert m["cost_base_ms"] == pytest.approx(15, rel=0.25)


async def test_every_prompt_of_a_draw_is_trained_exactly_once_and_the_longest_wait_for_the_long_round():
    # prompt token counts tell the lengths apart (prompt i: 2 + i % 8 tokens)
    n, p0 = 96, 8
    prompts = [Prompt(f"p{i}", (7, i) + (0,) * (i % 8), "t", "") for i in range(n)]
    length = {i: 10 + 40 * (i % 8) for i in range(n)}
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=2, max_tokens=512)
    policy = LengthAwarePolicy(prompts, sampling, lookahead_rounds=4, concurrency=64)
    engine = SimEngine(lambda r: length[prompt_of(r)] + index_of(r), cost=FLAT, max_concurrency=64)
    outcomes = await run_steps(policy, engine, 12, stop=draw_over(policy, p0))
    assert len(outcomes) == 12
    trained = [g.prompt.uid for o in outcomes for g in o.round.groups]
    assert sorted(trained) == sorted(p.uid for p in prompts)
    kinds = [o.round.plan.kind for o in outcomes]
    assert kinds == [RoundKind.SHORT, RoundKind.SHORT, RoundKind.SHORT, RoundKind.LONG] * 3
    # after the first draw, a draw's long round holds its longest prompts and nothing else does
    for o in outcomes[4:]:
        lens = [length[int(p.uid[1:])] for p in o.round.plan.prompts]
        if o.round.plan.kind is RoundKind.LONG:
            assert min(lens) >= 210
        else:
            assert max(lens) <= 250
    assert policy.metrics()["pred_rank_corr"] > 0.8  # the window still holds the first draw
    assert_idle(engine)
    await engine.shutdown()


def test_a_short_round_takes_each_band_of_the_draw_and_holds_back_the_longest():
    order = list(range(20))  # sorted shortest guess first, P0 = 4: 4 short rounds + 1 long
    spread = spread_order(order, 4)
    assert spread[:4] == [0, 4, 8, 12]  # one per band of the 16 short guesses
    assert spread[4:8] == [1, 5, 9, 13]  # the extras: each band's next
    assert spread[-4:] == [16, 17, 18, 19]  # the long round's, last
    assert sorted(spread) == order
    # the draw's last short round: the shortest P0, then the long round's
    assert spread_order([3, 1, 2, 0, 5, 4], 3) == [3, 1, 2, 0, 5, 4]
    assert spread_order([2, 0, 1], 4) == [2, 0, 1]


async def test_short_rounds_train_a_wider_mix_of_lengths_than_packing_shortest_first(monkeypatch):
    # Packing shortest first made each step one band of lengths, in the same order every
    # draw, and lost validation accuracy against sync (issue 22).
    n, p0 = 96, 8
    prompts = [Prompt(f"p{i}", (7, i) + (0,) * (i % 8), "t", "") for i in range(n)]
    length = {i: 10 + 40 * (i % 8) for i in range(n)}
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=2, max_tokens=512)

    async def spread_per_short_round() -> float:
        policy = LengthAwarePolicy(prompts, sampling, lookahead_rounds=4, concurrency=64)
        engine = SimEngine(lambda r: length[prompt_of(r)] + index_of(r), cost=FLAT,
                           max_concurrency=64)
        outcomes = await run_steps(policy, engine, 12, stop=draw_over(policy, p0))
        assert_idle(engine)
        await engine.shutdown()
        trained = [g.prompt.uid for o in outcomes for g in o.round.groups]
        assert sorted(trained) == sorted(p.uid for p in prompts)
        return statistics.fmean(
            statistics.pstdev(length[int(g.prompt.uid[1:])] for g in o.round.groups)
            for o in outcomes[4:] if o.round.plan.kind is RoundKind.SHORT
        )

    spread = await spread_per_short_round()
    monkeypatch.setattr("rpk.sched.policy.spread_order", lambda order, p0: list(order))
    packed = await spread_per_short_round()
    assert spread > 1.3 * packed, (spread, packed)


async def test_a_checkpoint_mid_draw_resumes_the_same_rounds_and_timings():
    n, p0 = 60, 4
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=2, max_tokens=512, seed=4)
    lengths = noisy_lengths(n, seed=3, p0=p0)
    a = LengthAwarePolicy(make_prompts(n), sampling, lookahead_rounds=3, concurrency=32)
    await run_steps(a, SimEngine(lengths, max_concurrency=32), 7)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["pending"] and state["predictor"]["history"]
    b = LengthAwarePolicy(make_prompts(n), sampling, lookahead_rounds=3, concurrency=32)
    b.load_state_dict(state)

    def summary(outcomes):
        return [(o.round.plan.kind, [p.uid for p in o.round.plan.prompts], o.round.plan.launch,
                 o.round.plan.defer_after, sorted(g.prompt.uid for g in o.round.groups),
                 o.round.tokens_generated, o.time_rollout_s) for o in outcomes]

    rest_a = await run_steps(a, SimEngine(lengths, max_concurrency=32), 6, first=8)
    rest_b = await run_steps(b, SimEngine(lengths, max_concurrency=32), 6, first=8)
    assert summary(rest_a) == summary(rest_b)
    assert a.metrics() == b.metrics()


async def test_its_metrics_report_calibration_cost_and_the_speculation_chosen():
    n, p0 = 48, 4
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=4, max_tokens=512)
    policy = LengthAwarePolicy(make_prompts(n), sampling, lookahead_rounds=4, concurrency=64,
                               bounds=EtaBounds((1.0, 1.5), (1.0, 2.0)))
    engine = SimEngine(noisy_lengths(n, seed=5, p0=p0), cost=FLAT, max_concurrency=64, chunk=4)
    outcomes = await run_steps(policy, engine, 7)
    await engine.shutdown()
    m = policy.metrics()
    for key in ("pred_rank_corr", "pred_rank_corr_round", "pred_mae_tokens", "pred_spread",
                "cost_base_ms", "cost_per_seq_ms", "eta_prompts", "eta_responses", "defer_after",
                "eta_expected_gain", "pending_prompts"):
        assert isinstance(m[key], float), key
    assert isinstance(m["eta_reason"], str) and m["eta_reason"]
    assert m["cost_base_ms"] == pytest.approx(10, rel=0.2) and m["cost_per_seq_ms"] < 0.5
    # a flat cost makes speculation all but free: once measured (it takes the first two
    # rounds of 4 prompts to measure the curve), short rounds use it
    short = [o.round.plan for o in outcomes[2:] if o.round.plan.kind is RoundKind.SHORT]
    assert short and all(len(p.prompts) > p0 for p in short)
    assert all(1 <= len(p.prompts) / p0 <= 1.5 and max(p.launch) <= 8 for p in short)
    assert statistics.fmean(o.round.tokens_wasted / o.round.tokens_generated for o in outcomes) < 0.5
