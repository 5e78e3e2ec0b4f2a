"""The speculative tail's hand-over to the twins (`rpk.sched.handover`, driven by
`rpk.loop.speculate.SpecTail`): only rows with a text to draft from move, and only where
the measured gain covers the twin's measured extra cost; scripted fleets, no clock."""

from __future__ import annotations

import asyncio

import pytest

from rpk.core.drafts import Draft, DraftSource, PromptDrafts, SpecStats
from rpk.core.outcomes import MigrationReport, RoundPlan, RoundResult
from rpk.core.records import FinishReason, Prompt, Response, RoundKind
from rpk.loop.speculate import SpecTail
from rpk.sched.handover import decide, rows_with_texts, tail_gain, tail_window_s
from rpk.sched.speculate import PRIOR_TWIN_RATIO, Acceptance, SpecRule, Speculation, StepCost, TwinCost
from tests.fakes import make_prompts

PLAIN, TWIN = "p0", "p0+spec"
# The CPU engine's plain step (bench/results/spec_step_cost.json): ~3.3 ms, nearly flat.
CPU = StepCost(fixed_s=0.0033, per_token_s=0.0001)


class TwinFleet:
    """A plain replica and its speculating twin: the rows in flight on the plain one are
    scripted; `hand_over` records what it was asked to move and moves it."""

    def __init__(self, rows: dict[str, tuple[int, ...]]) -> None:
        self.rows = dict(rows)
        self.handed: list[tuple[str, ...]] = []
        self.added: list[PromptDrafts] = []
        self.events: list[str] = []

    def draft_targets(self) -> dict[str, int]:
        return {TWIN: 64}

    async def set_drafts(self, schedules, sources, prompts) -> None:
        self.schedules = dict(schedules)

    async def add_drafts(self, prompts) -> None:
        self.added += prompts
        self.events.append(f"add {len(prompts)}")

    async def take_spec_stats(self) -> dict[str, SpecStats]:
        return {PLAIN: SpecStats(), TWIN: SpecStats()}

    def tail_rows(self, at: int) -> dict[str, tuple[int, ...]]:
        return dict(self.rows) if len(self.rows) <= at else {}

    async def hand_over(self, request_ids) -> MigrationReport:
        ids = tuple(sorted(request_ids))
        self.handed.append(ids)
        self.events.append(f"hand {len(ids)}")
        for rid in ids:
            del self.rows[rid]
        return MigrationReport((0,), len(ids), 10 * len(ids), 0.01, 0.01)

    def finish(self, rid: str) -> None:
        del self.rows[rid]


def _round(prompts: list[Prompt], with_partials: set[int], kind: RoundKind = RoundKind.LONG) -> RoundPlan:
    drafts = tuple(PromptDrafts(p.token_ids, (Draft(DraftSource.PARTIAL, (1, 2, 3, 4, 5)),) if i in with_partials
                                else ()) for i, p in enumerate(prompts))
    return RoundPlan(1, kind, tuple(prompts), 2, 2, len(prompts), 100, drafts=drafts)


def _rows(prompts: list[Prompt], per: int = 2) -> dict[str, tuple[int, ...]]:
    return {f"s1-p{i}-r{j}": p.token_ids for i, p in enumerate(prompts) for j in range(per)}


def _measured(spec: Speculation, extra_s: float, accept: float, kind: RoundKind = RoundKind.LONG) -> None:
    """The plain replica's steps on the CPU line (60 of 2 or 6 tokens), the twin's 40
    verifying steps of 5 tokens `extra_s` above it, and the kind's acceptance
    `accept` at every position over 400 drafts."""
    xs = [2.0, 6.0] * 30
    ys = [CPU.fixed_s + CPU.per_token_s * x for x in xs]
    spec.steps[PLAIN] = [len(xs), sum(xs), sum(ys), sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))]
    spec.verifies[TWIN] = [40.0, 200.0, 40 * (CPU.fixed_s + CPU.per_token_s * 5 + extra_s)]
    reached = [400.0, 400.0 * accept, 400.0 * accept ** 2, 400.0 * accept ** 3]
    spec.counts[f"{kind.value}/{TWIN}"] = [reached, [r * accept for r in reached]]


DONE = Prompt("done", (7, 99), "test", "0")  # a prompt whose one row finishes first


