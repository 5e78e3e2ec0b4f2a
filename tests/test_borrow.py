"""The borrowing stream trainer on virtual time: the trigger's rule, which replicas lend
and where their requests go, migration keeping every response whole, and the step that
lends half the fleet to the trainer and takes it back."""

from __future__ import annotations

import asyncio

import pytest

from rpk.core.outcomes import MigrationReport
from rpk.core.records import FinishReason, GenRequest
from rpk.loop.feed import Streaming
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.borrow import BorrowRule, BorrowTrigger, lenders, place_moves
from rpk.sched.policy import Sampling, SyncPolicy
from rpk.sim import CostModel, SimEngine
from rpk.sim.fleet import sim_fleet
from tests.fakes import ClockedTrainer, InlineTrainer, LengthScorer, make_prompts, mean_centred
from tests.helpers import index_of, prompt_of

PROMPT = 2  # make_prompts' prompt tokens: (7, i)


def total_length(r: GenRequest) -> int:
    """The whole response's length; prompt 0's responses are the long tail."""
    return (400 if prompt_of(r) == 0 else 40 + 7 * prompt_of(r)) + index_of(r)


def remaining(r: GenRequest) -> int:
    # a continuation brings its tokens so far in its prompt (as partial rollout does)
    return total_length(r) - (len(r.prompt_token_ids) - PROMPT)


# --- the rule -------------------------------------------------------------------------

def test_trigger_fires_once_between_min_and_max_while_responses_arrive():
    t = BorrowTrigger(BorrowRule(min_frac=0.2, max_frac=0.5, min_gain=0.05, check_s=1.0), 100)
    assert not t.observe(1, 0.0)  # the first finish opens the window
    assert not t.observe(15, 1.0)  # 15% done: too early
    assert not t.observe(19, 1.5)  # within the window: no check
    assert t.observe(21, 2.0) and t.fired_at_frac == 0.21  # 21% and +6% since the last check
    assert not t.observe(40, 3.0) and t.fired_at_frac == 0.21  # once per round


def test_trigger_waits_while_arrivals_stall_and_fires_by_max_frac():
    t = BorrowTrigger(BorrowRule(min_frac=0.2, max_frac=0.5, min_gain=0.05, check_s=1.0), 100)
    t.observe(18, 0.0)
    assert not t.observe(19, 1.0)  # 19%: below min_frac
    assert not t.observe(22, 2.0)  # +3% since the last check: arrivals too slow
    assert not t.observe(24, 3.0)
    assert t.observe(51, 4.0) and t.fired_at_frac == 0.51  # past max_frac: fires anyway


def test_max_frac_holds_on_any_finish_even_inside_the_window():
    # A round shorter than check_s (a CPU): no check ever comes, the bound still holds.
    t = BorrowTrigger(BorrowRule(min_frac=0.2, max_frac=0.5, check_s=1.0), 10)
    assert not t.observe(1, 0.00) and not t.observe(4, 0.10)
    assert t.observe(5, 0.15) and t.fired_at_frac == 0.5


def test_trigger_never_fires_once_the_round_has_all_it_needs():
    t = BorrowTrigger(BorrowRule(), 10)
    t.observe(1, 0.0)
    assert not t.observe(10, 5.0) and not t.fired


def test_rule_and_trigger_reject_bad_values_by_name():
    with pytest.raises(ValueError, match="min_frac=0.6, max_frac=0.5"):
        BorrowRule(min_frac=0.6)
    with pytest.raises(ValueError, match="min_gain"):
        BorrowRule(min_gain=-0.1)
    with pytest.raises(ValueError, match="got 0"):
        BorrowTrigger(BorrowRule(), 0)


def test_half_the_replicas_lend_those_with_least_to_move_and_never_the_last():
    assert lenders([5]) == ()
    assert lenders([5, 3]) == (1,)
    assert lenders([4, 1, 9, 1]) == (1, 3)
    assert lenders([2, 2, 2]) == (2,)  # ties: the highest index
    assert lenders([0, 7, 3, 5, 6]) == (0, 2)


