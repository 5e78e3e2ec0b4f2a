"""The fleet, its router and layouts, and the elastic-TP loop on virtual time: several
`SimEngine` replicas on one node, driven by the real `run_step`, `Fleet` and planner."""

from __future__ import annotations

import zlib

import pytest

from rpk.core.records import GenRequest, RoundKind
from rpk.loop.elastic import RolloutTP
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policy import Sampling, SyncPolicy, TailPolicy
from rpk.sched.tp_planner import PlannerConfig, TPPlanner
from rpk.sim import CostModel, SimEngineError
from rpk.sim.fleet import sim_fleet
from tests.fakes import LengthScorer, RecordingTrainer, make_prompts, mean_centred
from tests.helpers import index_of, prompt_of

# Two devices of 600 KV tokens each (weights worth 400 more): a TP-1 replica holds 600,
# the TP-2 replica 1600. Sleeping, waking and loading weights cost virtual seconds.
COST = CostModel(base_s=0.01, per_seq_s=1e-4, prefill_token_s=1e-5, kv_tokens=600,
                 weight_tokens=400, tp_comm_s=0.001, sync_s=0.5, sleep_s=0.1, wake_s=0.2)


def length(r) -> int:
    return 80 + zlib.crc32(f"{prompt_of(r)}:{index_of(r)}".encode()) % 40


async def fleet_of(tp: int = 1, **kw):
    return await sim_fleet(length, cost=COST, devices=2, tp_sizes=(1, 2), tp=tp,
                           max_num_seqs=64, **kw)


async def steps(fleet, policy, n: int, mode: str = "elastic", last_step: int | None = None):
    trainer = RecordingTrainer()
    runner = AsyncTrainer(trainer)
    elastic = RolloutTP(TPPlanner(PlannerConfig(mode, (1, 2), 1)), fleet, runner, 2**20,
                        last_step=last_step)
    records = []
    try:
        for step in range(1, n + 1):
            outcome = await run_step(step, policy, fleet, LengthScorer(threshold=100), runner,
                                     mean_centred, version=trainer.version, clock=fleet.clock,
                                     between=elastic)
            record = elastic.record(outcome)
            awake = {n: v for n, v in fleet.versions().items() if n.startswith(f"tp{fleet.tp}.")}
            records.append((outcome, record, awake, trainer.version))
    finally:
        await runner.aclose()
    return records


def tail_policy(p0: int = 4) -> TailPolicy:
    return TailPolicy(make_prompts(40), Sampling(prompts_per_step=p0, responses_per_prompt=4,
                                                 max_tokens=200), shuffle=False)


def assert_idle(fleet) -> None:
    for layout in fleet.layouts.all:
        for r in layout.replicas:
            assert not r.running and not r.waiting, layout.names
    assert not fleet._router.busy


async def test_a_short_round_that_preempts_at_tp1_moves_to_tp2_and_preempts_less():
    fleet = await fleet_of()
    try:
        (o1, r1, _, _), (o2, r2, _, _) = await steps(fleet, tail_policy(), 2)
    finally:
        await fleet.shutdown()
    assert o1.round.plan.kind is o2.round.plan.kind is RoundKind.SHORT
    assert r1["tp"] == 1 and r1["replicas"] == 2 and r1["preemptions"] > 0
    assert r1["kv_usage_max"] == pytest.approx(1.0, abs=0.01)
    assert r1["tp_next"] == 2 and "tp 1 -> 2" in r1["tp_reason"]
    assert r1["preemptions"] == r1["preemptions/tp1.0"] + r1["preemptions/tp1.1"]
    # The regroup for step 2's round was step 1's weight sync: sleep (0.1) and wake
    # (0.2) of the layouts, then the woken one's weights (0.5), and nothing else.
    assert (r1["regroup_at"], r1["regroup_from_tp"], r1["regroup_to_tp"]) == ("sync", 1, 2)
    assert o1.time_sync_s == pytest.approx(0.8) and r1["regroup_sync_buckets"] == 1
    assert o1.sync_buckets == 1 and r1["regroups"] == 1
    assert r2["tp"] == 2 and r2["replicas"] == 1 and r2["regroups"] == 0
    assert 0 <= r2["preemptions"] < r1["preemptions"]
    assert o1.time_regroup_s == o2.time_regroup_s == 0.0


async def test_a_regroup_at_the_sync_never_loads_the_layout_it_puts_to_sleep():
    fleet = await fleet_of()
    try:
        (o1, r1, _, v1), = await steps(fleet, tail_policy(), 1)
        replicas = {n: r for layout in fleet.layouts.all for n, r in zip(layout.names, layout.replicas)}
        versions = fleet.versions()
    finally:
        await fleet.shutdown()
    assert r1["regroup_at"] == "sync" and fleet.tp == 2 and v1 == 1
    assert {n: [v for _, v in r.weight_updates] for n, r in replicas.items()} == {
        "tp1.0": [], "tp1.1": [], "tp2.0": [1]}
    assert versions == {"tp1.0": None, "tp1.1": None, "tp2.0": 1}  # asleep: dropped
    assert r1["version_served"] == o1.version == 1


async def test_no_regroup_after_the_runs_last_step():
    fleet = await fleet_of()
    try:
        (o1, r1, _, _), = await steps(fleet, tail_policy(), 1, last_step=1)
    finally:
        await fleet.shutdown()
    assert r1["tp_next"] == 2 and r1["regroups"] == 0 and fleet.tp == 1
    assert o1.time_sync_s == pytest.approx(0.5)  # the plain sync: both replicas load at once


