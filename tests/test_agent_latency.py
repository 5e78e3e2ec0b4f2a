"""The tool latency model (`rpk.sched.toolwait.LatencyModel`) and the built-in task's tool under it:
the draws have the median, p99 and timeout share asked for, replay exactly per (seed,
call) whatever else was drawn, and the adder answers after its draw (or never, ended by
the runner's timeout), on the event loop's clock."""

from __future__ import annotations

import asyncio
import functools
import math
import time

import pytest

from rpk.agent.parse import ToolCall
from rpk.agent.tools import ToolRunner, calculator
from rpk.assembly import agent_tools
from rpk.config import ConfigError, from_argv
from rpk.obs.metrics import percentile
from rpk.sched.toolwait import LatencyDraws, LatencyModel
from rpk.tasks import task
from rpk.tasks.tool_add import Adder


def test_draws_have_the_median_p99_and_timeout_share_asked_for() -> None:
    model = LatencyModel(0.5, 2.5, timeout_frac=0.02)
    draws = [model.seconds(seed, call) for seed in range(200) for call in range(100)]
    hung = [d for d in draws if math.isinf(d)]
    answered = [d for d in draws if math.isfinite(d)]
    assert len(hung) / len(draws) == pytest.approx(0.02, abs=0.004)
    assert percentile(answered, 50) == pytest.approx(0.5, rel=0.04)
    assert percentile(answered, 99) == pytest.approx(2.5, rel=0.1)
    assert min(answered) > 0


def test_a_draw_is_the_same_for_a_seed_and_call_whatever_was_drawn_before() -> None:
    model = LatencyModel(0.5, 2.5, timeout_frac=0.01)
    forward = [model.seconds(7, call) for call in range(50)]
    backward = [model.seconds(7, call) for call in reversed(range(50))][::-1]
    assert forward == backward
    assert forward != [model.seconds(8, call) for call in range(50)]
    # Answered calls take nothing at median 0; the share that never answers still hangs.
    instant = [LatencyModel(0.0, 0.0, 0.5).seconds(7, call) for call in range(100)]
    assert set(instant) == {0.0, math.inf}


@pytest.mark.parametrize("median, p99, frac, message", [
    (-1.0, 1.0, 0.0, "median_s=-1.0"), (1.0, 0.5, 0.0, "p99_s=0.5"),
    (1.0, math.inf, 0.0, "p99_s=inf"), (1.0, 2.0, 1.0, "timeout_frac=1.0"),
])
def test_bad_settings_are_named(median, p99, frac, message) -> None:
    with pytest.raises(ValueError, match=message):
        LatencyModel(median, p99, frac)


def test_config_refuses_a_p99_below_the_median() -> None:
    with pytest.raises(ConfigError, match="p99_s"):
        from_argv(["--agent.tool_latency.median_s", "1", "--agent.tool_latency.p99_s", "0.5"])


async def test_the_adder_answers_after_its_draw_and_a_hung_call_times_out() -> None:
    """Seed 3's calls under a model with 30% hung calls: each call answers after the
    model's seconds for its number, or runs into the caller's 0.4 s timeout; a hung
    call counts, so the next draws afresh."""
    model = LatencyModel(0.05, 0.2, timeout_frac=0.3)
    adder = Adder(seed=3, fail_rate=0.0, latency=LatencyDraws(model))
    expected = [model.seconds("3/0", n) for n in range(8)]
    assert any(math.isinf(e) for e in expected) and any(math.isfinite(e) for e in expected)
    for want in expected:
        started = time.monotonic()
        try:
            async with asyncio.timeout(0.4):
                out = await adder("1", "2", 0)
        except TimeoutError:
            assert math.isinf(want)
            assert time.monotonic() - started == pytest.approx(0.4, abs=0.1)
            continue
        assert out == "3 carry=0"
        assert time.monotonic() - started == pytest.approx(want, abs=0.05)
    assert adder.calls == len(expected)


def test_each_trajectory_of_a_row_draws_its_own_waits_and_replays() -> None:
    """A row's trajectories (its responses, its next round's) wait apart: a timeout on
    one says nothing of the next; a run's n-th trajectory of a row waits as the n-th
    of another run does."""
    model = LatencyModel(0.5, 2.5, timeout_frac=0.05)
    first, again = LatencyDraws(model), LatencyDraws(model)
    a, b = first.start(7), first.start(7)
    calls = range(200)
    assert [a(n) for n in calls] != [b(n) for n in calls]
    hung_a = {n for n in calls if math.isinf(a(n))}
    hung_b = {n for n in calls if math.isinf(b(n))}
    assert hung_a and hung_b and hung_a != hung_b
    a2, b2 = again.start(7), again.start(7)
    assert [a2(n) for n in calls] == [a(n) for n in calls]
    assert [b2(n) for n in calls] == [b(n) for n in calls]
    assert [first.start(8)(n) for n in calls] == [again.start(8)(n) for n in calls]


async def test_the_built_in_tasks_tool_runs_under_the_configured_latency() -> None:
    """`data.task tool_add`'s tools, as the run builds them, answer after the configured
    model's draw for the row's seed; a user's own tool is not slowed."""
    cfg = from_argv(["--data.task", "tool_add", "--agent.tool_latency.median_s", "0.2",
                     "--agent.tool_latency.p99_s", "0.3", "--agent.tool_latency.timeout_frac", "0"])
    (tool,) = agent_tools(cfg.agent, task(cfg.data.task))
    runner = ToolRunner([tool], timeout_s=5.0)
    bound = runner.bind({"add": {"create_kwargs": {"seed": 11}}})
    result = await runner.run(ToolCall("add", {"a": "A1", "b": "a2", "carry": 0}), bound)
    assert result.text == "sA3 carry=0"
    assert result.seconds == pytest.approx(LatencyModel(0.2, 0.3).seconds("11/0", 0), abs=0.05)
    user = from_argv(["--data.task", "tool_add", "--agent.tools", "calculator"])
    assert [t.fn for t in agent_tools(user.agent, task(user.data.task))] == [calculator]
    # median_s 0: the task's tool answers at once, none of its calls hang.
    instant = from_argv(["--data.task", "tool_add", "--agent.tool_latency.median_s", "0"])
    (plain,) = agent_tools(instant.agent, task(instant.data.task))
    assert not isinstance(plain.fn, functools.partial)
