"""The parallelism planner on its own: the paper's rule, per round kind, bounds,
hysteresis, fixed mode, checkpoints."""

from __future__ import annotations

import json

import pytest

from rpk.core.records import RoundKind
from rpk.sched.tp_planner import PlannerConfig, RoundLoad, TPPlanner

SHORT, LONG = RoundKind.SHORT, RoundKind.LONG


def planner(mode: str = "elastic", sizes=(1, 2, 4), initial: int = 1) -> TPPlanner:
    return TPPlanner(PlannerConfig(mode, tuple(sizes), initial))


def run(p: TPPlanner, kind: RoundKind, preemptions: int):
    """One round of `kind` at the TP the planner picks; the decision after it."""
    return p.observe(RoundLoad(kind, p.decide(kind), preemptions))


def test_a_rise_of_preemptions_doubles_tp_and_a_fall_keeps_it():
    p = planner()
    d = run(p, SHORT, 40)  # the first round compares with none: any preemption is a rise
    assert (d.previous, d.tp, d.changed) == (1, 2, True)
    assert "40 preemptions > 1.05 x 0" in d.reason and "tp 1 -> 2" in d.reason
    d = run(p, SHORT, 25)  # fewer at tp 2: no rise
    assert (d.tp, d.changed) == (2, False) and "not above 1.05 x 40" in d.reason


def test_only_a_rise_above_1_05_times_the_last_round_counts():
    p = planner(initial=2)
    run(p, SHORT, 1)  # 1 > 0: tp 2 -> 4
    assert p.decide(SHORT) == 4
    assert run(p, SHORT, 100).tp == 4  # at the largest layout: stays
    assert not run(p, SHORT, 105).changed  # 105 <= 1.05 x 100
    d = run(p, SHORT, 111)  # 111 > 1.05 x 105, but 4 is the largest
    assert d.tp == 4 and "largest layout" in d.reason


def test_four_calm_rounds_halve_tp_down_to_the_smallest_layout():
    p = planner(initial=4)
    for i in range(3):
        d = run(p, SHORT, 0)
        assert d.tp == 4 and f"{i + 1} of 4 calm rounds" in d.reason
    d = run(p, SHORT, 0)
    assert (d.previous, d.tp) == (4, 2) and "4 calm rounds: tp 4 -> 2" in d.reason
    for _ in range(4):
        d = run(p, SHORT, 0)
    assert d.tp == 1
    for _ in range(4):
        d = run(p, SHORT, 0)
    assert d.tp == 1 and "smallest layout" in d.reason


def test_a_preempting_round_resets_the_calm_count():
    p = planner(initial=2)
    for _ in range(4):
        run(p, SHORT, 0)
    assert p.decide(SHORT) == 1  # the 4th calm round halved it
    p2 = planner(initial=2)
    run(p2, SHORT, 3)  # rise: 2 -> 4
    run(p2, SHORT, 2)  # fewer: stays, calm 0
    for _ in range(3):
        run(p2, SHORT, 0)
    assert p2.decide(SHORT) == 4  # only 3 calm rounds since the last preemption


def test_round_kinds_keep_their_own_tp_and_history():
    p = planner()
    assert p.decide(LONG) == 1  # nothing observed yet: the initial TP
    run(p, LONG, 0)
    run(p, SHORT, 50)
    assert p.decide(SHORT) == 2 and p.decide(LONG) == 1
    d = run(p, LONG, 0)
    assert d.tp == 1 and d.kind is LONG and "long round at tp 1: 0 preemptions" in d.reason
    run(p, SHORT, 30)  # compared with the last *short* round (50): no rise
    assert p.decide(SHORT) == 2


def test_a_kinds_first_round_starts_where_the_last_kind_ended_up():
    p = planner()
    run(p, SHORT, 50)  # short rounds preempt at tp 1: 1 -> 2
    d = run(p, LONG, 0)
    assert d.previous == 2 and d.kind is LONG


def measured(p: TPPlanner, kind: RoundKind, preemptions: int, tokens_per_s: float):
    return p.observe(RoundLoad(kind, p.decide(kind), preemptions, seconds=10.0,
                               tokens=round(10 * tokens_per_s)))


