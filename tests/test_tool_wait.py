"""Provisioning that prices the tool-wait tail (rpk.sched.toolwait): one call in a
hundred that never answers is rare per call, not per round. A trajectory of k calls
times out with probability 1 - (1 - p)^k; length_aware's over-provisioning draws each
trajectory's wait with that tail, from the task tool's latency model or from the
rounds' per-call figures, and a short round with a hung call then has spares and does
not wait for it. Virtual time and the simulator's engine throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvStep
from rpk.core.outcomes import PromptLengths
from rpk.core.records import Prompt, RoundKind, ToolUse
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policy import LengthAwarePolicy, Sampling
from rpk.sched.predictor import LengthGuess
from rpk.sched.provision import CostCurve, EtaChooser
from rpk.sched.toolwait import CallLog, LatencyModel, ToolWait, wait_seconds
from rpk.sim import CostModel, SimEngine
from tests.agent_fakes import FixedObservation
from tests.fakes import LengthScorer, RecordingTrainer, mean_centred

# A throughput-bound engine (a CPU's curve): waste is dear, so a wait priced at its
# mean buys no spares.
CPU = (0.002, 0.001)
TIMEOUT_S = 10.0


def test_a_trajectory_of_k_calls_times_out_with_probability_one_minus_q_to_the_k() -> None:
    lat = LatencyModel(0.5, 2.5, 0.01)
    assert lat.sigma == pytest.approx(math.log(5) / 2.3263, rel=1e-4)
    assert lat.p_timeout_of(np.array([1.0, 4.0, 0.0])) == pytest.approx([0.01, 1 - 0.99**4, 0.0])
    answered = 0.5 * math.exp(lat.sigma**2 / 2)
    assert lat.answered_mean_s(TIMEOUT_S) == pytest.approx(answered)
    assert lat.answered_mean_s(0.1) == 0.1
    with pytest.raises(ValueError, match="timeout_frac=1.0"):
        LatencyModel(0.5, 0.6, 1.0)
    with pytest.raises(ValueError, match="timeout_s=inf"):
        ToolWait(lat, math.inf, 0.01)


def _mean_wait(lat: LatencyModel, calls: float) -> float:
    """A trajectory's expected seconds in `calls` calls, the timeouts included."""
    p = lat.timeout_frac
    return calls * ((1 - p) * lat.answered_mean_s(TIMEOUT_S) + p * TIMEOUT_S)


def test_drawn_waits_hold_the_timeout_tail_and_keep_the_mean() -> None:
    lat = LatencyModel(0.5, 2.5, 0.02)
    calls = np.array([1.0, 4.0, 0.0])
    waits = wait_seconds(np.random.default_rng(0), calls, lat, TIMEOUT_S, (20000, 3, 1))
    hung = (waits >= TIMEOUT_S).mean(axis=(0, 2))
    assert hung[0] == pytest.approx(0.02, abs=0.005)
    assert hung[1] == pytest.approx(1 - 0.98**4, abs=0.01)
    assert hung[2] == 0.0 and (waits[:, 2] == 0).all()
    assert waits[:, 1].mean() == pytest.approx(_mean_wait(lat, 4), rel=0.05)


def test_the_call_log_gives_per_call_figures_from_trajectories() -> None:
    log = CallLog(TIMEOUT_S)
    log.observe([2.0] * 8, [4] * 8)
    assert log.latency() is None  # too few trajectories yet
    # 96 trajectories of 4 calls of 0.5 s; 4 with a hung call (at least the timeout).
    log.observe([2.0] * 88 + [11.5] * 4, [4] * 92)
    lat = log.latency()
    assert lat is not None
    assert lat.median_s == pytest.approx(0.5)
    assert float(lat.p_timeout_of(np.array(4.0))) == pytest.approx(4 / 100)
    restored = CallLog(TIMEOUT_S)
    restored.load_state_dict(log.state_dict())
    assert restored.latency() == lat


def _guesses(lat: LatencyModel, n: int = 24) -> list[LengthGuess]:
    return [LengthGuess(math.log(100), 0.1, 0.1, 3, tool_s=_mean_wait(lat, 3), tool_calls=3)] * n


