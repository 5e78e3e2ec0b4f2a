"""The speculative tail's driver (`rpk.loop.speculate.SpecTail`) in whole steps on a
scripted engine: each replica's plan and the round's drafts before the round, finished
siblings fed during it, the replicas' counters into the plan and the step's record
after it; the feed's task owned by the step, its queue bounded; sync, tail and
length_aware alike."""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Mapping, Sequence

import pytest

from rpk.core.drafts import DraftSource, PromptDrafts, SourceCounts, SpecStats
from rpk.core.outcomes import MigrationReport
from rpk.core.records import GenRequest, RoundKind
from rpk.loop.speculate import SpecTail, tail_seconds_saved
from rpk.loop.step import run_step
from rpk.sched.policies import PolicyOptions, make_policy
from rpk.sched.policy import Sampling
from rpk.sched.speculate import SpecRule, StepCost
from tests.fakes import LengthScorer, ScriptedEngine, make_prompts, mean_centred, recording_runner

ALL = frozenset(DraftSource)


class DraftingEngine(ScriptedEngine):
    """A scripted engine that is also a speculating fleet of one replica, "r0": it
    records what the driver sends and hands back scripted counters."""

    def __init__(self, *args, stats: SpecStats = SpecStats(), fail_add: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[Mapping[str, Sequence[tuple[int, int, int]]], list[DraftSource],
                                list[PromptDrafts]]] = []
        self.added: list[list[PromptDrafts]] = []
        self.stats = stats
        self.taken = 0
        self.fail_add = fail_add
        self.ended: list[str] = []
        self._cut_from = 0

    def draft_targets(self) -> dict[str, int]:
        return {"r0": self.max_concurrency}

    def tail_in_flight(self) -> int | None:
        return None  # no twins

    async def hand_over(self) -> MigrationReport:
        raise AssertionError("no twins: nothing to hand over")

    def settle(self) -> None:
        self.settled = getattr(self, "settled", 0) + 1

    async def set_drafts(self, schedules, sources, prompts) -> None:
        self.rounds.append((dict(schedules), list(sources), list(prompts)))

    async def add_drafts(self, prompts) -> None:
        await asyncio.sleep(0)
        if self.fail_add:
            raise RuntimeError("replica gone")
        self.added.append(list(prompts))

    async def generate(self, request: GenRequest):
        async for delta in super().generate(request):
            if delta.finished:
                self.ended.append(request.request_id)
            yield delta

    async def take_spec_stats(self) -> dict[str, SpecStats]:
        """The counters; with the tokens every request that did not finish had (as
        vLLM's abort hands them over)."""
        self.taken += 1
        cut = {r.request_id: (9,) * 3 for r in self.seen[self._cut_from:] if r.request_id not in self.ended}
        self._cut_from = len(self.seen)
        return {"r0": dataclasses.replace(self.stats, cut=cut)}


def _length(req: GenRequest) -> int:
    return 4 + zlib.crc32(req.request_id.encode()) % 24


STATS = SpecStats(drafts=40, draft_tokens=120, accepted=60, drafted_by_pos=(40, 40, 40), accepted_by_pos=(30, 20, 10),
                  spec_steps=20, spec_step_tokens=100, spec_step_rows=40, steps=50,
                  by_source={DraftSource.SIBLING: SourceCounts(30, 90, 50),
                             DraftSource.PROMPT: SourceCounts(10, 30, 10)},
                  # 60 plain steps of 2 or 6 tokens at 4 ms + 0.2 ms a token; 20 verifying
                  # ones of 4 tokens, 0.5 ms more
                  step_fit=(60.0, 240.0, 0.288, 1200.0, 1.2), verify_fit=(20.0, 80.0, 0.106))


def _policy(name: str, sources=ALL):
    sampling = Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=64)
    return make_policy(name, make_prompts(64), sampling,
                       PolicyOptions(spec_sources=sources, spec_rule=SpecRule(max_k=4), concurrency=64))


@pytest.mark.parametrize("name", ["sync", "tail", "length_aware"])
async def test_every_policys_steps_send_plans_and_drafts_and_feed_finished_siblings(name: str) -> None:
    policy = _policy(name)
    engine = DraftingEngine(_length, chunk=2, stats=STATS)
    spec = SpecTail(policy.speculation, engine)
    async with recording_runner() as runner:
        for step in (1, 2, 3):
            outcome = await run_step(step, policy, engine, LengthScorer(threshold=16), runner, mean_centred,
                                     version=runner.version, spec=spec)
            record = spec.record()
            schedules, sources, prompts = engine.rounds[-1]
            assert list(schedules) == ["r0"] and schedules["r0"][0][0] == 1
            assert sorted(sources) == sorted(ALL)
            assert [p.prompt for p in prompts] == [p.token_ids for p in outcome.round.plan.prompts]
            assert record["tokens_per_verify"] == pytest.approx(1 + 60 / 40)
            assert record["spec_accept_pos1"] == pytest.approx(30 / 40)
            assert record["spec_accept_pos2"] == pytest.approx(20 / 30)
            assert record["spec_share_sibling"] == pytest.approx(0.75)
            assert record["spec_accept_sibling"] == pytest.approx(50 / 90)
            cost = policy.speculation.step_cost("r0")
            assert cost.verify_s == pytest.approx(0.0005)
            assert (record["spec_cost_fixed_s"], record["spec_cost_token_s"], record["spec_cost_verify_s"]) \
                == (cost.fixed_s, cost.per_token_s, cost.verify_s)  # what the next round plans with
    # Every finished response went out as a sibling draft of its own prompt.
    fed = [p for batch in engine.added for p in batch]
    assert fed and all(len(p.drafts) == 1 and p.drafts[0].source is DraftSource.SIBLING for p in fed)
    assert len(fed) == len(engine.ended)
    # The counters the step read went into the plan state, under the round's kind.
    assert any(key.endswith("/r0") for key in policy.speculation.counts)
    assert engine.taken == 6  # before each round (what ran between) and after it


