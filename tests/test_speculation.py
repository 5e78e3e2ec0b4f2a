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
from rpk.sched.policy import PolicyOptions, Sampling, make_policy
from rpk.sched.round import RoundBook
from rpk.sched.speculate import PRIOR_COST, SpecRule, Speculation

from tests.fakes import make_prompts, mean_centred

ALL = frozenset(DraftSource)


def _response(prompt: Prompt, index: int, tokens: tuple[int, ...]) -> Response:
    return Response(prompt, index, tokens, (0.0,) * len(tokens), FinishReason.STOP, 0)


def _result(plan: RoundPlan, trained: dict[int, list[tuple[int, ...]]],
            cut: dict[int, list[tuple[int, ...]]] = {}, finishes: tuple[tuple[float, int], ...] = ()) -> RoundResult:
    groups = tuple(
        Group(plan.prompts[pos], tuple(Scored(_response(plan.prompts[pos], j, t), 1.0, True) for j, t in enumerate(texts)),
              (0.0,) * len(texts))
        for pos, texts in trained.items())
    incomplete = tuple(p for i, p in enumerate(plan.prompts) if i not in trained)
    return RoundResult(plan, groups, (), 0, 0, 0, 0, 0, 0.0, 1.0, 1.0, 0.0, 0.0, incomplete=incomplete,
                       finishes=finishes,
                       cut=tuple(tuple(cut.get(i, ())) for i, p in enumerate(plan.prompts) if i not in trained))


def _plan(prompts: list[Prompt], kind: RoundKind = RoundKind.SHORT) -> RoundPlan:
    return RoundPlan(0, kind, tuple(prompts), 2, 2, 1, 32)


# -- the store -----------------------------------------------------------------------

def test_cut_tokens_are_kept_while_the_prompt_waits_and_dropped_once_it_trains() -> None:
    p = make_prompts(2)
    store = DraftStore(ALL)
    store.observe(_result(_plan(p), {0: [(1, 2), (3,)]}, cut={1: [(5,), (5, 6, 7), ()]}))
    assert store.drafts(p[1]) == PromptDrafts(p[1].token_ids, (Draft(DraftSource.PARTIAL, (5, 6, 7)),
                                                              Draft(DraftSource.PARTIAL, (5,))))
    # Trained later: its partials go, its responses become earlier-epoch texts.
    store.observe(_result(_plan([p[1]], RoundKind.LONG), {0: [(8, 9), (8,)]}))
    assert store.drafts(p[1]).drafts == (Draft(DraftSource.EPOCH, (8, 9)), Draft(DraftSource.EPOCH, (8,)))
    assert store.drafts(p[0]).drafts == (Draft(DraftSource.EPOCH, (1, 2)), Draft(DraftSource.EPOCH, (3,)))


def test_the_store_keeps_only_its_sources_and_within_its_limits() -> None:
    p = make_prompts(3)
    store = DraftStore({DraftSource.EPOCH}, StoreLimits(epochs_per_prompt=1, epoch_prompts=2, text_tokens=2))
    assert not store.keeps_partials
    store.observe(_result(_plan(p), {0: [(1, 2, 3), (4,)], 1: [(5,), (6,)], 2: [(7,), (8,)]}, cut={}))
    assert list(store.epochs) == ["p1", "p2"]  # the oldest prompt went
    assert store.epochs["p1"] == [(5,)]
    store2 = DraftStore(ALL, StoreLimits(text_tokens=2))
    store2.observe(_result(_plan(p), {0: [(1, 2, 3), (4,)]}))
    assert store2.epochs["p0"][0] == (1, 2)  # cut to text_tokens


def test_the_store_round_trips_through_json() -> None:
    p = make_prompts(2)
    store = DraftStore(ALL)
    store.observe(_result(_plan(p), {0: [(1, 2), (3,)]}, cut={1: [(5, 6)]}))
    again = DraftStore(ALL)
    again.load_state_dict(json.loads(json.dumps(store.state_dict())))
    assert again.drafts(p[0]) == store.drafts(p[0]) and again.drafts(p[1]) == store.drafts(p[1])


# -- the round book keeps cut tokens -------------------------------------------------

def test_the_round_book_keeps_cut_tokens_of_incomplete_prompts_when_asked() -> None:
    p = make_prompts(2)
    plan = RoundPlan(0, RoundKind.SHORT, tuple(p), 2, 2, 1, 32, keep_cut=True)
    book = RoundBook(plan, mean_centred)
    assert all(rec.request.progress for rec in book.requests.values())  # cut tokens need the deltas
    for rid in list(book.requests):
        book.started(rid, 0.0)
    from rpk.core.records import Carried

    book.aborted("s0-p1-r0", 1.0, Carried(0, (9, 9, 9), (0.0,) * 3, (0,) * 3))
    book.aborted("s0-p1-r1", 1.0, Carried(1, (), (), ()))
    # Both prompts are incomplete; an empty cut is no draft.
    assert book.cut_drafts() == ((), ((9, 9, 9),))
    no_keep = RoundBook(RoundPlan(0, RoundKind.SHORT, tuple(p), 2, 2, 1, 32), mean_centred)
    assert not any(rec.request.progress for rec in no_keep.requests.values())


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


def test_acceptance_is_measured_per_round_kind_and_replica_with_the_prior_before() -> None:
    spec = Speculation(ALL, SpecRule(prior=0.5, prior_weight=4))
    assert spec.acceptance(RoundKind.LONG, "r0").by_position == (0.5,)
    spec.observe_stats(RoundKind.LONG, {"r0": _stats(100, (100, 90, 80), (90, 72, 36))})
    a = spec.acceptance(RoundKind.LONG, "r0").by_position
    assert a[0] == pytest.approx((90 + 2) / (100 + 4))
    assert a[1] == pytest.approx((72 + 2) / (90 + 4))  # reached: accepted at position 1
    assert a[2] == pytest.approx((36 + 2) / (72 + 4))
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
    assert plan.keep_cut is (plan.kind is RoundKind.SHORT)
    trained = {i: [(100 + i, 1), (100 + i,)] for i in range(4)}
    cut = {i: [(200 + i, 2, 3)] for i in range(4, len(plan.prompts))}
    policy.commit(_result(plan, trained, cut))
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
