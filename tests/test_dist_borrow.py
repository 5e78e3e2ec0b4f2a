"""The borrowing stream trainer's ranks: on two gloo ranks as HSDP (each rank a replicate
group of its own), chunks computed on rank 1 alone while rank 0's device still
generates, the rest on both after the round: the update equals the unsharded one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rpk.gpu.launch import Joined
from rpk.gpu.layout import ParallelLayout
from tests.dist_harness import assert_same, dist_trainer, full_weights, make, one_step, two_ranks
from tests.trainers import make_samples

# Every collective rpk issues is of a device its group serves on the GPU box.
pytestmark = pytest.mark.usefixtures("collective_guard")


@pytest.fixture(scope="module")
def hsdp_ranks() -> Iterator[Joined]:
    with two_ranks(dp_replicate=2) as joined:
        yield joined


def test_chunks_on_the_lent_rank_alone_then_on_both_update_as_one(
    hsdp_ranks: Joined, tied_model_dir: Path
) -> None:
    samples = make_samples(12, 5)
    alone = make(tied_model_dir, None)
    one_step(alone, [samples])

    sharded = dist_trainer(hsdp_ranks, tied_model_dir, budget=60)
    sharded.begin_step()
    sharded.compute_on(ParallelLayout(nproc_per_node=2, dp_replicate=2).ranks_on([(0, 1)]))
    during = [sharded.accumulate(samples[:4]), sharded.accumulate(samples[4:7])]
    assert all(m["micro_batches"] == 0 for m in during)  # rank 0 ran no pass
    sharded.compute_on(None)  # the round is over: the rest on every rank
    after = sharded.accumulate(samples[7:])
    sharded.finish_step()
    assert after["micro_batches"] >= 1
    assert_same(full_weights(sharded), full_weights(alone))


def test_compute_on_names_ranks_outside_the_world(hsdp_ranks: Joined, tied_model_dir: Path) -> None:
    sharded = dist_trainer(hsdp_ranks, tied_model_dir)
    with pytest.raises(ValueError, match=r"ranks \[2\] are not a subset of 0..1"):
        sharded.compute_on([2])
