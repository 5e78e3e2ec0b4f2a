"""The speculative tail's pure state: the draft store across rounds, the plan state
(cost curve on decode steps, acceptance per round kind and replica), the round book's
cut tokens, and the policies carrying all of it through plans, commits and checkpoints."""

from __future__ import annotations

import json

import pytest

from rpk.core.drafts import Draft, DraftSource, PromptDrafts, SourceCounts, SpecStats
from rpk.core.outcomes import RoundPlan, RoundResult
from rpk.core.records import FinishReason, Group, Prompt, Response, RoundKind, Scored
from rpk.sched.drafts import DraftStore, StoreLimits
from rpk.sched.policies import PolicyOptions, make_policy
from rpk.sched.policy import Sampling
from rpk.sched.round import RoundBook, prompt_position, request_id
from rpk.sched.speculate import PRIOR_COST, SpecRule, Speculation
from tests.fakes import make_prompts, mean_centred

ALL = frozenset(DraftSource)


def _response(prompt: Prompt, index: int, tokens: tuple[int, ...]) -> Response:
    return Response(prompt, index, tokens, (0.0,) * len(tokens), FinishReason.STOP, 0)


def _result(plan: RoundPlan, trained: dict[int, list[tuple[int, ...]]],
            finishes: tuple[tuple[float, int], ...] = ()) -> RoundResult:
    groups = tuple(
        Group(plan.prompts[pos],
              tuple(Scored(_response(plan.prompts[pos], j, t), 1.0, True) for j, t in enumerate(texts)),
              (0.0,) * len(texts))
        for pos, texts in trained.items())
    incomplete = tuple(p for i, p in enumerate(plan.prompts) if i not in trained)
    return RoundResult(plan, groups, (), 0, 0, 0, 0, 0, 0.0, 1.0, 1.0, 0.0, 0.0, incomplete=incomplete,
                       finishes=finishes)