def test_moved_prompts_stay_together_on_the_least_loaded_kept_replica():
    moving = [("a0", "A"), ("b0", "B"), ("a1", "A"), ("c0", "C")]
    target = place_moves(moving, kept=[0, 2], in_flight={0: 3, 2: 1}, capacity={0: 8, 2: 8})
    # A -> 2 (load 1/8); B: both at 3/8, the lower index; C: 2 (3/8 < 4/8)
    assert target == {"a0": 2, "a1": 2, "b0": 0, "c0": 2}
    with pytest.raises(ValueError, match="no replica is kept"):
        place_moves(moving, kept=[], in_flight={}, capacity={})


# --- migration on the sim fleet ---------------------------------------------------------

async def two_replicas(host_latency_s: float = 0.0):
    """Replica 1 sits on a second node: `host_latency_s` per call to it."""
    fleet = await sim_fleet(remaining, cost=CostModel(base_s=0.01, per_seq_s=0.0, prefill_token_s=1e-4),
                            devices=2, tp_sizes=(1,), tp=1, max_num_seqs=64, chunk=8, nodes=2,
                            host_latency_s=host_latency_s)
    fleet.replicas[1].logprob = -0.25  # tells which replica sampled a token
    return fleet


def requests(n_prompts: int, r: int, step: int = 1) -> list[GenRequest]:
    return [GenRequest(f"s{step}-p{p}-r{j}", (7, p), max_tokens=1000, seed=j)
            for p in range(n_prompts) for j in range(r)]


async def consume(streams):
    async def one(stream):
        tokens, logprobs, reasons = [], [], []
        async for d in stream:
            tokens.extend(d.token_ids)
            logprobs.extend(d.logprobs)
            reasons.append(d.finish_reason)
        return tokens, logprobs, reasons
    async with asyncio.TaskGroup() as tg:
        tasks = {rid: tg.create_task(one(s), name=f"consume:{rid}") for rid, s in streams.items()}
    return {rid: t.result() for rid, t in tasks.items()}


async def test_migration_keeps_every_token_and_the_prefix_logprobs():
    fleet = await two_replicas(host_latency_s=0.05)
    reqs = requests(4, 2)
    streams = await fleet.start(reqs)
    on = {r.request_id: fleet._router.replica_of(r.request_id) for r in reqs}
    assert set(on.values()) == {0, 1}

    async def lend_at(t: float):
        await fleet.clock.sleep_until(t)
        return await fleet.lend([0])

    async with asyncio.TaskGroup() as tg:
        lending = tg.create_task(lend_at(0.3), name="lend")
        done = tg.create_task(consume(streams), name="consume")
    report, out = lending.result(), done.result()
    moved = [rid for rid, i in on.items() if i == 0]
    assert report.lent == (0,) and report.requests == len(moved) > 0
    # aborts on node 0 are free; the continuations' add to node 1 pays one round trip
    assert report.move_s == pytest.approx(0.05)
    assert fleet.replicas[0].asleep and not fleet.replicas[1].asleep
    prefix_total = 0
    for r in reqs:
        tokens, logprobs, reasons = out[r.request_id]
        n = total_length(r)
        assert reasons[-1] is FinishReason.STOP and FinishReason.ABORT not in reasons
        assert len(tokens) == len(logprobs) == n  # nothing lost, nothing twice
        if r.request_id in moved:
            k = logprobs.count(-0.5)  # the prefix replica 0 sampled
            assert 0 < k < n and logprobs == [-0.5] * k + [-0.25] * (n - k)
            # the sim's token ids count positions from each request's start
            assert tokens == list(range(k)) + list(range(n - k))
            prefix_total += k
        else:
            assert logprobs == [-0.25] * n and tokens == list(range(n))
    assert report.tokens == prefix_total
    # the continuation carried its prefix as prompt and ran on replica 1
    cont = [rid for rid in fleet.replicas[1].seen if rid in moved]
    assert sorted(cont) == sorted(moved)
    # A request started while replica 0 is lent (a trajectory's next turn) goes to 1.
    late = requests(1, 1, step=2)
    more = await fleet.start(late)
    assert fleet._router.replica_of(late[0].request_id) == 1
    tokens, _, reasons = (await consume(more))[late[0].request_id]
    assert reasons[-1] is FinishReason.STOP and len(tokens) == total_length(late[0])
    await fleet.reclaim()
    assert not fleet.replicas[0].asleep and fleet.lent == ()
    await fleet.shutdown()


