"""The simulator's speculative decoding: its acceptance calibrated to the published
tokens per verify, the verify's cost as the planner's `StepCost`, the planner's k = 0
where drafts do not pay, and a round's invariants (lengths, tokens, on-policy) under it."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import pytest

from rpk.core.drafts import Draft, DraftSource, PromptDrafts
from rpk.core.records import GenRequest
from rpk.loop.speculate import SpecTail
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policies import PolicyOptions, make_policy
from rpk.sched.policy import LengthAwarePolicy, Sampling
from rpk.sched.speculate import Acceptance, SpecRule, best_k, plan_drafts
from rpk.sim import CostModel, SimEngine, SimSpec, SoloFleet
from rpk.sim.accept import NEMO_RL_TAU, calibrated, first_rate, inside_range
from tests.fakes import LengthScorer, RecordingTrainer, make_prompts, mean_centred

SIB = DraftSource.SIBLING
PROMPT = (1, 2)
# 32B/32k's replica (bench/paper_table.py): memory bound, 30 ms a step
GPU = CostModel(base_s=0.030, per_seq_s=1.2e-4)
# rpk's CPU curve: 4.7 ms a step + 0.133 ms a sequence
CPU = CostModel(base_s=0.0047, per_seq_s=1.33e-4)


def test_the_calibration_gives_the_published_floor_and_stays_in_range() -> None:
    acc = calibrated().acceptance(SIB)
    assert acc.tokens_per_verify(3) == pytest.approx(NEMO_RL_TAU[0], abs=1e-9)
    assert inside_range(acc)
    rates = [acc.at(i) for i in range(1, 9)]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1], "acceptance falls with position"
    # a flat rate calibrated the same way is the fall-free case, and a ceiling past the
    # range is refused
    assert calibrated(fall=1.0).acceptance(SIB).at(1) == pytest.approx(first_rate(2.05, 3, 1.0))
    with pytest.raises(ValueError, match="no first-position rate"):
        first_rate(4.5, 3)


def test_every_text_source_has_a_rate_and_prompt_lookup_none() -> None:
    model = calibrated()
    for s in (DraftSource.SIBLING, DraftSource.PARTIAL, DraftSource.EPOCH):
        assert sum(model.pmf(s, 5)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="'prompt'"):
        model.acceptance(DraftSource.PROMPT)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_verify_costs_what_the_planner_thinks(tp: int) -> None:
    cost = CostModel(base_s=0.02, per_seq_s=8e-5, tp_comm_s=1e-3, tp_comm_per_seq_s=2e-6, draft_token_s=1e-6)
    step = cost.step_cost(tp)
    for n, k in ((1, 0), (4, 3), (64, 8)):
        assert step.seconds(n, k) == pytest.approx(cost.verify_s(n, n * k, tp))
    # a verify of k drafts costs more than a decode step, less than k + 1 of them
    assert cost.step_s(4, tp) < cost.verify_s(4, 12, tp) < 4 * cost.step_s(4, tp)


async def drain(engine: SimEngine, rows: int, length: int) -> dict[str, tuple[int, ...]]:
    """`rows` requests of one prompt, `length` tokens each, streamed to their ends."""
    streams = await engine.start([GenRequest(f"s1-p0-r{i}", PROMPT, length) for i in range(rows)])
    return {rid: tuple([t async for d in stream for t in d.token_ids]) for rid, stream in streams.items()}


async def verify_run(k: int, cost: CostModel, rows: int = 16, length: int = 4000, seed: int = 0):
    """`rows` requests of one prompt with a sibling's text, each `length` tokens, every
    step drafting `k`: (the replica's counters, virtual seconds, the responses' tokens)."""
    engine = SimEngine(lambda r: length, cost=cost, max_concurrency=rows, chunk=64,
                       spec=SimSpec(calibrated(), seed))
    await engine.set_drafts([(1, rows, k)], [SIB], [PromptDrafts(PROMPT, (Draft(SIB, (5,) * 32),))])
    tokens = await drain(engine, rows, length)
    stats = await engine.take_spec_stats()
    t = engine.clock.now()
    await engine.shutdown()
    return stats, t, tokens


async def test_simulated_tokens_per_verify_land_in_the_published_range() -> None:
    stats, _, tokens = await verify_run(3, GPU)
    assert stats.drafts > 10_000
    # the floor the model is calibrated to, within the draws' error (and the few verifies
    # cut at a response's end)
    assert NEMO_RL_TAU[0] - 0.03 <= stats.tokens_per_verify <= NEMO_RL_TAU[1]
    rates = [a / d for a, d in zip(stats.accepted_by_pos, (stats.drafts, *stats.accepted_by_pos[:-1]))]
    assert rates[0] > rates[2], "the simulated acceptance falls with position"
    assert all(t == tuple(range(4000)) for t in tokens.values()), "every token, in order, once"


async def test_speculation_shortens_a_memory_bound_tail_and_never_changes_the_tokens() -> None:
    plain = SimEngine(lambda r: 4000, cost=GPU, max_concurrency=16, chunk=64)
    plain_tokens = await drain(plain, 16, 4000)
    plain_t = plain.clock.now()
    _, spec_t, spec_tokens = await verify_run(3, GPU)
    assert spec_tokens == plain_tokens
    # 2.05 tokens a verify at a step barely dearer (16 rows x 4 tokens at 0.12 ms)
    assert 1.6 < plain_t / spec_t < 2.05


def test_the_planner_drafts_nothing_where_drafts_do_not_pay() -> None:
    acc = calibrated().acceptance(SIB)
    # the CPU's step is bound by its tokens: at full batch a verify costs more than it gains
    cpu = CPU.step_cost()
    assert best_k(cpu, acc, 256, 8) == 0
    assert plan_drafts(cpu, acc, 256, 8).k_for(256) == 0
    assert best_k(cpu, acc, 1, 8) > 0, "the tail of one sequence still drafts"
    # nothing accepted: no draft length pays at any batch, even on a flat GPU step
    assert not plan_drafts(GPU.step_cost(), Acceptance.flat(0.0), 512, 8).speculates
    # the GPU's memory-bound step drafts the calibrated texts at every batch it runs
    assert best_k(GPU.step_cost(), acc, 16, 8) >= 3


async def test_a_k0_plan_runs_as_without_speculation() -> None:
    stats, t, _ = await verify_run(0, GPU)
    plain = SimEngine(lambda r: 4000, cost=GPU, max_concurrency=16, chunk=64)
    await drain(plain, 16, 4000)
    assert stats.drafts == 0 and stats.accepted == 0
    assert t == pytest.approx(plain.clock.now())


def spread(r: GenRequest) -> int:
    """A response's length from its prompt and index alone, whatever the round."""
    i, j = r.prompt_token_ids[1], int(r.request_id.rsplit("-r", 1)[1])
    return 20 + (i * 37) % 300 + zlib.crc32(f"{i}:{j}".encode()) % 40 + (900 if i % 11 == 0 else 0)


