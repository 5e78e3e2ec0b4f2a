"""Tail batching (RollPacker) on scripted engines: short rounds over-provision and defer
the long tail, long rounds run the queue, and no prompt is lost or trained twice."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpk.core.records import RoundKind
from rpk.loop.step import run_step
from rpk.sched.policy import LengthAwarePolicy, OversamplePolicy, Sampling, TailPolicy
from rpk.sched.provision import EtaBounds
from tests.fakes import LengthScorer, lengths_engine, make_prompts, mean_centred, recording_runner
from tests.helpers import waiting


async def run_steps(policy, engine, steps: int, first: int = 1):
    outcomes = []
    async with recording_runner() as runner:
        for step in range(first, first + steps):
            outcomes.append(
                await run_step(step, policy, engine, LengthScorer(threshold=30), runner,
                               mean_centred, version=runner.version)
            )
    return outcomes


def test_short_round_over_provisions_prompts_and_responses():
    policy = TailPolicy(make_prompts(20), Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=64))
    plan = policy.plan(1)
    assert plan.kind is RoundKind.SHORT
    assert len(plan.prompts) == 5 and plan.responses_per_prompt == 5
    assert plan.group_size == 4 and plan.groups_needed == 4


async def test_long_tail_prompts_are_deferred_then_run_in_a_long_round():
    prompts = make_prompts(40)
    # one prompt in five is slow: each short round (5 prompts) defers exactly that one
    base = {p.uid: (300 if i % 5 == 0 else 10) for i, p in enumerate(prompts)}
    engine = lengths_engine(base)
    policy = TailPolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=512),
                        shuffle=False)
    outcomes = await run_steps(policy, engine, 5)
    kinds = [o.round.plan.kind for o in outcomes]
    assert kinds == [RoundKind.SHORT] * 4 + [RoundKind.LONG]
    for o in outcomes[:4]:
        r = o.round
        assert len(r.groups) == 4 and r.aborted > 0
        assert all(base[g.prompt.uid] == 10 for g in r.groups)
        # the slow prompt's responses were cut off, not run to 300 tokens
        assert max(len(m.response.token_ids) for g in r.groups for m in g.members) < 30
    long_round = outcomes[4].round
    assert {g.prompt.uid for g in long_round.groups} == {"p0", "p5", "p10", "p15"}
    assert long_round.plan.responses_per_prompt == 4 and long_round.aborted == 0
    assert all(len(m.response.token_ids) >= 300 for g in long_round.groups for m in g.members)
    assert engine.running == set()
    assert list(policy.queue) == []
    # Tail keeps no cut-off tokens: one output per request is enough (and reproducible).
    assert engine.seen and not any(r.progress for r in engine.seen)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=1, max_value=120), min_size=12, max_size=12),
       st.sampled_from([(1.25, 1.25), (1.5, 1.0), (1.0, 1.5), (2.0, 2.0), "length_aware"]))
async def test_every_prompt_of_an_epoch_is_trained_once_or_queued(lengths, etas):
    # 12 prompts: a whole number of short rounds (2, 3 or 4 prompts each) and of
    # length_aware's draws (3 rounds of 2) per epoch, so stopping at the epoch boundary
    # leaves no prompt of the next epoch in play. The scripted engine runs on the wall
    # clock, so length_aware speculates by whatever cost it measures.
    prompts = make_prompts(12)
    base = {p.uid: n for p, n in zip(prompts, lengths)}
    sampling = Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=128)
    if etas == "length_aware":
        policy = LengthAwarePolicy(prompts, sampling, lookahead_rounds=3,
                                   bounds=EtaBounds((1.0, 2.0), (1.0, 2.0)))
    else:
        policy = TailPolicy(prompts, sampling, eta_prompts=etas[0], eta_responses=etas[1])
    engine = lengths_engine(base)
    trained: list[str] = []
    async with recording_runner() as runner:
        for step in range(1, 100):
            if policy.cursor.epoch >= 1 and len(waiting(policy)) < 2:
                break  # the next round would be a short one of the next epoch
            o = await run_step(step, policy, engine, LengthScorer(), runner, mean_centred, version=0)
            trained += [g.prompt.uid for g in o.round.groups]
    queued = [f"p{i}" for i in waiting(policy)]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert len(queued) == len(set(queued)) and not set(queued) & set(trained)
    assert set(trained) | set(queued) == {p.uid for p in prompts}, "a prompt was lost"
    assert engine.running == set()


async def test_checkpoint_mid_epoch_resumes_the_same_rounds():
    prompts = make_prompts(30)
    base = {p.uid: (200 if i % 3 == 0 else 8) for i, p in enumerate(prompts)}
    sampling = Sampling(prompts_per_step=3, responses_per_prompt=2, max_tokens=256, seed=4)
    a = TailPolicy(prompts, sampling)
    await run_steps(a, lengths_engine(base), 3)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["policy"] == "tail" and state["queue"]
    b = TailPolicy(prompts, sampling)
    b.load_state_dict(state)
    rest_a = await run_steps(a, lengths_engine(base), 5, first=4)
    rest_b = await run_steps(b, lengths_engine(base), 5, first=4)
    def summary(outcomes):
        return [(o.round.plan.kind, [p.uid for p in o.round.plan.prompts],
                 sorted(g.prompt.uid for g in o.round.groups)) for o in outcomes]
    assert summary(rest_a) == summary(rest_b)
    assert RoundKind.LONG in [o.round.plan.kind for o in rest_a]


async def test_oversample_drops_the_unfinished_and_counts_them():
    prompts = make_prompts(40)
    base = {p.uid: (300 if i % 5 == 0 else 10) for i, p in enumerate(prompts)}
    policy = OversamplePolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=512),
                              shuffle=False)
    outcomes = await run_steps(policy, lengths_engine(base), 6)
    assert all(o.round.plan.kind is RoundKind.SHORT for o in outcomes)
    trained = [g.prompt.uid for o in outcomes for g in o.round.groups]
    assert len(trained) == 24 and not {"p0", "p5", "p10", "p15", "p20", "p25"} & set(trained)
    assert policy.metrics() == {"prompts_dropped_total": 6.0}
    restored = OversamplePolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=512))
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.dropped == 6 and restored.cursor.position == policy.cursor.position


def test_tail_reports_its_queue():
    policy = TailPolicy(make_prompts(10), Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=8))
    policy.queue.extend([3, 4, 5])
    assert policy.metrics() == {"queue_size": 3.0}