async def test_a_moved_request_cancelled_twice_still_leaves_the_fleet():
    """The loop may cancel a consumer again while its stream is closing (the round is
    done): the moved request is still counted out and aborted on its new replica."""
    fleet = await two_replicas(host_latency_s=0.05)  # aborts on replica 1 take time
    reqs = requests(2, 1)
    streams = await fleet.start(reqs)
    on0 = next(r.request_id for r in reqs if fleet._router.replica_of(r.request_id) == 0)

    async def drain(rid):
        async for _ in streams[rid]:
            pass

    tasks = {r.request_id: asyncio.create_task(drain(r.request_id), name=f"drain:{r.request_id}")
             for r in reqs}
    await fleet.clock.sleep_until(0.3)
    await fleet.lend([0])
    assert fleet._router.replica_of(on0) == 1
    await fleet.clock.sleep_until(0.4)
    tasks[on0].cancel()
    for _ in range(3):
        await asyncio.sleep(0)
    tasks[on0].cancel()
    await asyncio.wait(tasks.values())
    assert fleet._router.replica_of(on0) is None and on0 not in fleet._live
    assert on0 in fleet.replicas[1].aborted and on0 not in fleet.replicas[1].running
    await fleet.reclaim()
    await fleet.shutdown()


async def test_lend_refuses_all_replicas_or_a_second_loan():
    fleet = await two_replicas()
    with pytest.raises(ValueError, match=r"cannot lend replicas \[0, 1\] of 2"):
        await fleet.lend([0, 1])
    await fleet.lend([1])
    with pytest.raises(ValueError, match=r"already lent: \[1\]"):
        await fleet.lend([0])
    await fleet.reclaim()
    await fleet.shutdown()


# --- the step ---------------------------------------------------------------------------

class CallsTrainer(ClockedTrainer):
    """Also keeps each accumulate call's samples, to replay into a real trainer."""

    def __init__(self, clock) -> None:
        super().__init__(clock)
        self.chunks: list[list] = []

    def accumulate(self, samples):
        self.chunks.append(list(samples))
        return super().accumulate(samples)

    def compute_on(self, ranks):
        self.calls.append(("compute_on", self.clock(), ranks))


def short_length(r: GenRequest) -> int:
    """Token ids stay below the tiny model's vocabulary (64): prompt 0 is the tail."""
    total = (60 if prompt_of(r) == 0 else 8 + 2 * prompt_of(r)) + index_of(r)
    return total - (len(r.prompt_token_ids) - PROMPT)


async def borrow_step(mode: str, length=short_length, trainer_ranks=None):
    fleet = await sim_fleet(length, cost=CostModel(base_s=0.01, per_seq_s=0.0), devices=2,
                            tp_sizes=(1,), tp=1, max_num_seqs=64, chunk=2)
    trainer = CallsTrainer(fleet.clock)
    runner = InlineTrainer(trainer)
    policy = SyncPolicy(make_prompts(8), Sampling(prompts_per_step=8, responses_per_prompt=4,
                                                  max_tokens=64), shuffle=False)
    lent_at: list[float] = []
    lend = fleet.lend

    async def spy(indices):
        lent_at.append(fleet.clock())
        return await lend(indices)

    fleet.lend = spy
    streaming = Streaming(mode=mode, chunk_tokens=20,
                          borrow=BorrowRule(min_frac=0.2, max_frac=0.5, check_s=0.02),
                          trainer_ranks=trainer_ranks)
    try:
        o = await run_step(1, policy, fleet, LengthScorer(threshold=15), runner, mean_centred,
                           version=0, clock=fleet.clock, streaming=streaming, lending_fleet=fleet)
        versions = fleet.versions()
    finally:
        await runner.aclose()
        await fleet.shutdown()
    return o, trainer, lent_at, versions