def _cut(plan: RoundPlan, cut: dict[int, list[tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """The engine's aborted requests' tokens, by request id, as `SpecStats.cut` has them."""
    return {request_id(plan.step, pos, j): t for pos, texts in cut.items() for j, t in enumerate(texts)}


def _plan(prompts: list[Prompt], kind: RoundKind = RoundKind.SHORT) -> RoundPlan:
    return RoundPlan(0, kind, tuple(prompts), 2, 2, 1, 32)


# -- the store -----------------------------------------------------------------------

def test_cut_tokens_are_kept_while_the_prompt_waits_and_dropped_once_it_trains() -> None:
    p = make_prompts(2)
    spec = Speculation(ALL)
    plan = _plan(p)
    result = _result(plan, {0: [(1, 2), (3,)]})
    # The engine's aborts: prompt 0's (complete) are no draft; prompt 1's are its partials.
    spec.observe_cut(result, {**_cut(plan, {1: [(5,), (5, 6, 7), ()]}), **_cut(plan, {0: [(9, 9)]}),
                              "s7-p1-r0": (4, 4), "warm-up": (1,)})
    spec.observe(result)
    store = spec.store
    assert store.drafts(p[1]) == PromptDrafts(p[1].token_ids, (Draft(DraftSource.PARTIAL, (5, 6, 7)),
                                                              Draft(DraftSource.PARTIAL, (5,))))
    # Trained later: its partials go, its responses become earlier-epoch texts.
    store.observe(_result(_plan([p[1]], RoundKind.LONG), {0: [(8, 9), (8,)]}))
    assert store.drafts(p[1]).drafts == (Draft(DraftSource.EPOCH, (8, 9)), Draft(DraftSource.EPOCH, (8,)))
    assert store.drafts(p[0]).drafts == (Draft(DraftSource.EPOCH, (1, 2)), Draft(DraftSource.EPOCH, (3,)))


def test_request_ids_name_their_step_and_prompt() -> None:
    assert prompt_position(request_id(3, 14, 2), 3) == 14
    assert prompt_position(request_id(3, 14, 2) + "-t4", 3) == 14  # a trajectory's turn
    assert prompt_position(request_id(3, 14, 2), 4) is None
    assert prompt_position("rpk-warm-up", 3) is None and prompt_position("s3-px-r1", 3) is None


def test_the_store_keeps_only_its_sources_and_within_its_limits() -> None:
    p = make_prompts(3)
    store = DraftStore({DraftSource.EPOCH}, StoreLimits(epochs_per_prompt=1, epoch_prompts=2, text_tokens=2))
    assert not store.keeps_partials
    store.keep_partials(p[0], [(1, 2)])
    assert not store.partials
    store.observe(_result(_plan(p), {0: [(1, 2, 3), (4,)], 1: [(5,), (6,)], 2: [(7,), (8,)]}))
    assert list(store.epochs) == ["p1", "p2"]  # the oldest prompt went
    assert store.epochs["p1"] == [(5,)]
    store2 = DraftStore(ALL, StoreLimits(text_tokens=2, partials_per_prompt=2))
    store2.observe(_result(_plan(p), {0: [(1, 2, 3), (4,)]}))
    assert store2.epochs["p0"][0] == (1, 2)  # cut to text_tokens
    store2.keep_partials(p[1], [(1,), (1, 2, 3)])
    store2.keep_partials(p[1], [(7, 7)])
    assert store2.partials["p1"] == [(7, 7), (1, 2)]  # the newest round's first, at most 2


def test_the_store_round_trips_through_json() -> None:
    p = make_prompts(2)
    store = DraftStore(ALL)
    store.observe(_result(_plan(p), {0: [(1, 2), (3,)]}))
    store.keep_partials(p[1], [(5, 6)])
    again = DraftStore(ALL)
    again.load_state_dict(json.loads(json.dumps(store.state_dict())))
    assert again.drafts(p[0]) == store.drafts(p[0]) and again.drafts(p[1]) == store.drafts(p[1])


# -- the round book --------------------------------------------------------------------

def test_finishes_count_decode_steps_not_accepted_drafts() -> None:
    p = make_prompts(1)
    book = RoundBook(RoundPlan(0, RoundKind.SYNC, tuple(p), 2, 2, 1, 32), mean_centred)
    rid = "s0-p0-r0"
    book.started(rid, 0.0)
    book.progressed(rid, 20)
    book.finished(rid, _response(p[0], 0, tuple(range(20))), 1.0, accepted=12)
    assert book.finishes == [(1.0, 8)]


# -- the plan state ------------------------------------------------------------------

def _stats(drafts: int, drafted: tuple[int, ...], accepted: tuple[int, ...]) -> SpecStats:
    return SpecStats(drafts=drafts, draft_tokens=sum(drafted), accepted=sum(accepted),
                     drafted_by_pos=drafted, accepted_by_pos=accepted)


def test_acceptance_measured_over_drafts_of_mixed_lengths_is_the_per_position_rate() -> None:
    # A round whose plan drafted 1 token at full batch and 4 in the tail, every position
    # accepted at 0.6 (vLLM's counters, in expectation): the second position's rate is
    # 0.6, not 0.36 (what counting the 1-token drafts' acceptances as reaching it gives).
    a, short, long = 0.6, 9000, 1000
    drafted = (short + long, long, long, long)
    accepted = (a * (short + long), long * a**2, long * a**3, long * a**4)
    spec = Speculation(ALL, SpecRule(prior_weight=1e-9))
    spec.observe_stats(RoundKind.LONG, {"r0": _stats(short + long, drafted, tuple(round(x) for x in accepted))})
    assert spec.acceptance(RoundKind.LONG, "r0").by_position == pytest.approx((a,) * 4, abs=0.01)


def test_acceptance_is_measured_per_round_kind_and_replica_with_the_prior_before() -> None:
    spec = Speculation(ALL, SpecRule(prior=0.5, prior_weight=4))
    assert spec.acceptance(RoundKind.LONG, "r0").by_position == (0.5,)
    spec.observe_stats(RoundKind.LONG, {"r0": _stats(100, (100, 90, 80), (90, 72, 36))})
    a = spec.acceptance(RoundKind.LONG, "r0").by_position
    assert a[0] == pytest.approx((90 + 2) / (100 + 4))
    # reached: those accepted one position earlier, in the share of drafts that went on
    assert a[1] == pytest.approx((72 + 2) / (90 * 90 / 100 + 4))
    assert a[2] == pytest.approx((36 + 2) / (72 * 80 / 90 + 4))
    # Another replica falls back to what the kind showed on the others; another kind to the prior.
    assert spec.acceptance(RoundKind.LONG, "r1").by_position == a
    assert spec.acceptance(RoundKind.SHORT, "r0").by_position == (0.5,)


def test_a_kind_measured_too_low_to_draft_drifts_back_to_the_prior_and_drafts_again() -> None:
    spec = Speculation(ALL, SpecRule(max_k=4, decay=0.5))
    spec.cost.last = (4.7e-3, 0.133e-3)
    spec.observe_stats(RoundKind.LONG, {"r": _stats(200, (200,) * 4, (2, 0, 0, 0))})
    assert not spec.plan(RoundKind.LONG, "r", 64).speculates
    rounds = 0
    while not spec.plan(RoundKind.LONG, "r", 64).speculates:
        spec.observe_stats(RoundKind.LONG, {"r": SpecStats()})  # a round that drafted nothing
        rounds += 1
        assert rounds < 20
    assert rounds >= 3


def test_low_acceptance_plans_no_drafts_and_high_acceptance_drafts_in_the_tail() -> None:
    spec = Speculation(ALL, SpecRule(max_k=4))
    spec.cost.last = (4.7e-3, 0.133e-3)  # the CPU engine's curve
    spec.observe_stats(RoundKind.SHORT, {"r": _stats(1000, (1000,) * 4, (10, 1, 0, 0))})
    assert not spec.plan(RoundKind.SHORT, "r", 64).speculates
    spec.observe_stats(RoundKind.LONG, {"r": _stats(1000, (1000,) * 4, (900, 810, 729, 656))})
    plan = spec.plan(RoundKind.LONG, "r", 512)
    assert plan.k_for(1) == 4 and plan.k_for(512) == 0
    fixed = Speculation(ALL, SpecRule(adaptive=False, max_k=3))
    assert fixed.plan(RoundKind.LONG, "r", 8).bands == ((1, 8, 3),)


def test_the_step_cost_is_the_prior_until_measured_and_one_replicas_after() -> None:
    spec = Speculation(ALL)
    assert spec.step_cost() == PRIOR_COST
    spec.cost.last = (0.005, 0.0001)
    cost = spec.step_cost(replicas=2)
    assert cost.fixed_s == 0.005 and cost.per_token_s == pytest.approx(0.0002)


def test_the_plan_state_round_trips_through_json() -> None:
    spec = Speculation(ALL)
    spec.cost.last = (0.005, 0.0001)
    spec.observe_stats(RoundKind.LONG, {"r0": _stats(10, (10, 5), (5, 2))})
    again = Speculation(ALL)
    again.load_state_dict(json.loads(json.dumps(spec.state_dict())))
    assert again.acceptance(RoundKind.LONG, "r0") == spec.acceptance(RoundKind.LONG, "r0")
    assert again.step_cost() == spec.step_cost()


def test_spec_stats_add_and_round_trip() -> None:
    a = SpecStats(2, 5, 3, (2, 2, 1), (2, 1), 1, 4, 2, 3, {DraftSource.SIBLING: SourceCounts(2, 5, 3)})
    b = SpecStats(1, 1, 1, (1,), (1,), 1, 2, 1, 1, {DraftSource.PROMPT: SourceCounts(1, 1, 1)})
    c = a.plus(b)
    assert c.drafted_by_pos == (3, 2, 1) and c.accepted_by_pos == (3, 1) and c.drafts == 3
    assert c.tokens_per_verify == pytest.approx(1 + 4 / 3)
    assert SpecStats.from_json(json.loads(json.dumps(c.to_json()))) == c


# -- the policies carry it ------------------------------------------------------------

@pytest.mark.parametrize("name", ["sync", "tail", "length_aware"])
def test_a_speculating_policy_plans_drafts_and_checkpoints_its_texts(name: str) -> None:
    prompts = make_prompts(40)
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=32)
    options = PolicyOptions(spec_sources=ALL, spec_rule=SpecRule(), concurrency=64)
    policy = make_policy(name, prompts, sampling, options)
    assert policy.speculation is not None
    plan = policy.plan(1)
    assert len(plan.drafts) == len(plan.prompts)
    trained = {i: [(100 + i, 1), (100 + i,)] for i in range(4)}
    result = _result(plan, trained)
    policy.speculation.observe_cut(result, _cut(plan, {i: [(200 + i, 2, 3)] for i in range(4, len(plan.prompts))}))
    policy.commit(result)
    state = json.loads(json.dumps(policy.state_dict()))
    again = make_policy(name, prompts, sampling, options)
    again.load_state_dict(state)
    assert again.speculation is not None
    assert again.speculation.store.epochs == policy.speculation.store.epochs
    assert again.speculation.store.partials == policy.speculation.store.partials
    # A later round with one of the trained prompts carries its responses as drafts.
    uid = plan.prompts[0].uid
    texts = again.speculation.store.drafts(plan.prompts[0]).drafts
    assert texts and all(d.source is DraftSource.EPOCH for d in texts), uid
    off = make_policy(name, prompts, sampling, PolicyOptions(concurrency=64))
    assert off.speculation is None and off.plan(1).drafts == () and "speculation" not in off.state_dict()
    off.load_state_dict(state)  # a speculating run's checkpoint resumes without it


def test_a_replicas_step_cost_is_fitted_on_its_engine_steps() -> None:
    from rpk.engine.vllm_stats import StepClock

    spec = Speculation(ALL, SpecRule(decay=1.0))
    clock = StepClock()
    t, fit = 0.0, SpecStats()
    for i in range(200):
        ran = 1 + i % 40
        t += 0.004 + 0.0002 * ran  # 4 ms a step and 0.2 ms a token
        fit = fit.plus(clock.step(t, ran, SpecStats(steps=1)))
    clock.idle()
    assert clock.step(t + 10.0, 5, SpecStats()).step_fit == ()  # after an idle gap: no step
    spec.observe_stats(RoundKind.SYNC, {"r0": fit})
    cost = spec.step_cost("r0")
    assert cost.fixed_s == pytest.approx(0.004, rel=1e-6) and cost.per_token_s == pytest.approx(0.0002, rel=1e-6)
    assert spec.step_cost("r1") == cost  # not seen yet: the replicas' together
    assert Speculation(ALL).step_cost("r0") == PRIOR_COST


def _clocked(verify_extra_s: float | None) -> SpecStats:
    """200 engine steps through the stat logger's clock: 4 ms + 0.2 ms a token, every
    other one verifying drafts at `verify_extra_s` more (None: none verifies)."""
    from rpk.engine.vllm_stats import StepClock

    clock = StepClock()
    t, fit = 0.0, SpecStats()
    for i in range(200):
        ran = 1 + i % 8
        verifying = verify_extra_s is not None and i % 2 == 1
        t += 0.004 + 0.0002 * ran + (verify_extra_s if verifying else 0.0)
        fit = fit.plus(clock.step(t, ran, SpecStats(steps=1, spec_steps=1, drafts=1) if verifying
                                  else SpecStats(steps=1)))
    return fit


def test_verifying_steps_are_fitted_apart_and_their_extra_cost_enters_the_plan() -> None:
    fit = _clocked(0.006)
    assert fit.step_fit[0] == 99 and fit.verify_fit[0] == 100  # the first step has no start
    assert SpecStats.from_json(json.loads(json.dumps(fit.to_json()))).verify_fit == pytest.approx(fit.verify_fit)
    good = _stats(1000, (1000,) * 4, (600, 360, 216, 130))  # ~0.6 a position: tau(4) ~ 2.3
    plans = {}
    for name, stats in (("tokens alone", _clocked(None)), ("with the verify", fit)):
        spec = Speculation(ALL, SpecRule(decay=1.0, max_k=4))
        spec.observe_stats(RoundKind.LONG, {"r0": good})
        spec.observe_stats(RoundKind.LONG, {"r0": stats})
        cost = spec.step_cost("r0")
        assert cost.fixed_s == pytest.approx(0.004, rel=1e-6) and cost.per_token_s == pytest.approx(0.0002, rel=1e-6)
        plans[name] = spec.plan(RoundKind.LONG, "r0", 64)
        restored = Speculation(ALL, SpecRule(decay=1.0, max_k=4))
        restored.load_state_dict(json.loads(json.dumps(spec.state_dict())))
        assert restored.step_cost("r0") == cost
    assert spec.step_cost("r0").verify_s == pytest.approx(0.006, rel=1e-6)
    # 2.3 tokens a verify pay at 4.4 ms against 4.2 ms a plain step; not at 10.4 ms
    assert plans["tokens alone"].k_for(1) > 0
    assert not plans["with the verify"].speculates


def test_a_source_accepted_too_rarely_to_pay_is_left_out_of_its_kinds_rounds() -> None:
    spec = Speculation(ALL)
    spec.cost.last = (4.7e-3, 0.133e-3)
    assert spec.sources_for(RoundKind.LONG) == ALL  # the prior, before any draft
    stats = SpecStats(drafts=100, draft_tokens=2000, accepted=900, by_source={
        DraftSource.PROMPT: SourceCounts(50, 1000, 5), DraftSource.PARTIAL: SourceCounts(50, 1000, 895)})
    spec.observe_stats(RoundKind.LONG, {"r0": stats})
    assert spec.sources_for(RoundKind.LONG) == ALL - {DraftSource.PROMPT}
    assert spec.sources_for(RoundKind.SHORT) == ALL
    # No source left: the round plans no drafts at all.
    only = Speculation({DraftSource.PROMPT})
    only.cost.last = (4.7e-3, 0.133e-3)
    only.observe_stats(RoundKind.LONG, {"r0": stats})
    assert not only.plan(RoundKind.LONG, "r0", 64).speculates


def test_a_source_must_pay_at_the_batch_its_kinds_rounds_drafted_at() -> None:
    spec = Speculation(ALL)
    spec.cost.last = (4.7e-3, 0.133e-3)
    # 20% acceptance pays for one draft at batch 1 on this cost, not at batch 20.
    at = {DraftSource.SIBLING: SourceCounts(50, 1000, 200)}
    spec.observe_stats(RoundKind.SYNC, {"r0": SpecStats(drafts=50, spec_steps=10, spec_step_rows=10, by_source=at)})
    assert DraftSource.SIBLING in spec.sources_for(RoundKind.SYNC)
    spec.observe_stats(RoundKind.LONG, {"r0": SpecStats(drafts=50, spec_steps=10, spec_step_rows=200, by_source=at)})
    assert DraftSource.SIBLING not in spec.sources_for(RoundKind.LONG)
