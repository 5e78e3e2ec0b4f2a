"""Streaming training on the virtual-time engine: completed groups reach the trainer
while the round's tail still generates, the optimizer steps once after the round, and
every sample is trained exactly once under the weights that generated it."""

from __future__ import annotations

from rpk.loop.feed import Streaming
from rpk.loop.step import run_step
from rpk.sched.policy import Sampling, SyncPolicy
from rpk.sim import CostModel, SimEngine
from tests.fakes import ClockedTrainer, InlineTrainer, LengthScorer, make_prompts, mean_centred
from tests.helpers import index_of, prompt_of


def long_tail_engine() -> SimEngine:
    # prompt 0 is the long tail: 400 tokens; the others finish within 20
    def length(r):
        return 400 if prompt_of(r) == 0 else 10 + (prompt_of(r) * 3 + index_of(r)) % 10
    return SimEngine(length, cost=CostModel(base_s=0.01, per_seq_s=0.0), max_concurrency=64, chunk=4)


async def one_step(streaming: Streaming):
    engine = long_tail_engine()
    trainer = ClockedTrainer(engine.clock)
    runner = InlineTrainer(trainer)
    policy = SyncPolicy(make_prompts(8), Sampling(prompts_per_step=8, responses_per_prompt=4, max_tokens=512),
                        shuffle=False)
    try:
        o = await run_step(1, policy, engine, LengthScorer(threshold=15), runner, mean_centred,
                           version=0, clock=engine.clock, streaming=streaming)
    finally:
        await runner.aclose()
        await engine.shutdown()
    return o, trainer


async def test_streaming_trains_finished_groups_while_the_tail_generates():
    o, trainer = await one_step(Streaming(mode="thread", start_frac=0.25, chunk_tokens=40))
    ended = o.round.last_response_at
    accumulates = [(t, n) for kind, t, n in trainer.calls if kind == "accumulate"]
    # the 7 short groups (28 samples, ~17 tokens each) were trained long before prompt
    # 0's 400-token tail ended at 4 s, but for less than one 40-token chunk
    during = sum(n for t, n in accumulates if t < ended)
    assert 26 <= during <= 28 and ended >= 4.0 - 1e-9  # virtual time, summed in floats
    assert accumulates[0][0] < 0.5
    assert [k for k, _, _ in trainer.calls][0] == "begin"
    assert [k for k, _, _ in trainer.calls][-1] == "finish"
    assert sum(1 for k, _, _ in trainer.calls if k == "finish") == 1
    assert trainer.calls[-1][1] >= ended  # the one optimizer step waits for the round
    # every sample once, all of the round's
    got = sorted((s.prompt_ids, s.response_ids) for s in trainer.samples)
    want = sorted((g.prompt.token_ids, m.response.token_ids) for g in o.round.groups for m in g.members)
    assert got == want and len(got) == 32
    assert o.version == 1


async def test_streaming_waits_for_its_start_fraction_and_off_means_after_rollout():
    o, trainer = await one_step(Streaming(mode="none"))
    ended = o.round.last_response_at
    accumulates = [(t, n) for kind, t, n in trainer.calls if kind == "accumulate"]
    assert all(t >= ended for t, _ in accumulates) and sum(n for _, n in accumulates) == 32
    assert o.time_train_hidden_s == 0.0
    # start_frac 1.0: nothing trains until every group is in, i.e. after the tail
    o, trainer = await one_step(Streaming(mode="thread", start_frac=1.0, chunk_tokens=40))
    accumulates = [t for kind, t, _ in trainer.calls if kind == "accumulate"]
    assert min(accumulates) >= o.round.last_response_at


async def test_a_failed_round_takes_no_optimizer_step():
    import pytest

    from rpk.loop.rollout import EngineError
    from rpk.sim import SimEngineError

    def length(r):
        return 400 if prompt_of(r) == 0 else 12
    engine = SimEngine(length, cost=CostModel(base_s=0.01, per_seq_s=0.0), max_concurrency=64, chunk=4,
                       fail_after=lambda r: 100 if prompt_of(r) == 0 and index_of(r) == 0 else None)
    trainer = ClockedTrainer(engine.clock)
    runner = InlineTrainer(trainer)
    policy = SyncPolicy(make_prompts(8), Sampling(prompts_per_step=8, responses_per_prompt=4, max_tokens=512),
                        shuffle=False)
    try:
        with pytest.raises(ExceptionGroup) as err:
            await run_step(1, policy, engine, LengthScorer(threshold=15), runner, mean_centred,
                           version=0, clock=engine.clock, streaming=Streaming(chunk_tokens=20))
    finally:
        await runner.aclose()
        await engine.shutdown()
    assert err.group_contains(SimEngineError) or err.group_contains(EngineError)
    kinds = [k for k, _, _ in trainer.calls]
    assert "accumulate" in kinds  # the short groups had streamed in before the failure
    assert "finish" not in kinds and trainer.version == 0