def test_tail_pricing_provisions_spares_where_the_mean_wait_buys_none() -> None:
    """Sure guesses of 100 tokens and 3 calls each (1% of calls never answer, 10 s):
    at the mean wait no speculation pays; with each trajectory's chance of a timeout
    drawn, extra prompts do, and the round is priced dearer than the mean said."""
    lat = LatencyModel(0.5, 2.5, 0.01)
    step_s = CPU[0] + CPU[1] * 32
    guesses = _guesses(lat)
    chooser = EtaChooser()
    common = dict(p0=8, r0=4, max_tokens=2000, cost=CPU, concurrency=256, seed=1)
    mean = chooser.choose([g.waiting(g.tool_s / step_s) for g in guesses], **common)
    tail = chooser.choose(guesses, **common, tools=ToolWait(lat, TIMEOUT_S, step_s))
    assert mean.eta_prompts == 1.0 and mean.reason.startswith("least speculation")
    assert tail.eta_prompts > 1.0 and tail.prompts > 8
    assert tail.baseline_s > mean.baseline_s


def test_no_tool_calls_price_as_no_tools() -> None:
    lat = LatencyModel(0.5, 2.5, 0.01)
    guesses = [LengthGuess(math.log(100), 0.5, 0.3, 0)] * 24
    common = dict(p0=8, r0=4, max_tokens=2000, cost=(0.015, 5e-5), concurrency=256, seed=3)
    chooser = EtaChooser()
    plain = chooser.choose(guesses, **common)
    tooled = chooser.choose(guesses, **common, tools=ToolWait(lat, TIMEOUT_S, 0.02))
    assert tooled == plain


def test_the_cost_curve_keeps_its_last_fit_through_rounds_that_add_no_windows() -> None:
    curve = CostCurve()
    # 8 requests in flight, one finishing every 10 steps of 12 ms (8 ms + 0.5 ms each).
    finishes = [(0.12 * i, 10 * i) for i in range(1, 9)]
    timeline = [(0.0, 8)] + [(t, 8 - i) for i, (t, _) in enumerate(finishes, 1)]
    curve.observe(finishes, timeline, capacity=64, launched=8)
    curve.observe(finishes, timeline, capacity=64, launched=8)
    fitted = curve.fit()
    assert fitted is not None
    # Trajectories: finishes spaced by tool waits, no window of 8 steps between them.
    for _ in range(6):
        curve.observe([(1.0, 80), (2.0, 82), (3.0, 81)], [(0.0, 3), (3.0, 0)], capacity=64, launched=3)
    assert curve._fit() is None  # the decayed stats alone no longer fit
    assert curve.fit() == pytest.approx(fitted, abs=1e-9)
    restored = CostCurve()
    restored.load_state_dict(curve.state_dict())
    assert restored.fit() == curve.fit()


class _OneHangs:
    """Two tool calls of 0.1 virtual seconds, except the very first trajectory's first
    call, which never answers and ends at the timeout."""

    made = 0

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.hangs = _OneHangs.made == 0
        _OneHangs.made += 1
        self.calls = 0

    async def reset(self, prompt: Prompt) -> None:
        pass

    async def step(self, turn_text: str) -> EnvStep:
        self.calls += 1
        if self.calls > 2:
            return EnvStep(done=True)
        seconds = TIMEOUT_S if self.hangs and self.calls == 1 else 0.1
        await self.engine.node.sleep_until(self.engine.clock() + seconds)
        return EnvStep(({"role": "tool", "content": "r"},), 
                       tools=ToolUse(calls=1, failures=int(seconds >= TIMEOUT_S), seconds=seconds))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("tail", [True, False])
