"""The rollout fleet on the real CPU engine, started once for the module: two TP-1
replicas (one core each) and an asleep TP-2 replica over both cores, each worker with a
1 MiB KV cache (4 blocks of 128 tokens at TP 1, 8 at TP 2: the tiny model's KV is 2 KiB
a token, split over the TP ranks)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import pytest_asyncio

from rpk.core.modes import RestLevel
from rpk.core.outcomes import RoundPlan
from rpk.core.records import GenRequest, Prompt, RoundKind
from rpk.engine.layouts import LayoutState
from rpk.loop.rollout import run_round
from tests.fakes import LengthScorer
from tests.integration.engines import buckets, greedy, prompt_ids

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

PER_DEVICE = 16  # max_num_seqs per core


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(tiny_model_dir: Path):
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings

    settings = VLLMSettings(
        model=tiny_model_dir, max_model_len=256, max_num_seqs=PER_DEVICE,
        kv_cache_memory_bytes=2**20,
    )
    plan = fleet_plan((0, 1), (1, 2), 1, elastic=True)
    fleet = await launch_fleet(settings, plan, platform="cpu")
    try:
        yield fleet
    finally:
        await fleet.shutdown()


def idle(fleet) -> bool:
    return all(
        r.llm.get_num_unfinished_requests() == 0 for layout in fleet.layouts.all for r in layout.replicas
    )


async def test_layouts_cover_both_cores_with_one_awake(fleet) -> None:
    assert fleet.tp == 1 and fleet.layouts.sizes == (1, 2)
    tp1, tp2 = fleet.layouts.all
    assert tp1.names == ("tp1.0", "tp1.1") and tp2.names == ("tp2.0",)
    assert tp1.state is LayoutState.AWAKE and tp2.state is LayoutState.ASLEEP
    assert fleet.max_concurrency == 2 * PER_DEVICE
    assert tp2.replicas[0].max_concurrency == 2 * PER_DEVICE
    assert fleet.versions() == {"tp1.0": 0, "tp1.1": 0, "tp2.0": None}  # asleep: dropped


async def test_a_prompts_responses_stay_on_one_replica_and_rounds_leave_nothing_running(
    fleet,
) -> None:
    prompts = tuple(Prompt(f"p{i}", prompt_ids(10 + i), "test", "") for i in range(4))
    plan = RoundPlan(step=1, kind=RoundKind.SHORT, prompts=prompts, responses_per_prompt=4,
                     group_size=3, groups_needed=3, max_tokens=48, seed=3)
    placed: dict[str, int | None] = {}
    start = fleet.start

    async def recording_start(requests):
        streams = await start(requests)
        placed.update({r.request_id: fleet._router.replica_of(r.request_id) for r in requests})
        return streams

    fleet.start = recording_start
    try:
        result = await run_round(plan, fleet, LengthScorer(threshold=30),
                                 lambda rs: [r - sum(rs) / len(rs) for r in rs], version=0)
    finally:
        del fleet.start
    assert len(result.groups) == 3
    by_prompt = {}
    for rid, replica in placed.items():
        by_prompt.setdefault(rid.split("-r")[0], set()).add(replica)
    assert all(len(replicas) == 1 for replicas in by_prompt.values())
    assert sorted(r for (r,) in by_prompt.values()) == [0, 0, 1, 1]  # balanced
    assert idle(fleet) and not fleet._router.busy


async def test_regroup_keeps_greedy_outputs_and_brings_the_woken_layout_up_to_date(
    fleet, weights
) -> None:
    # 160 tokens: longer than one KV block, so a stale prefix cache would show.
    prompts = [prompt_ids(8), prompt_ids(40), prompt_ids(160)]
    await fleet.update_weights(buckets(weights), version=1)
    assert fleet.versions() == {"tp1.0": 1, "tp1.1": 1, "tp2.0": None}
    at_tp1 = await greedy(fleet, prompts, "g1")
    assert len(set(map(tuple, at_tp1))) == 3 and all(len(set(t)) > 1 for t in at_tp1)

    report = await fleet.regroup(2, lambda: buckets(weights))
    assert (report.from_tp, report.to_tp, report.synced) == (1, 2, 1) and report.seconds > 0
    assert fleet.versions() == {"tp1.0": None, "tp1.1": None, "tp2.0": 1}
    assert fleet.tp == 2 and fleet.max_concurrency == 2 * PER_DEVICE
    assert await greedy(fleet, prompts, "g2") == at_tp1

    await fleet.regroup(1, lambda: buckets(weights))
    assert fleet.versions() == {"tp1.0": 1, "tp1.1": 1, "tp2.0": None}
    assert await greedy(fleet, prompts, "g3") == at_tp1
    assert idle(fleet)


async def test_colocated_rest_and_two_part_wake_run_on_the_cpu_engine(fleet, weights) -> None:
    """The choreography of a colocated step against the real engine (vLLM's CPU sleep
    is a no-op, its scheduler pause and partial wakes are not): rest, weights woken and
    synced, the trainer's turn, the KV cache woken; then a regroup out of rest."""
    prompts = [prompt_ids(8), prompt_ids(160)]
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)
    before = await greedy(fleet, prompts, "c0")
    turns: list[str] = []

    async def before_kv() -> None:
        turns.append(f"offload with {sorted(fleet.versions().items())}")

    fleet.rest_level, fleet.before_kv = RestLevel.DROP_WEIGHTS, before_kv
    try:
        await fleet.rest(RestLevel.DROP_WEIGHTS)
        assert fleet.resting == 2 and all(v is None for n, v in fleet.versions().items() if n.startswith("tp1."))
        version = fleet.version + 1
        await fleet.update_weights(buckets(weights), version=version)
        assert fleet.resting is None and len(turns) == 1 and f"('tp1.0', {version})" in turns[0]
        assert await greedy(fleet, prompts, "c1") == before
        await fleet.rest(RestLevel.DROP_WEIGHTS)
        await fleet.regroup(2, lambda: buckets(weights), version + 1)
        assert fleet.tp == 2 and fleet.resting is None and len(turns) == 2
        assert await greedy(fleet, prompts, "c2") == before
        await fleet.regroup(1, lambda: buckets(weights))
    finally:
        fleet.rest_level = fleet.before_kv = None
    assert idle(fleet)