async def _drive(tail: SpecTail, fleet: TwinFleet, plan: RoundPlan, finishes: list[tuple[str, Prompt]] = ()
                 ) -> None:
    """A round: the plan in, then each scripted finish (the row leaves the plain
    replica, its response goes to the driver), the feed deciding after each; first a
    row of `DONE` finishes."""
    fleet.rows["done"] = DONE.token_ids
    await tail.before_round(plan)
    async with asyncio.TaskGroup() as tg:
        feed = tg.create_task(tail.feed(), name="feed")
        for rid, prompt in [("done", DONE), *finishes]:
            fleet.finish(rid)
            tail.finished(Response(prompt, 0, (5, 6, 7, 8), (), FinishReason.STOP, 0))
            for _ in range(3):
                await asyncio.sleep(0)
        tail.end_round()
    assert feed.done()


def test_only_rows_with_a_text_to_draft_from_are_counted() -> None:
    rows = {"a": (7, 0), "b": (7, 1), "c": (7, 0, 9, 9)}  # c: a later turn of prompt (7, 0)
    assert rows_with_texts(rows, {(7, 0)}) == ["a", "c"]
    assert rows_with_texts(rows, set()) == []


def test_rows_without_drafts_stay_plain_where_the_twin_has_devices_of_its_own() -> None:
    prompts = make_prompts(2)
    rows = _rows(prompts)
    plan = decide(rows, {prompts[0].token_ids}, TwinCost(CPU, 0.0005), lambda n: 4, Acceptance.flat(0.8),
                  1.05, shared=False)
    assert plan.hands and set(plan.hand) == {"s1-p0-r0", "s1-p0-r1"}
    assert plan.rows == 4 and plan.with_texts == 2 and plan.k == 4 and plan.gain > 1.05


def test_on_shared_devices_a_mixed_tail_stays_plain_until_every_row_has_a_text() -> None:
    prompts = make_prompts(2)
    rows = _rows(prompts)
    args = (TwinCost(CPU, 0.0005), lambda n: 4, Acceptance.flat(0.8), 1.05)
    mixed = decide(rows, {prompts[0].token_ids}, *args, shared=True)
    # the rows left plain would wait on every twin step: the slower group loses
    assert not mixed.hands and mixed.with_texts == 2 and mixed.gain < 1
    whole = decide(rows, {p.token_ids for p in prompts}, *args, shared=True)
    assert set(whole.hand) == set(rows) and whole.gain > 1.05


def test_a_measured_twin_cost_the_gain_does_not_cover_means_no_hand_over() -> None:
    rows = _rows(make_prompts(1))
    texts = {(7, 0)}
    # 1.7 tokens a verify against a twin step 3 ms dearer than a plain one: a loss
    costly = decide(rows, texts, TwinCost(CPU, 0.003), lambda n: 1, Acceptance.flat(0.7), 1.05, shared=True)
    assert not costly.hands and costly.gain < 1
    assert costly.tau == pytest.approx(1.7)
    # the same acceptance pays where the twin's extra is 0.5 ms
    cheap = decide(rows, texts, TwinCost(CPU, 0.0005), lambda n: 1, Acceptance.flat(0.7), 1.05, shared=True)
    assert cheap.hands
    # unmeasured, the prior prices the twin's step at PRIOR_TWIN_RATIO the plain one's
    prior = TwinCost(CPU)
    assert prior.twin_seconds(2, 1) == pytest.approx(PRIOR_TWIN_RATIO * CPU.seconds(2, 1))
    assert tail_gain(prior, 2, 2, 1, 1.7, True) == pytest.approx(1.7 * CPU.seconds(2, 0)
                                                                 / (PRIOR_TWIN_RATIO * CPU.seconds(2, 1)))


def test_twin_cost_is_the_twins_verifying_steps_above_the_plain_replicas_line() -> None:
    spec = Speculation(set(DraftSource))
    assert spec.twin_cost([PLAIN], [TWIN]) == TwinCost(StepCost(1.0, 1 / 32))  # the prior until measured
    _measured(spec, extra_s=0.0012, accept=0.5)
    cost = spec.twin_cost([PLAIN], [TWIN])
    assert cost.plain.fixed_s == pytest.approx(CPU.fixed_s) and cost.plain.per_token_s == pytest.approx(1e-4)
    assert cost.extra_s == pytest.approx(0.0012)
    spec.verifies[TWIN] = [10.0, 50.0, 0.5]  # too few verifying steps: the prior prices them
    assert spec.twin_cost([PLAIN], [TWIN]).extra_s is None


async def test_the_driver_hands_over_only_the_rows_with_texts_and_records_it() -> None:
    prompts = make_prompts(2)
    fleet = TwinFleet(_rows(prompts))
    spec = Speculation({DraftSource.PARTIAL}, SpecRule(max_k=4))
    _measured(spec, extra_s=0.0005, accept=0.9)
    tail = SpecTail(spec, fleet, shared=False)
    await _drive(tail, fleet, _round(prompts, {0}))
    assert fleet.handed == [("s1-p0-r0", "s1-p0-r1")]  # prompt 1 has no text: its rows stay
    await tail.after_round(_result(_round(prompts, {0})))
    record = tail.record()
    assert record["spec_handed_over"] == 2 and record["spec_hand_rows"] == 4
    assert record["spec_hand_with_texts"] == 2 and record["spec_hand_gain"] > 1.05
    assert record["spec_twin_extra_s"] == pytest.approx(0.0005) and record["spec_hand_explore"] == 0