async def test_a_short_round_with_a_hung_call_does_not_wait_for_it_when_the_tail_is_priced(tail: bool) -> None:
    """Sixteen prompts seen before (trajectories of 3 turns of 20 tokens and 2 calls),
    4 a step, groups of 2, on a CPU's cost curve; the round's first trajectory hangs
    in its first call until the 10 s timeout. Priced with the tail (1% of calls), the
    round launches spare prompts and ends with the others' groups, the hung one
    aborted; priced at the mean wait it launches none and waits out the timeout."""
    _OneHangs.made = 0
    ps = [Prompt(f"p{i}", (7, i), "tools", str(i)) for i in range(16)]
    sim = SimEngine(lambda r: 20, cost=CostModel(base_s=CPU[0], per_seq_s=CPU[1]), chunk=5)
    engine = AgentEngine(sim, lambda: _OneHangs(sim), FixedObservation(), {p.uid: p for p in ps},
                         max_turns=8, clock=sim.clock)
    lat = LatencyModel(0.1, 0.3, 0.01)
    policy = LengthAwarePolicy(
        ps, Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=600), lookahead_rounds=4,
        shuffle=False, tool_latency=lat if tail else None,
        tool_timeout_s=TIMEOUT_S if tail else None,
    )
    for _ in range(3):
        policy.predictor.observe([PromptLengths(p, (60, 60), (), True, (0.2, 0.2), (2, 2)) for p in ps])
    policy.cost.last = CPU
    trainer = AsyncTrainer(RecordingTrainer())
    try:
        outcome = await run_step(1, policy, engine, LengthScorer(10**6), trainer, mean_centred,
                                 version=0, clock=sim.clock)
    finally:
        await trainer.aclose()
        await sim.shutdown()
    rnd = outcome.round
    assert rnd.plan.kind is RoundKind.SHORT and len(rnd.groups) == 4
    took = rnd.ended_at - rnd.started_at
    if tail:
        assert len(rnd.plan.prompts) > 4, policy.provision
        assert took < 2.0
        assert rnd.incomplete  # the hung trajectory's prompt, left for a later round
    else:
        assert len(rnd.plan.prompts) == 4, policy.provision
        assert took >= TIMEOUT_S


def test_a_run_prices_the_task_tools_configured_latency_and_learns_other_tools() -> None:
    from rpk import config
    from rpk.assembly import build_round_policy, tool_timing

    ps = [Prompt(f"p{i}", (7, i), "tools", str(i)) for i in range(64)]

    def policy(*args: str) -> LengthAwarePolicy:
        cfg = config.from_argv(["--rollout.policy", "length_aware", *args])
        made = build_round_policy(cfg.rollout, ps, tools=tool_timing(cfg))
        assert isinstance(made, LengthAwarePolicy)
        return made

    builtin = policy("--data.task", "tool_add", "--agent.tool_latency.timeout_frac", "0.02",
                     "--agent.tool_timeout_s", "5")
    assert builtin.tool_latency == LatencyModel(0.5, 2.5, 0.02) and builtin.calls is not None
    assert builtin.calls.timeout_s == 5.0
    instant = policy("--data.task", "tool_add", "--agent.tool_latency.median_s", "0")
    assert instant.tool_latency is None  # the tool answers at once: nothing to price
    own = policy("--data.task", "tool_add", "--agent.tools", "tests.user_tools:price")
    assert own.tool_latency is None and own.calls is not None and own.calls.timeout_s == 10.0
    single = policy()
    assert single.tool_latency is None and single.calls is None


@pytest.mark.parametrize("tail", [True, False])
def test_before_the_cost_curve_is_fitted_only_the_tail_buys_spares(tail: bool) -> None:
    """No cost curve yet, a step's seconds known from the first round: priced with the
    tail, the plan speculates on the curve that prices waste dearest (all of a step per
    sequence); without it, the least speculation, as before any curve."""
    ps = [Prompt(f"p{i}", (7, i), "tools", str(i)) for i in range(64)]
    lat = LatencyModel(0.5, 2.5, 0.01)
    policy = LengthAwarePolicy(ps, Sampling(prompts_per_step=8, responses_per_prompt=4, max_tokens=2000),
                               lookahead_rounds=8, shuffle=False, tool_latency=lat if tail else None,
                               tool_timeout_s=TIMEOUT_S if tail else None)
    for _ in range(3):
        policy.predictor.observe([PromptLengths(p, (100,) * 4, (), True, (1.6,) * 4, (3,) * 4) for p in ps])
    policy.step_s = CPU[0] + CPU[1] * 32
    assert policy.cost.fit() is None
    plan = policy.plan(1)
    assert policy.provision is not None
    if tail:
        assert len(plan.prompts) > 8, policy.provision
    else:
        assert len(plan.prompts) == 8 and policy.provision.reason.startswith("cost curve not measured")