def sample_key(s):
    return (s.prompt_ids, len(s.response_ids), s.advantage, s.truncated)


async def test_borrow_lends_half_trains_after_the_loan_and_every_response_once():
    o, trainer, lent_at, versions = await borrow_step("borrow")
    none, none_trainer, none_lent, _ = await borrow_step("none")
    assert none_lent == [] and none.borrow_frac is None and len(none_trainer.chunks) == 1
    assert len(lent_at) == 1 and 0.2 <= o.borrow_frac <= 0.5
    assert o.migration is not None and o.migration.requests > 0 and o.migration.tokens > 0
    accumulates = [t for what, t, _ in trainer.calls if what == "accumulate"]
    assert accumulates[0] >= lent_at[0] and len(trainer.chunks) > 1
    assert o.time_train_hidden_s >= 0 and accumulates[0] < o.round.ended_at  # streamed
    # The same responses, each trained once: lengths, advantages per prompt as without
    # borrowing (the sim's token ids restart at a continuation, so compare shapes).
    borrowed = [s for c in trainer.chunks for s in c]
    assert sorted(map(sample_key, borrowed)) == sorted(map(sample_key, none_trainer.chunks[0]))
    for s in borrowed:
        assert len(s.old_logprobs) == len(s.response_ids)
    # taken back: every replica serves the step's weights
    assert trainer.steps == 1 and set(versions.values()) == {1}


async def test_a_sharded_trainer_trains_on_the_lent_ranks_until_the_round_ends():
    asked: list[list[str]] = []

    def ranks(names):
        asked.append(list(names))
        return (1,)

    o, trainer, lent_at, _ = await borrow_step("borrow", trainer_ranks=ranks)
    assert asked == [["tp1.0"]] or asked == [["tp1.1"]]  # the one replica lent
    narrowed = [(t, r) for what, t, r in trainer.calls if what == "compute_on"]
    assert [r for _, r in narrowed] == [(1,), None]
    accumulates = [t for what, t, _ in trainer.calls if what == "accumulate"]
    during = [t for t in accumulates if t < o.round.ended_at]
    assert during and narrowed[0][0] <= min(during)  # narrowed before the first chunk
    assert narrowed[1][0] >= o.round.ended_at  # widened once the round was over
    calls = [what for what, _, _ in trainer.calls]
    assert calls.index("compute_on", calls.index("compute_on") + 1) < calls.index("finish")


async def test_borrow_needs_two_replicas_and_the_builder_falls_back_to_thread():
    from rpk.assembly import build_streaming
    from rpk.config import from_argv

    engine = SimEngine(short_length, cost=CostModel(base_s=0.01))
    policy = SyncPolicy(make_prompts(2), Sampling(prompts_per_step=2, responses_per_prompt=2,
                                                  max_tokens=64), shuffle=False)
    with pytest.raises(ValueError, match="borrow needs a fleet of >= 2 replicas"):
        await run_step(1, policy, engine, LengthScorer(), AsyncTrainer(ClockedTrainer(engine.clock)),
                       mean_centred, version=0, clock=engine.clock, streaming=Streaming(mode="borrow"))
    one = await sim_fleet(short_length, cost=CostModel(), devices=1, tp_sizes=(1,), tp=1,
                          max_num_seqs=8)
    two = await two_replicas()
    cfg = from_argv(["--train.stream_mode", "borrow"])
    lines: list[str] = []
    assert build_streaming(cfg.train, one, lines.append).mode == "thread" and len(lines) == 1
    assert build_streaming(cfg.train, two, lines.append).mode == "borrow" and len(lines) == 1
    await one.shutdown()
    await two.shutdown()


