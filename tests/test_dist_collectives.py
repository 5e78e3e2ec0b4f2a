"""Two gloo ranks as the GPU box would run them: every collective rpk issues goes over a
group that serves its tensors' device there (`tests.collective_guard`), a sharded offload
returns only once every rank's state is out (vLLM's KV cache wakes next, on every GPU),
and every rank runs the step's phases in the same order."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rpk.core.modes import Offload
from rpk.gpu.launch import Joined, default_backend
from rpk.train import fsdp
from rpk.train.dist import DistTrainer
from tests.collective_guard import Guard, guarding, served
from tests.dist_harness import make, read_phases, recording_phases
from tests.dist_harness import two_ranks as harness_two_ranks
from tests.trainers import make_samples


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("phases")


@pytest.fixture(scope="module")
def two_ranks(phases: Path) -> Iterator[Joined]:
    with harness_two_ranks(phases=phases / "rank1.jsonl") as joined:
        yield joined


def _trainer(joined: Joined, model_dir: Path) -> DistTrainer:
    return DistTrainer(joined.channel, lambda d: make(d, joined.sharding), str(model_dir))


def _step(trainer: DistTrainer, seed: int) -> None:
    trainer.begin_step()
    trainer.accumulate(make_samples(6, seed=seed))
    assert trainer.finish_step()["stepped"] == 1.0


def _sync(trainer: DistTrainer) -> None:
    """The weights gathered (every rank joins each gather): a follower is past its
    previous commands when this returns."""
    for _ in trainer.weight_buckets(1 << 30):
        pass


def test_the_default_group_serves_host_tensors_on_the_box() -> None:
    assert served(default_backend(True)) == {"cpu", "cuda"}
    assert served(default_backend(False)) >= {"cpu"}


def test_every_rank_is_out_before_the_kv_cache_wakes_and_runs_the_phases_in_one_order(
    two_ranks: Joined, model_dir: Path, phases: Path
) -> None:
    """The follower moves its state out `SLOW_OFFLOAD_S` later than rank 0 would; the
    KV cache wakes (`Fleet._rise`) as soon as `before_kv`, the offload, returns."""
    rank0, rank1 = phases / "rank0.jsonl", phases / "rank1.jsonl"  # the module's first two-rank test
    kv_wakes = []
    with recording_phases(rank0):
        trainer = _trainer(two_ranks, model_dir)
        trainer.offload(Offload.OPTIMIZER)  # at start-up, before vLLM starts
        kv_wakes.append(time.monotonic())
        for seed in (3, 4):
            _step(trainer, seed)
            _sync(trainer)
            trainer.offload(Offload.ALL)
            kv_wakes.append(time.monotonic())
        _sync(trainer)
    events = {rank: read_phases(log) for rank, log in ((0, rank0), (1, rank1))}
    out = [t for event, t in events[1] if event == "state_out"]
    assert len(out) == len(kv_wakes) == 3
    late = [(i, round(o - w, 3)) for i, (o, w) in enumerate(zip(out, kv_wakes)) if o > w]
    assert not late, ("rank 1's state was still moving out when rank 0 woke the KV cache "
                      f"(offload, seconds late): {late}")
    order = {rank: [event for event, _ in e if event != "state_out"] for rank, e in events.items()}
    assert order[0] == order[1] and order[0].count("finish_step") == 2


def test_a_follower_gathers_a_bucket_only_once_rank_0_has_sent_the_one_before(
    two_ranks: Joined, model_dir: Path, phases: Path
) -> None:
    """Queued ahead, a follower's gathers would spin on its GPU beside the vLLM worker
    receiving rank 0's previous bucket; each bucket starts at a barrier of every rank."""
    trainer = _trainer(two_ranks, model_dir)
    begun, sent, sizes = time.monotonic(), [], []
    with recording_phases(phases / "rank0_paced.jsonl"):
        for bucket in trainer.weight_buckets(1 << 16):  # a few tensors a bucket
            time.sleep(0.1)  # rank 0 sends it to the replicas
            sent.append(time.monotonic())
            sizes.append(len(bucket))
    gathers = [t for event, t in read_phases(phases / "rank1.jsonl") if event == "gather" and t > begun]
    assert len(sizes) > 3 and len(gathers) == sum(sizes)
    firsts = [gathers[sum(sizes[:k])] for k in range(1, len(sizes))]  # each later bucket's first gather
    early = [(k + 1, round(s - f, 3)) for k, (f, s) in enumerate(zip(firsts, sent)) if f < s]
    assert not early, f"rank 1 began buckets before rank 0 had sent the one before (bucket, seconds early): {early}"


def test_rpk_sends_nothing_over_a_group_that_would_not_serve_it(
    two_ranks: Joined, model_dir: Path, collective_guard: Guard
) -> None:
    trainer = _trainer(two_ranks, model_dir)
    _step(trainer, seed=1)
    trainer.offload(Offload.OPTIMIZER)
    sites = {site for site, _ in collective_guard.checked}
    assert {"rpk/train/fsdp.py:all_sum", "rpk/train/load.py:_broadcast_buffers"} <= sites


def test_the_guard_flags_host_counts_summed_over_an_nccl_only_group(
    two_ranks: Joined, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b0631c8's finish_step summed its host counts (`fsdp.all_sum`) over the default
    group, plain "nccl" on the box; they go over the gloo control group now. The sums run
    on rank 0 alone, so a stand-in takes the place of the reduction."""
    def all_reduce(tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False) -> None:
        pass

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    counts = torch.zeros(5, dtype=torch.float64)
    with guarding("nccl", monkeypatch) as guard:
        fsdp.all_sum(counts, dataclasses.replace(two_ranks.sharding, control=dist.group.WORLD))
        fsdp.all_sum(counts, two_ranks.sharding)
    assert guard.checked == [("rpk/train/fsdp.py:all_sum", "all_reduce")] * 2
    assert guard.violations == [
        "rpk/train/fsdp.py:all_sum: all_reduce of a cpu tensor over a group served by 'nccl' on the box"
    ]
