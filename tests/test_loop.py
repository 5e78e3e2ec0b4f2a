"""The rollout driver, round bookkeeping and one step, against scripted fakes."""

from __future__ import annotations

import asyncio

import pytest

from rpk.core.records import FinishReason, IllegalTransition, RequestState, Response
from rpk.loop.rollout import EngineError, run_round
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import bubble_ratio, step_record
from rpk.sched.policy import Sampling, SyncPolicy
from rpk.sched.round import RoundBook
from tests.fakes import LengthScorer, RecordingTrainer, ScriptedEngine, make_prompts, mean_centred
from tests.helpers import plan, resp_index


def prompt_pos(request_id: str) -> int:
    return int(request_id.split("-")[1][1:])


async def test_sync_round_finishes_every_response_and_scores_each_once():
    engine = ScriptedEngine(lambda r: 4 + 3 * resp_index(r.request_id))
    scorer = LengthScorer(threshold=10)
    result = await run_round(plan(make_prompts(3), 4, 4, 3), engine, scorer, mean_centred, version=7)
    assert len(result.groups) == 3
    assert result.finished == 12 and result.aborted == 0
    assert len(scorer.scored) == 12
    assert {s.request_id for s in engine.seen} == {f"s1-p{p}-r{j}" for p in range(3) for j in range(4)}
    for g in result.groups:
        # lengths 4, 7, 10, 13: the first two are under the threshold.
        assert [m.reward for m in g.members] == [1.0, 1.0, 0.0, 0.0]
        assert g.advantages == (0.5, 0.5, -0.5, -0.5)
        assert all(m.response.version == 7 for m in g.members)
    assert result.tokens_generated == 3 * (4 + 7 + 10 + 13)
    assert engine.running == set()


async def test_over_provisioned_round_keeps_first_finishers_and_aborts_the_rest():
    # prompt 2 is slow in every response; responses with index 3 are slow everywhere.
    def length(r):
        return 200 if prompt_pos(r.request_id) == 2 or resp_index(r.request_id) == 3 else 8

    engine = ScriptedEngine(length, max_concurrency=16)
    result = await run_round(plan(make_prompts(3), 4, 3, 2, max_tokens=256), engine,
                             LengthScorer(), mean_centred, version=0)
    assert {g.prompt.uid for g in result.groups} == {"p0", "p1"}
    for g in result.groups:
        assert sorted(m.response.index for m in g.members) == [0, 1, 2]
    # everything else was aborted in the engine, nothing is left running
    assert engine.running == set()
    assert result.aborted == 12 - 6
    assert set(engine.aborted) == {f"s1-p{p}-r3" for p in (0, 1)} | {f"s1-p2-r{j}" for j in range(4)}
    assert result.tokens_aborted > 0
    assert result.tokens_generated >= 6 * 8 + result.tokens_aborted


async def test_engine_failure_stops_the_round_and_aborts_every_other_request():
    engine = ScriptedEngine(lambda r: 50, fail_on=lambda r: r.request_id == "s1-p1-r2")
    with pytest.raises(ExceptionGroup) as info:
        await run_round(plan(make_prompts(3), 4, 4, 3), engine, LengthScorer(), mean_centred, version=0)
    assert info.group_contains(RuntimeError, match="engine failed")
    assert engine.running == set()
    assert len(engine.aborted) == 11


async def test_cancelling_a_round_leaves_nothing_running():
    engine = ScriptedEngine(lambda r: 10_000, chunk=1)
    task = asyncio.create_task(
        run_round(plan(make_prompts(4), 4, 4, 4, max_tokens=20_000), engine, LengthScorer(), mean_centred, version=0)
    )
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(engine.running) == 16
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.running == set()
    assert sorted(engine.aborted) == sorted(s.request_id for s in engine.seen)


async def test_stream_ending_without_finish_is_an_engine_error():
    class Truncating(ScriptedEngine):
        async def generate(self, request):
            yield_once = super().generate(request)
            yield await yield_once.__anext__()  # one unfinished delta, then the stream just ends

    engine = Truncating(lambda r: 50)
    with pytest.raises(ExceptionGroup) as info:
        await run_round(plan(make_prompts(1), 2, 2, 1), engine, LengthScorer(), mean_centred, version=0)
    assert info.group_contains(EngineError)


def test_request_states_reject_illegal_transitions():
    book = RoundBook(plan(make_prompts(1), 2, 2, 1), mean_centred)
    rid = "s1-p0-r0"
    with pytest.raises(IllegalTransition):  # pending -> finished skips running
        book.finished(rid, Response(book.plan.prompts[0], 0, (1,), (-0.1,), FinishReason.STOP, 0), 0.0)
    assert book.count(RequestState.PENDING) == 2 and book.any_unfinished
    book.started(rid, 0.0)
    book.aborted(rid, 1.0)
    with pytest.raises(IllegalTransition):
        book.started(rid, 2.0)


def test_round_plan_validates():
    with pytest.raises(ValueError, match="group_size"):
        plan(make_prompts(2), 2, 3, 1)
    with pytest.raises(ValueError, match="groups_needed"):
        plan(make_prompts(2), 2, 2, 3)


def test_bubble_ratio_by_hand():
    # capacity 4: 4 in flight for 1 s, then 1 in flight for 3 s -> busy 4 + 3 = 7 of 16
    timeline = [(0.0, 4), (1.0, 1), (4.0, 0)]
    assert bubble_ratio(timeline, 0.0, 4.0, 4) == pytest.approx(1 - 7 / 16)
    # more in flight than the engine decodes at once counts as full, not over-full
    assert bubble_ratio([(0.0, 10)], 0.0, 2.0, 4) == 0.0


async def test_one_sync_step_trains_every_group_and_syncs_weights():
    prompts = make_prompts(10)
    policy = SyncPolicy(prompts, Sampling(prompts_per_step=4, responses_per_prompt=3, max_tokens=32))
    engine = ScriptedEngine(lambda r: 5 + resp_index(r.request_id) * 5)
    trainer = RecordingTrainer()
    runner = AsyncTrainer(trainer)
    try:
        outcome = await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0)
    finally:
        await runner.aclose()
    assert trainer.steps == 1 and outcome.version == 1 and engine.weights_version == 1
    assert len(trainer.samples) == 12
    assert {s.response_ids for s in trainer.samples} == {tuple(range(n)) for n in (5, 10, 15)}
    rec = step_record(outcome)
    assert rec["prompts"] == 4 and rec["responses"] == 12
    assert rec["reward_mean"] == pytest.approx(1 / 3)  # only the 5-token response is under 10
    assert rec["response_len_max"] == 15 and rec["tokens_generated"] == 4 * 30
    assert rec["round_kind"] == "sync" and rec["train_train_samples"] == 12


def test_sync_policy_walks_the_dataset_and_resumes():
    prompts = make_prompts(10)
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=8, seed=3)
    a = SyncPolicy(prompts, sampling)
    first = [p.uid for p in a.plan(1).prompts] + [p.uid for p in a.plan(2).prompts]
    assert len(set(first)) == 8
    state = a.state_dict()
    b = SyncPolicy(prompts, sampling)
    b.load_state_dict(state)
    assert [p.uid for p in a.plan(3).prompts] == [p.uid for p in b.plan(3).prompts]
