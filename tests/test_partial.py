"""Partial rollout (APRIL) and DAPO's dynamic sampling on scripted engines: unfinished
responses continue next round with per-token policy versions; equal-reward groups are
neither trained nor deferred; no prompt is lost or trained twice."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpk.loop.step import run_step
from rpk.sched.policy import PartialPolicy, Sampling, TailPolicy
from tests.fakes import (
    LengthScorer,
    ScriptedEngine,
    lengths_engine,
    make_prompts,
    mean_centred,
    recording_runner,
    uid_of,
)


def continuing_engine(base: dict[str, int]) -> ScriptedEngine:
    """Responses of prompt p are base[p] tokens long in total: a continued request
    (prompt tokens (7, i) + its prefix) generates only what is left."""
    def length(req):
        already = len(req.prompt_token_ids) - 2
        return base[uid_of(req)] - already
    return ScriptedEngine(length, chunk=2, max_concurrency=256)


async def steps(policy, engine, n, scorer=None, first=1):
    out = []
    async with recording_runner() as runner:
        for step in range(first, first + n):
            out.append(await run_step(step, policy, engine, scorer or LengthScorer(threshold=30),
                                      runner, mean_centred, version=runner.version))
    return out


async def test_partial_continues_cut_off_responses_with_their_versions():
    prompts = make_prompts(40)
    # one prompt in five is slow: each round (5 prompts, P0 = 4) cuts it off mid-way
    base = {p.uid: (60 if i % 5 == 0 else 6) for i, p in enumerate(prompts)}
    policy = PartialPolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=128),
                           shuffle=False)
    engine = continuing_engine(base)
    o1, o2 = await steps(policy, engine, 2)
    assert [p.uid for p in o1.round.incomplete] == ["p0"]
    (carried,) = o1.round.carry
    assert {c.index for c in carried} == {0, 1}
    assert all(c.finish_reason is None and 0 < len(c.token_ids) < 60 for c in carried)
    assert all(set(c.versions) == {0} for c in carried)
    assert o1.round.tokens_carried == sum(len(c.token_ids) for c in carried)
    assert o1.round.tokens_wasted == 0  # nothing cut off was thrown away
    # step 2 launches p0 first, continuing from its tokens under the new version
    assert o2.round.plan.prompts[0].uid == "p0"
    p0 = next(g for g in o2.round.groups if g.prompt.uid == "p0") if any(
        g.prompt.uid == "p0" for g in o2.round.groups) else None
    if p0 is None:  # still not done: carried again, longer
        (again,) = [c for p, c in zip(o2.round.incomplete, o2.round.carry) if p.uid == "p0"]
        assert all(len(a.token_ids) > len(c.token_ids) for a, c in zip(again, carried))
    else:
        for m, c in zip(p0.members, carried):
            r = m.response
            assert r.token_ids[: len(c.token_ids)] == c.token_ids
            assert len(r.token_ids) == 60
            assert r.versions()[: len(c.token_ids)] == (0,) * len(c.token_ids)
            assert set(r.versions()[len(c.token_ids):]) == {1}
        assert o2.round.tokens_off_policy == sum(len(c.token_ids) for c in carried)
    assert o1.round.tokens_off_policy == 0
    assert engine.running == set()
    # Cut-off tokens are kept only if the engine streams them as they come.
    assert engine.seen and all(r.progress for r in engine.seen)


async def test_partial_keeps_finished_responses_of_an_incomplete_prompt():
    prompts = make_prompts(20)
    # p0's response 0 is short, response 1 is long: the round ends with one finished
    def length(req):
        already = len(req.prompt_token_ids) - 2
        if uid_of(req) == "p0":
            return (4 if req.request_id.endswith("r0") else 80) - already
        return 6 - already
    engine = ScriptedEngine(length, chunk=2, max_concurrency=256)
    policy = PartialPolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=128),
                           shuffle=False)
    (o1,) = await steps(policy, engine, 1)
    (carried,) = o1.round.carry
    finished = [c for c in carried if c.finish_reason is not None]
    assert [c.index for c in finished] == [0] and len(finished[0].token_ids) == 4
    # the restored policy plans the same round: the finished response is not re-run
    restored = PartialPolicy(prompts, policy.s)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    plan = restored.plan(2)
    assert plan.prompts[0].uid == "p0" and plan.carried[0] == carried
    assert restored.metrics()["carried_prompts"] == 0.0  # popped into the plan


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=1, max_value=100), min_size=100, max_size=100),
       st.sampled_from([1.25, 1.5, 2.0]))
async def test_partial_trains_every_prompt_once(lengths, eta):
    # 100 prompts, 12 rounds of at most 4 fresh prompts: the epoch never wraps, so
    # every prompt taken so far must be trained exactly once or still carried.
    prompts = make_prompts(100)
    base = {p.uid: n for p, n in zip(prompts, lengths)}
    policy = PartialPolicy(prompts, Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=64),
                           eta_prompts=eta, shuffle=False)
    engine = continuing_engine(base)
    trained: list[str] = []
    async with recording_runner() as runner:
        for step in range(1, 13):
            o = await run_step(step, policy, engine, LengthScorer(), runner, mean_centred, version=step)
            trained += [g.prompt.uid for g in o.round.groups]
            for g in o.round.groups:  # every response is whole: prefix + continuation
                for m in g.members:
                    assert len(m.response.token_ids) == min(base[g.prompt.uid], 64)
    carried = [f"p{i}" for i, _ in policy.carry]
    taken = {f"p{i}" for i in range(policy.cursor.position)}
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert not set(carried) & set(trained)
    assert set(trained) | set(carried) == taken, "a prompt was lost"
    assert engine.running == set()


async def test_dynamic_sampling_drops_equal_reward_groups_and_does_not_defer_them():
    prompts = make_prompts(40)
    base = {p.uid: (300 if i % 5 == 0 else (4 if i % 2 else 12)) for i, p in enumerate(prompts)}
    # responses of p(odd) are 4..10 tokens (all reward 1), p(even) 12..18 split at 15
    scorer = LengthScorer(threshold=15)
    s = Sampling(prompts_per_step=4, responses_per_prompt=4, max_tokens=512, drop_zero_variance=True)
    policy = TailPolicy(prompts, s, shuffle=False)
    (o,) = await steps(policy, lengths_engine(base), 1, scorer=scorer)
    r = o.round
    # p1, p3 score all 1 and p0 (300 tokens) all 0: only p2 and p4 have a signal, so
    # the round cannot reach P0 = 4 and runs out, training the two it has
    assert {p.uid for p in r.dropped} == {"p0", "p1", "p3"}
    assert {g.prompt.uid for g in r.groups} == {"p2", "p4"}
    for g in r.groups:
        assert len({m.reward for m in g.members}) > 1
    assert r.incomplete == () and list(policy.queue) == []
    assert o.train["train_samples"] == 8.0