async def test_the_driver_keeps_a_tail_plain_where_the_measured_gain_does_not_pay_then_retries() -> None:
    prompts = make_prompts(1)
    spec = Speculation({DraftSource.PARTIAL}, SpecRule(max_k=4))
    _measured(spec, extra_s=0.004, accept=0.5)  # the running job's noisy twin: 4 ms dearer a verify
    declined = 0
    while True:
        fleet = TwinFleet(_rows(prompts))
        tail = SpecTail(spec, fleet)
        plan = _round(prompts, {0})
        await _drive(tail, fleet, plan)
        await tail.after_round(_result(plan))
        if fleet.handed:
            break
        declined += 1
        assert tail.record()["spec_hand_kept"] == 1 and tail.record()["spec_handed_over"] == 0
    # retried once after declining rounds running, and says so
    assert declined == 4 and tail.record()["spec_hand_explore"] == 1
    assert not spec.explore_due(RoundKind.LONG)
    assert spec.load_state_dict(spec.state_dict()) is None and spec.declined == {"long": 0}


async def test_the_driver_hands_a_high_acceptance_tail_over() -> None:
    prompts = make_prompts(1)
    spec = Speculation({DraftSource.PARTIAL}, SpecRule(max_k=4))
    _measured(spec, extra_s=0.0012, accept=0.9)  # the engine alone: 1.2 ms dearer
    fleet = TwinFleet(_rows(prompts))
    tail = SpecTail(spec, fleet)
    await _drive(tail, fleet, _round(prompts, {0}))
    assert fleet.handed == [("s1-p0-r0", "s1-p0-r1")]
    assert tail._decision is not None and tail._decision.tau > 2 and not tail._decision.explore


async def test_a_sibling_finishing_gives_the_rows_behind_it_a_text_and_the_tail_moves() -> None:
    prompts = make_prompts(2)
    spec = Speculation({DraftSource.PARTIAL, DraftSource.SIBLING}, SpecRule(max_k=4))
    _measured(spec, extra_s=0.0005, accept=0.9)
    fleet = TwinFleet({"s1-p0-r0": (7, 0), "s1-p1-r0": (7, 1), "s1-p1-r1": (7, 1)})
    tail = SpecTail(spec, fleet)
    # prompt 0 has a partial, prompt 1 none: shared devices, mixed tail, nothing moves
    # until prompt 1's first response finishes and its sibling has a text too
    await _drive(tail, fleet, _round(prompts, {0}), [("s1-p1-r0", prompts[1])])
    assert fleet.handed == [("s1-p0-r0", "s1-p1-r1")]
    # the siblings waited for the hand-over, then went to the twin before the rows did
    assert [p.prompt for p in fleet.added] == [DONE.token_ids, (7, 1)]
    assert fleet.events == ["add 2", "hand 2"]


async def test_with_twins_no_sibling_goes_out_before_a_row_is_handed_over() -> None:
    """A twin drafts only for rows it holds; until one is handed over, the siblings
    wait (each call to the twin takes the cores the plain replica decodes on)."""
    prompts = make_prompts(2)
    spec = Speculation({DraftSource.PARTIAL, DraftSource.SIBLING}, SpecRule(max_k=4))
    _measured(spec, extra_s=0.004, accept=0.5)  # too dear: nothing is handed over
    fleet = TwinFleet({"s1-p0-r0": (7, 0), "s1-p1-r0": (7, 1), "s1-p1-r1": (7, 1)})
    tail = SpecTail(spec, fleet)
    await _drive(tail, fleet, _round(prompts, {0}), [("s1-p1-r0", prompts[1])])
    assert fleet.handed == [] and fleet.added == [] and fleet.events == []


def _result(plan: RoundPlan) -> RoundResult:
    return RoundResult(plan, (), (), 0, 0, 0, 0, 0, 0.0, 1.0, 1.0, 0.0, 0.0)


def test_the_tail_window_is_the_time_with_few_requests_in_flight() -> None:
    timeline = ((0.0, 8), (1.0, 4), (1.5, 2), (3.0, 1), (3.5, 0), (4.0, 3))
    assert tail_window_s(timeline, 2) == pytest.approx(2.0)
    assert tail_window_s(timeline, 8) == pytest.approx(3.5)
    assert tail_window_s((), 4) == 0.0