async def length_aware_run(speculate: bool, steps: int = 8):
    prompts = make_prompts(64)
    sampling = Sampling(prompts_per_step=8, responses_per_prompt=4, max_tokens=1200)
    options = PolicyOptions(concurrency=256, spec_sources=frozenset({SIB, DraftSource.PARTIAL, DraftSource.EPOCH}),
                            spec_rule=SpecRule() if speculate else None)
    policy = make_policy(LengthAwarePolicy.name, prompts, sampling, options)
    engine = SimEngine(spread, cost=GPU, max_concurrency=256, chunk=16,
                       spec=SimSpec(calibrated(), 1) if speculate else None)
    tail = SpecTail(policy.speculation, SoloFleet(engine)) if speculate else None
    trainer = RecordingTrainer()
    runner = AsyncTrainer(trainer)
    outcomes = []
    try:
        for step in range(1, steps + 1):
            outcomes.append(await run_step(step, policy, engine, LengthScorer(threshold=30), runner, mean_centred,
                                           version=trainer.version, clock=engine.clock, spec=tail))
    finally:
        await runner.aclose()
        await engine.shutdown()
    return outcomes


async def test_a_round_under_speculation_keeps_every_response_and_stays_on_policy() -> None:
    off = await length_aware_run(False)
    on = await length_aware_run(True)
    for outcomes in (off, on):
        for o in outcomes:
            r = o.round
            assert r.tokens_off_policy == 0
            for g in r.groups:
                for m in g.members:
                    resp = m.response
                    want = spread(GenRequest(f"x-r{resp.index}", resp.prompt.token_ids, 1))
                    assert resp.token_ids == tuple(range(min(want, 1200))), (resp.prompt.uid, resp.index)
                    assert resp.version == r.version
            # the round's finishes come in time order, each within the round
            times = [t for t, _ in r.finishes]
            assert times == sorted(times) and r.started_at <= times[0] and times[-1] <= r.ended_at
    trained = lambda outs: sorted(p.uid for o in outs for g in o.round.groups for p in [g.prompt])  # noqa: E731
    assert trained(on) == trained(off), "speculation trains the same prompts"
    assert [o.round.plan.kind for o in on] == [o.round.plan.kind for o in off]
    rollout = lambda outs: sum(o.round.ended_at - o.round.started_at for o in outs)  # noqa: E731
    assert rollout(on) < rollout(off)


def test_the_bench_runs_at_a_toy_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import sim_spec

    out = tmp_path / "spec.json"
    monkeypatch.setattr(sys, "argv", ["bench/sim_spec.py", "--settings", "14B/16k", "--steps", "3", "--prompts", "64",
                                      "--p0", "8", "--r0", "4", "--seeds", "2", "--policies", "sync", "length_aware",
                                      "--out", str(out)])
    assert sim_spec.main() == 0
    got = json.loads(out.read_text())
    (pair,) = [p for p in got["pairs"] if p["policy"] == "length_aware"]
    assert pair["seeds"] == 2 and pair["speedup"] > 1 and pair["tokens_off_policy"] == 0
    (row,) = got["table2"]
    assert row["sync_off"] == pytest.approx(1.0) and row["length_aware_copy"] > row["length_aware_off"]
    # sync ran on the first seed only (--table2-seeds 1), length_aware on both
    assert sorted((r["policy"], r["seed"]) for r in got["runs"] if r["speculative"] == "off") == \
        [("length_aware", 0), ("length_aware", 1), ("sync", 0)]