async def test_the_served_weight_version_is_the_trainers_after_every_step():
    fleet = await fleet_of()
    try:
        records = await steps(fleet, tail_policy(), 4)
    finally:
        await fleet.shutdown()
    for outcome, record, awake, trainer_version in records:
        assert set(awake.values()) == {trainer_version} == {outcome.version}
        assert record["version_served"] == trainer_version
    assert {r["tp"] for _, r, _, _ in records} == {1, 2}  # a regroup happened on the way


async def test_fixed_tp_never_regroups():
    fleet = await fleet_of()
    try:
        records = await steps(fleet, tail_policy(), 3, mode="fixed")
    finally:
        await fleet.shutdown()
    assert [r["tp"] for _, r, _, _ in records] == [1, 1, 1]
    assert all(o.time_regroup_s == 0.0 for o, _, _, _ in records)
    assert records[0][1]["preemptions"] > 0  # seen and reported all the same


async def test_routing_keeps_each_prompts_responses_on_one_replica():
    fleet = await fleet_of()
    try:
        policy = SyncPolicy(make_prompts(8), Sampling(prompts_per_step=6, responses_per_prompt=4,
                                                      max_tokens=200), shuffle=False)
        await steps(fleet, policy, 1, mode="fixed")
        seen = {name: r.seen for name, r in zip(fleet.layouts.awake.names, fleet.replicas)}
    finally:
        await fleet.shutdown()
    where: dict[str, set[str]] = {}
    for name, rids in seen.items():
        for rid in rids:
            where.setdefault(rid.rsplit("-r", 1)[0], set()).add(name)
    assert len(where) == 6 and all(len(names) == 1 for names in where.values())
    assert sorted(len(rids) for rids in seen.values()) == [12, 12]


async def test_aborting_a_request_whose_stream_never_ran_frees_its_slot():
    """A round's task cancelled before its first step never iterates its stream; the
    loop aborts the request, and the fleet must count it out, or the sync after the
    round refuses ("update_weights with requests in flight")."""
    fleet = await fleet_of()
    try:
        requests = [GenRequest(request_id=f"s1-p0-r{i}", prompt_token_ids=(1, 2, 3), max_tokens=8)
                    for i in range(2)]
        streams = await fleet.start(requests)
        async for _ in streams["s1-p0-r0"]:
            pass
        await fleet.abort("s1-p0-r1")  # its stream was never iterated
        assert_idle(fleet)
    finally:
        await fleet.shutdown()


async def test_a_replica_failing_mid_round_stops_the_round_with_nothing_left_running():
    fleet = await fleet_of(fail_after=lambda replica, r: 30 if replica == "tp1.1" else None)
    trainer = RecordingTrainer()
    runner = AsyncTrainer(trainer)
    try:
        with pytest.raises(ExceptionGroup) as info:
            await run_step(1, tail_policy(), fleet, LengthScorer(), runner, mean_centred,
                           version=0, clock=fleet.clock)
        assert info.group_contains(SimEngineError, match="after 30 tokens")
        assert_idle(fleet)
        assert trainer.abandoned == 1 and trainer.steps == 0
        tp11 = fleet.replicas[1]
        assert tp11.failed and set(tp11.seen) <= set(tp11.failed) | set(tp11.aborted)
    finally:
        await runner.aclose()
        await fleet.shutdown()


async def test_regroup_waits_for_an_idle_fleet_and_a_layout_that_was_built():
    fleet = await fleet_of()
    try:
        with pytest.raises(ValueError, match="no layout of tp 4; built: \\(1, 2\\)"):
            await fleet.regroup(4, _no_weights)
        streams = await fleet.start([GenRequest("s1-p0-r0", (7, 0), 200)])
        with pytest.raises(RuntimeError, match="in flight"):
            await fleet.regroup(2, _no_weights)
        assert [d async for d in streams["s1-p0-r0"]][-1].finished
        report = await fleet.regroup(2, _no_weights)
        assert (report.from_tp, report.to_tp, report.synced, fleet.tp) == (1, 2, 1, 2)
        assert (await fleet.regroup(2, _no_weights)).seconds == 0.0  # already there
    finally:
        await fleet.shutdown()


async def _no_weights():
    return
    yield


async def test_tokens_are_the_engines_count_and_work_between_rounds_is_not_the_rounds():
    fleet = await fleet_of()
    try:
        before = sum(r.tokens_generated for r in fleet.replicas)
        (o1, r1, _, _), = await steps(fleet, tail_policy(), 1, mode="fixed")
        in_round = sum(r.tokens_generated for r in fleet.replicas) - before
        assert r1["tokens_generated"] == in_round > 0
        kept = o1.round.tokens_generated - o1.round.tokens_wasted
        assert r1["tokens_wasted"] == in_round - kept > 0  # tail aborts the slowest
        # A validation-like pass between rounds: its tokens and preemptions are dropped
        # by the next round's before_round.
        streams = await fleet.start([GenRequest("val1-p0-r0", (7, 0), 200)])
        assert [d async for d in streams["val1-p0-r0"]][-1].finished
        trainer = RecordingTrainer()
        runner = AsyncTrainer(trainer)
        elastic = RolloutTP(TPPlanner(PlannerConfig("fixed", (1, 2), 1)), fleet, runner, 2**20)
        try:
            start = sum(r.tokens_generated for r in fleet.replicas)
            outcome = await run_step(2, tail_policy(), fleet, LengthScorer(threshold=100), runner,
                                     mean_centred, version=0, clock=fleet.clock,
                                     between=elastic)
            record = elastic.record(outcome)
        finally:
            await runner.aclose()
        assert record["tokens_generated"] == sum(r.tokens_generated for r in fleet.replicas) - start
    finally:
        await fleet.shutdown()
