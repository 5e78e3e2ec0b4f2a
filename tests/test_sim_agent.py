"""The simulator runs trajectories: `AgentEngine` over `SimEngine` with `SimToolEnvs`,
through the real round driver on virtual time. Each trajectory makes its prompt's
calls, each call takes the latency model's draw (a timeout's at most), the round
lasts as long as its slowest trajectory's turns and calls, and the engine idles only
while every trajectory waits on a tool."""

from __future__ import annotations

import hashlib
import math

import pytest

from rpk.agent.engine import AgentEngine
from rpk.core.outcomes import RoundPlan
from rpk.core.records import Prompt, RoundKind
from rpk.loop.rollout import run_round
from rpk.sched.toolwait import LatencyModel
from rpk.sim import CostModel, SimEngine
from rpk.sim.agent import SimObservation, SimToolEnvs
from tests.fakes import LengthScorer, mean_centred


def _round(latency: LatencyModel, calls: dict[str, int], timeout_s: float = 30.0):
    ps = [Prompt(uid, (7, i), "test", "0") for i, uid in enumerate(calls)]
    sim = SimEngine(lambda r: 20, cost=CostModel(base_s=0.01, per_seq_s=0.0), chunk=5)
    envs = SimToolEnvs(sim.node, latency, lambda p: calls[p.uid], timeout_s)
    engine = AgentEngine(sim, envs, SimObservation(4), {p.uid: p for p in ps}, max_turns=16,
                         clock=sim.clock)
    plan = RoundPlan(1, RoundKind.SYNC, tuple(ps), 2, 2, len(ps), 2000, seed=3)
    return sim, envs, engine, run_round(plan, engine, LengthScorer(10**6), mean_centred,
                                        version=0, clock=sim.clock)


async def test_trajectories_take_their_turns_and_tool_draws_on_virtual_time() -> None:
    """Two prompts of 3 and 1 calls, two trajectories each: every trajectory's tool
    seconds are its draws, its turns one more than its calls, and the round lasts as
    long as the slowest trajectory's 20-token turns (0.2 s each) and calls."""
    latency = LatencyModel(1.0, 4.0)
    sim, envs, engine, running = _round(latency, {"a": 3, "b": 1})
    result = await running
    await sim.shutdown()
    expected = {}
    for env in envs.made:
        expected[id(env)] = sum(env.wait(n) for n in range(env.calls))
    members = [m for g in result.groups for m in g.members]
    assert sorted(m.response.turns.turns for m in members) == [2, 2, 4, 4]
    assert sorted(m.response.turns.tools.seconds for m in members) == pytest.approx(
        sorted(expected.values()))
    longest = max(env.calls * 0.2 + 0.2 + expected[id(env)] for env in envs.made)
    assert result.ended_at - result.started_at == pytest.approx(longest, abs=0.05)
    assert all(env.closed for env in envs.made) and len(envs.made) == 4
    # The engine idled only while all trajectories waited on tools: the whole idle
    # time was tool time exposed.
    lap = engine.lap()
    assert lap["tool_exposed_s"] == pytest.approx(lap["engine_idle_s"])
    assert 0 < lap["engine_idle_s"] < longest


async def test_a_call_that_never_answers_ends_at_the_timeout() -> None:
    latency = LatencyModel(1.0, 4.0, timeout_frac=0.999)
    sim, envs, engine, running = _round(latency, {"a": 2}, timeout_s=5.0)
    result = await running
    await sim.shutdown()
    for m in result.groups[0].members:
        t = m.response.turns
        assert (t.tools.calls, t.tools.failures, t.tools.seconds) == (2, 2, 10.0)
    assert all(math.isinf(env.wait(0)) for env in envs.made)
    assert result.ended_at - result.started_at == pytest.approx(10.0 + 3 * 0.2, abs=0.05)


def test_the_simulators_draws_are_keyed_on_the_prompt_and_its_trajectorys_number() -> None:
    """The n-th trajectory of prompt `uid` draws with the hash of `uid:n` as its seed,
    as the simulator always has (its benchmarks' figures replay)."""
    latency = LatencyModel(1.0, 4.0, timeout_frac=0.1)
    sim = SimEngine(lambda r: 20)
    envs = SimToolEnvs(sim.node, latency, lambda p: 3, 5.0)
    first, second = envs.draws.start("a"), envs.draws.start("a")

    def seed(uid: str, n: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{uid}:{n}".encode(), digest_size=8).digest(), "big")

    assert [first(c) for c in range(20)] == [latency.seconds(seed("a", 0), c) for c in range(20)]
    assert [second(c) for c in range(20)] == [latency.seconds(seed("a", 1), c) for c in range(20)]