async def test_the_borrowed_step_gradient_equals_the_unstreamed_one(model_dir):
    """The trainer steps with the gradient of the whole round whether it got the round
    as the borrowing step's chunks (some while the tail generated) or in one call after
    it: replayed into a real (tiny, float64) TorchTrainer."""
    import torch

    from tests.trainers import stepped_gradient, trainer

    _, recorded, _, _ = await borrow_step("borrow")
    chunks = recorded.chunks
    assert len(chunks) > 1
    settings = dict(dtype=torch.float64, clip_low=None, clip_high=None, grad_clip=0.0,
                    micro_batch_tokens=64)
    streamed, _ = stepped_gradient(trainer(model_dir, **settings), chunks)
    whole, _ = stepped_gradient(trainer(model_dir, **settings), [[s for c in chunks for s in c]])
    assert streamed.keys() == whole.keys() and whole
    for name, g in whole.items():
        torch.testing.assert_close(streamed[name], g, rtol=1e-10, atol=1e-13, msg=name)


def test_the_builder_maps_lent_replicas_to_whole_replicate_groups_or_says_why_not():
    from rpk.assembly import build_streaming, place
    from rpk.config import from_argv
    from rpk.gpu.layout import ParallelLayout

    cfg = from_argv(["--train.stream_mode", "borrow", "--rollout.devices", "0,1"])
    hsdp = place(cfg.rollout, ParallelLayout(nproc_per_node=2, dp_replicate=2))
    assert build_streaming(cfg.train, None, None, hsdp).trainer_ranks(["tp1.1"]) == (1,)
    lines: list[str] = []
    fsdp = place(cfg.rollout, ParallelLayout(nproc_per_node=2))
    ranks = build_streaming(cfg.train, None, lines.append, fsdp).trainer_ranks
    assert ranks(["tp1.1"]) is None and ranks(["tp1.0"]) is None
    assert len(lines) == 1 and "not whole HSDP replicate groups" in lines[0]
    assert build_streaming(cfg.train).trainer_ranks is None  # one process: the trainer thread


async def test_a_rounds_tail_is_handed_over_to_the_speculating_twin_with_every_token():
    """With speculating twins the round runs on the plain replica; `hand_over` moves its
    requests, tokens and all, to the twin (what the speculative tail does once the tail
    is small), new requests follow them there, and `settle` routes back."""
    fleet = await two_replicas()
    fleet.replicas[1].speculates = True  # replica 1 is replica 0's speculating twin
    assert fleet.draft_targets() == {fleet.layouts.awake.names[1]: 64}
    reqs = requests(4, 2)
    streams = await fleet.start(reqs)
    assert {fleet._router.replica_of(r.request_id) for r in reqs} == {0}  # none on the twin
    assert fleet.tail_in_flight() == 8

    async def hand_at(t: float):
        await fleet.clock.sleep_until(t)
        return await fleet.hand_over()

    async with asyncio.TaskGroup() as tg:
        handing = tg.create_task(hand_at(0.3), name="hand over")
        done = tg.create_task(consume(streams), name="consume")
    report, out = handing.result(), done.result()
    assert report.requests > 0 and fleet.handed and fleet.tail_in_flight() is None
    assert not fleet.replicas[0].asleep  # handed over, not lent: it stays up
    for r in reqs:
        tokens, logprobs, reasons = out[r.request_id]
        assert reasons[-1] is FinishReason.STOP and len(tokens) == len(logprobs) == total_length(r)
    assert await fleet.hand_over() == MigrationReport(())  # once a round
    late = requests(1, 1, step=2)
    await consume(await fleet.start(late))
    assert late[0].request_id in fleet.replicas[1].seen
    fleet.settle()
    again = requests(1, 1, step=3)
    await consume(await fleet.start(again))
    assert again[0].request_id in fleet.replicas[0].seen
    await fleet.shutdown()