async def test_preemptions_are_fewer_at_tp2_on_the_same_requests(fleet, weights) -> None:
    """One prompt's 12 responses of up to 216 tokens (2 KV blocks each) all go to one
    replica: 4 blocks at TP 1, 8 at TP 2."""
    requests = [GenRequest(f"kv-{i}", prompt_ids(16), max_tokens=200, temperature=1.0, seed=i)
                for i in range(12)]

    async def round_preemptions(tag: str) -> tuple[int, float]:
        fleet.take_round_stats()
        renamed = [GenRequest(f"{tag}-{r.request_id}", r.prompt_token_ids, r.max_tokens,
                              r.temperature, seed=r.seed) for r in requests]
        streams = await fleet.start(renamed)

        async def drain(stream):
            return [d async for d in stream]

        await asyncio.gather(*(drain(s) for s in streams.values()))
        stats = fleet.take_round_stats()
        return sum(s.preemptions for s in stats.values()), max(s.kv_usage_max for s in stats.values())

    assert fleet.tp == 1
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)
    tp1, usage1 = await round_preemptions("a")
    await fleet.regroup(2, lambda: buckets(weights))
    tp2, usage2 = await round_preemptions("b")
    await fleet.regroup(1, lambda: buckets(weights))
    print(f"preemptions: tp1 {tp1} (kv peak {usage1:.2f}), tp2 {tp2} (kv peak {usage2:.2f})")
    assert tp1 > tp2 and usage1 == pytest.approx(1.0)


async def test_lend_moves_greedy_requests_mid_generation_without_changing_their_tokens(
    fleet, weights
) -> None:
    """A request moved by `lend` continues on the other replica from its prompt and the
    tokens it had (its KV recomputed there): greedy, it yields exactly the tokens of an
    unmoved run, none lost or repeated."""
    assert fleet.tp == 1
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)
    prompts = [prompt_ids(8), prompt_ids(40)]

    async def run(tag: str, lend_after: int | None):
        requests = [GenRequest(f"{tag}-{i}", p, max_tokens=96, temperature=0.0, progress=True)
                    for i, p in enumerate(prompts)]
        streams = await fleet.start(requests)
        on = [fleet._router.replica_of(r.request_id) for r in requests]
        got: dict[str, list[int]] = {r.request_id: [] for r in requests}
        ready = asyncio.Event()

        async def collect(rid: str) -> None:
            async for d in streams[rid]:
                got[rid].extend(d.token_ids)
                if lend_after is not None and on[int(rid[-1])] == 0 and len(got[rid]) >= lend_after:
                    ready.set()

        async def lend():
            await ready.wait()
            return await fleet.lend([0])

        async with asyncio.TaskGroup() as tg:
            for r in requests:
                tg.create_task(collect(r.request_id), name=f"collect:{r.request_id}")
            loan = tg.create_task(lend(), name="lend") if lend_after is not None else None
        return [got[r.request_id] for r in requests], on, loan.result() if loan else None

    unmoved, on, _ = await run("m0", None)
    assert sorted(on) == [0, 1] and all(len(t) > 8 for t in unmoved)
    moved, _, report = await run("m1", 4)
    assert report.lent == (0,) and report.requests == 1
    assert 4 <= report.tokens < len(unmoved[on.index(0)])  # moved mid-generation
    assert moved == unmoved
    await fleet.reclaim()
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)
    assert set(fleet.versions()[n] for n in ("tp1.0", "tp1.1")) == {fleet.version}
    assert idle(fleet)