async def test_without_the_siblings_source_nothing_is_fed() -> None:
    policy = _policy("tail", frozenset({DraftSource.PARTIAL}))
    engine = DraftingEngine(_length, chunk=2)
    spec = SpecTail(policy.speculation, engine)
    async with recording_runner() as runner:
        await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0, spec=spec)
    assert engine.added == [] and engine.rounds


async def test_the_feed_queue_is_bounded_and_drops_what_does_not_fit() -> None:
    policy = _policy("sync")
    engine = DraftingEngine(_length, chunk=2)
    spec = SpecTail(policy.speculation, engine, max_pending=1)
    async with recording_runner() as runner:
        await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0, spec=spec)
    fed = sum(len(b) for b in engine.added)
    assert fed + spec.record()["spec_feed_dropped"] == 8
    assert all(len(b) <= 1 for b in engine.added)


async def test_a_failing_feed_fails_the_step_and_leaves_no_task_behind() -> None:
    policy = _policy("sync")
    engine = DraftingEngine(_length, chunk=2, fail_add=True)
    spec = SpecTail(policy.speculation, engine)
    before = asyncio.all_tasks()
    async with recording_runner() as runner:
        with pytest.raises(ExceptionGroup) as caught:
            await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0, spec=spec)
    assert caught.group_contains(RuntimeError, match="replica gone")
    assert asyncio.all_tasks() - before == set()
    assert engine.running == set()


async def test_a_round_that_does_not_pay_drafts_nothing_and_feeds_nothing() -> None:
    policy = _policy("sync")
    assert policy.speculation is not None
    # Measured: the engine's step does not depend on the batch (all fixed cost) and
    # nothing is ever accepted: no draft length pays.
    policy.speculation.cost.last = (0.01, 0.0)
    never = SpecStats(drafts=1000, draft_tokens=4000, accepted=0, drafted_by_pos=(1000,) * 4, accepted_by_pos=(0,) * 4)
    policy.speculation.observe_stats(RoundKind.SYNC, {"r0": never})
    engine = DraftingEngine(_length, chunk=2)
    spec = SpecTail(policy.speculation, engine)
    async with recording_runner() as runner:
        await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0, spec=spec)
    assert all(k == 0 for _, _, k in engine.rounds[0][0]["r0"])
    assert engine.added == []
    assert spec.record()["spec_k_max"] == 0


def test_tail_seconds_saved_counts_the_steps_speculation_spared() -> None:
    cost = StepCost(fixed_s=0.01, per_token_s=0.001)
    # 10 verify steps of 2 rows, each row gaining 3 tokens a step: 20 steps spared at
    # 12 ms, less 40 draft tokens verified at 1 ms each.
    stats = SpecStats(drafts=20, draft_tokens=40, accepted=40, spec_steps=10, spec_step_tokens=60, spec_step_rows=20)
    assert tail_seconds_saved(stats, cost) == pytest.approx(20 * 0.012 - 0.040)
    assert tail_seconds_saved(SpecStats(), cost) == 0.0
    # a verifying step's own cost (5 ms) is paid by each of the 10
    heavy = StepCost(fixed_s=0.01, per_token_s=0.001, verify_s=0.005)
    assert tail_seconds_saved(stats, heavy) == pytest.approx(20 * 0.012 - 10 * 0.005 - 0.040)


async def test_a_short_rounds_aborted_requests_become_their_prompts_partials() -> None:
    policy = _policy("tail", frozenset({DraftSource.PARTIAL}))
    engine = DraftingEngine(_length, chunk=2)
    spec = SpecTail(policy.speculation, engine)
    async with recording_runner() as runner:
        outcome = await run_step(1, policy, engine, LengthScorer(), runner, mean_centred, version=0, spec=spec)
    left = [p.uid for p in outcome.round.incomplete]
    assert left and sorted(policy.speculation.store.partials) == sorted(left)
    assert all(texts == [(9, 9, 9)] * min(4, len(texts)) for texts in policy.speculation.store.partials.values())
