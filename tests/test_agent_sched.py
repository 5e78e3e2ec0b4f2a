"""Scheduling that knows about tools, on virtual time (the simulator's engine, scripted
tools): length_aware predicts a trajectory's cost from its tokens and its tool seconds,
so a prompt whose tools are slow goes to the long round even though its trajectories
sample no more tokens than the others; the predictor learns tool seconds per prompt
and per data source; a guess lengthened by a wait keeps its tokens' uncertainty."""

from __future__ import annotations

import math

import pytest

from rpk.agent.engine import AgentEngine
from rpk.core.outcomes import PromptLengths
from rpk.core.records import Prompt, RoundKind
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policy import LengthAwarePolicy, Sampling
from rpk.sched.predictor import LengthGuess, LengthPredictor
from rpk.sim import CostModel, SimEngine
from tests.agent_fakes import FixedObservation, SlowTools
from tests.fakes import LengthScorer, RecordingTrainer, mean_centred

SLOW = {"p0", "p1"}


async def test_length_aware_sends_prompts_with_slow_tools_to_the_long_round() -> None:
    """Eight prompts whose trajectories all sample 3 turns of 20 tokens; p0's and p1's
    two tool calls take 3 virtual seconds each, the others' 0.01 s. Draws of 8 prompts,
    2 a step (3 short rounds, then the long round of the 2 guessed costliest). In the
    second draw, every prompt seen once, the long round is p0 and p1: by tokens alone
    they tie with the rest, and ties go in draw order (p6, p7 last)."""
    ps = [Prompt(f"p{i}", (7, i), "test", str(i)) for i in range(8)]
    sim = SimEngine(lambda r: 20, cost=CostModel(base_s=0.01, per_seq_s=0.0), chunk=5)
    engine = AgentEngine(sim, lambda: SlowTools(sim, 2, lambda p: 3.0 if p.uid in SLOW else 0.01),
                         FixedObservation(), {p.uid: p for p in ps}, max_turns=8, clock=sim.clock)
    policy = LengthAwarePolicy(ps, Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=600),
                               lookahead_rounds=4, shuffle=False)
    trainer = AsyncTrainer(RecordingTrainer())
    try:
        outcomes = [await run_step(step, policy, engine, LengthScorer(10**6), trainer, mean_centred,
                                   version=0, clock=sim.clock) for step in range(1, 9)]
    finally:
        await trainer.aclose()
        await sim.shutdown()
    assert [o.round.plan.kind for o in outcomes] == ([RoundKind.SHORT] * 3 + [RoundKind.LONG]) * 2
    assert {g.prompt.uid for g in outcomes[7].round.groups} == SLOW
    assert policy.step_s > 0
    guesses = {p.uid: policy.predictor.predict(p) for p in ps}
    assert all(guesses[u].tool_s == pytest.approx(6.0, rel=0.01) for u in SLOW)
    assert all(guesses[u].tool_s == pytest.approx(0.02, rel=0.01) for u in guesses if u not in SLOW)


def test_the_predictor_learns_tool_seconds_per_prompt_and_per_source() -> None:
    predictor = LengthPredictor(max_tokens=600)
    slow, quick, fresh = (Prompt(u, (1, 2), "src", "") for u in ("slow", "quick", "fresh"))
    other = Prompt("other", (1, 2), "elsewhere", "")
    predictor.observe([PromptLengths(slow, (50, 60), (), True, (4.0, 6.0)),
                       PromptLengths(quick, (50, 60), (), True, (0.0, 0.0))])
    assert predictor.predict(slow).tool_s == pytest.approx(5.0)
    assert predictor.predict(quick).tool_s == 0.0
    assert predictor.predict(fresh).tool_s == pytest.approx(2.5)  # the source's mean
    assert predictor.predict(other).tool_s == 0.0
    # The latest round counts most: the slow prompt's tools got quick.
    predictor.observe([PromptLengths(slow, (50, 60), (), True, (1.0, 1.0))])
    assert 1.0 < predictor.predict(slow).tool_s < 3.0
    restored = LengthPredictor(max_tokens=600)
    restored.load_state_dict(predictor.state_dict())
    assert restored.predict(slow) == predictor.predict(slow)


def test_a_wait_lengthens_a_guess_in_decode_steps() -> None:
    guess = LengthGuess(math.log(100), 0.4, 0.3, 1, tool_s=2.0)
    waited = guess.waiting(300.0)
    assert math.exp(waited.mu) == pytest.approx(400.0)
    assert waited.sigma == pytest.approx(0.1)  # the tokens are a quarter of the cost
    assert waited.key > guess.key and guess.waiting(0.0) is guess