def test_a_tp_that_ran_a_kind_slower_is_left_at_once_and_not_moved_to_again():
    p = planner(sizes=(1, 2))
    assert measured(p, SHORT, 30, 1000).tp == 2  # first preemptions: try tp 2
    d = measured(p, SHORT, 20, 900)  # fewer preemptions, but slower than tp 1: back at once
    assert (d.previous, d.tp) == (2, 1)
    assert "tp 2 ran these rounds 10% slower (900 vs 1000 tokens/s) than tp 1" in d.reason
    d = measured(p, SHORT, 40, 1000)  # preemptions rise again, but tp 2 measured slower
    assert d.tp == 1 and "but tp 2 ran these rounds 10% slower" in d.reason and "stays" in d.reason
    assert measured(p, SHORT, 50, 1000).tp == 1


def test_within_the_margin_the_paper_rule_decides():
    p = planner(sizes=(1, 2))
    measured(p, SHORT, 30, 1000)
    for _ in range(3):
        assert measured(p, SHORT, 0, 960).tp == 2  # 4% slower: not a verdict
    assert measured(p, SHORT, 0, 960).tp == 1  # the 4th calm round halves
    assert measured(p, SHORT, 40, 1000).tp == 2  # and a rise doubles again


def test_calm_rounds_do_not_halve_to_a_tp_measured_slower():
    p = planner(sizes=(1, 2))
    measured(p, LONG, 30, 400)  # tp 1 preempted and crawled: 1 -> 2
    for _ in range(3):
        measured(p, LONG, 0, 800)
    d = measured(p, LONG, 0, 800)
    assert d.tp == 2 and "4 calm rounds, but tp 1 ran these rounds 50% slower" in d.reason
    assert measured(p, LONG, 0, 800).tp == 2  # the calm count starts anew


def test_halved_then_pushed_straight_back_up_waits_twice_as_long_to_halve_again():
    p = planner(sizes=(1, 2), initial=2)
    for _ in range(4):
        run(p, SHORT, 0)
    assert p.decide(SHORT) == 1
    d = run(p, SHORT, 20)  # right after the halving, preemptions are back
    assert d.tp == 2 and "next halving after 8 calm rounds" in d.reason
    for i in range(7):
        assert run(p, SHORT, 0).tp == 2, i
    assert run(p, SHORT, 0).tp == 1  # the 8th calm round


def test_fixed_mode_never_moves_but_reports():
    p = planner(mode="fixed", sizes=(2,), initial=2)
    d = run(p, SHORT, 500)
    assert (d.tp, d.changed) == (2, False) and "500 preemptions" in d.reason and "fixed" in d.reason
    for _ in range(10):
        assert run(p, SHORT, 0).tp == 2


def test_a_round_at_a_tp_not_built_is_a_bug():
    with pytest.raises(ValueError, match="tp 8"):
        planner().observe(RoundLoad(SHORT, 8, 0))


def test_state_round_trips_through_json_and_survives_other_layouts():
    p = planner()
    run(p, SHORT, 40)
    run(p, LONG, 0)
    state = json.loads(json.dumps(p.state_dict()))
    q = planner()
    q.load_state_dict(state)
    assert q.decide(SHORT) == 2 and q.decide(LONG) == 2  # long started where short ended up
    assert not run(q, SHORT, 41).changed  # the last short round's 40 came along: 41 <= 42
    r = planner(sizes=(1, 2))
    measured(r, SHORT, 30, 1000)
    measured(r, SHORT, 0, 800)
    s = planner(sizes=(1, 2))
    s.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert s.state_dict() == r.state_dict()  # the measured rates too (their keys are ints)
    fewer = planner(sizes=(1,), initial=1)
    fewer.load_state_dict(state)
    assert fewer.decide(SHORT) == 1  # resumed without the tp 2 layout: the nearest below
    assert p.metrics() == {"tp_planned_long": 2.0, "tp_planned_short": 2.0}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "wild", "tp_sizes": (1,), "initial": 1}, "mode"),
        ({"mode": "fixed", "tp_sizes": (2, 1), "initial": 1}, "ascending"),
        ({"mode": "fixed", "tp_sizes": (1, 2), "initial": 4}, "initial tp 4"),
        ({"mode": "fixed", "tp_sizes": (1,), "initial": 1, "rise": 0.9}, "rise"),
        ({"mode": "fixed", "tp_sizes": (1,), "initial": 1, "slower": 1.0}, "slower"),
    ],
)
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kwargs)
