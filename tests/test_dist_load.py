"""How the sharded trainer loads its models (rpk.train.load), on two gloo ranks with a KL
reference: rank 0 alone reads the checkpoint, every rank shards a skeleton that has no
memory, and the shards, buffers and tied head come out as the files say; the KL penalty
and the update equal a single rank's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rpk.train.dist import DistTrainer
from tests.dist_harness import assert_same, full_weights, make, one_step, two_ranks
from tests.load_probe import Seen, spying
from tests.trainers import make_samples

# A KL penalty (so a reference is built) and recomputed layers (so the sharded build must
# keep them), on both sides of every comparison.
EXTRA: dict[str, Any] = {"kl_coef": 0.1, "activation_checkpointing": True}

# Every collective rpk issues is of a device its group serves on the GPU box.
pytestmark = pytest.mark.usefixtures("collective_guard")


@dataclass
class Scenario:
    ranks: tuple[Seen, Seen]
    loaded: dict[str, torch.Tensor]  # the two ranks' weights gathered right after the build
    steps: list[dict[str, float]]  # two steps on two ranks
    steps_alone: list[dict[str, float]]  # the same on one
    trained: dict[str, torch.Tensor]
    trained_alone: dict[str, torch.Tensor]
    reference_root: torch.Tensor  # rank 0's reference embedding after the steps' passes


@pytest.fixture(scope="module")
def scenario(tied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    report = tmp_path_factory.mktemp("probe") / "rank1.pt"
    batches = [make_samples(12, 1), make_samples(12, 2)]
    with spying() as rank0, two_ranks(extra=EXTRA, probe=report) as joined:
        sharded = DistTrainer(joined.channel, lambda d: make(d, joined.sharding, **EXTRA), str(tied_model_dir))
        loaded = full_weights(sharded)
        steps = [one_step(sharded, [batch]) for batch in batches]
        trained = full_weights(sharded)
        reference_root = sharded.local._reference_policy().lm.get_input_embeddings().weight
    alone = make(tied_model_dir, None, **EXTRA)
    steps_alone = [one_step(alone, [batch]) for batch in batches]
    rank1 = torch.load(report, weights_only=False)
    yield Scenario((rank0, rank1), loaded, steps, steps_alone, trained, full_weights(alone), reference_root)


def files(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)


def test_rank_0_alone_reads_the_checkpoint_and_every_rank_shards_a_meta_skeleton(
    scenario: Scenario, tied_model_dir: Path
) -> None:
    rank0, rank1 = scenario.ranks
    assert rank0.reads == [str(tied_model_dir)] * 2  # the policy, then the KL reference
    assert rank1.reads == []
    for seen in scenario.ranks:
        assert seen.sharded_on == [{"meta"}, {"meta"}]


def test_each_rank_holds_its_part_of_the_files_weights(scenario: Scenario, tied_model_dir: Path) -> None:
    want = files(tied_model_dir).state_dict()
    assert_same(scenario.loaded, {k: v for k, v in want.items() if k != "lm_head.weight"})
    for rank, seen in enumerate(scenario.ranks):
        for built in seen.built:  # the policy and the reference
            assert built.shards.keys() == want.keys() - {"lm_head.weight"}
            for name, shard in built.shards.items():
                torch.testing.assert_close(shard, torch.chunk(want[name], 2)[rank], rtol=0, atol=0, msg=name)


def test_buffers_are_rank_0s_the_head_stays_tied_and_layers_recompute(
    scenario: Scenario, tied_model_dir: Path
) -> None:
    want = dict(files(tied_model_dir).named_buffers())
    assert want  # the rotary inv_freq: not in a state dict, garbage after to_empty
    for seen in scenario.ranks:
        policy, reference = seen.built
        for built in (policy, reference):
            assert built.tied
            assert built.buffers.keys() == want.keys()
            for name, buffer in built.buffers.items():
                assert buffer.dtype == want[name].dtype and torch.equal(buffer, want[name]), name
        assert (policy.trainable, policy.recomputed) == (True, True)
        assert (reference.trainable, reference.recomputed) == (False, False)


def test_the_kl_penalty_and_the_update_equal_one_ranks(scenario: Scenario) -> None:
    first, second = scenario.steps
    assert first["kl"] == pytest.approx(0.0, abs=1e-12)  # the policy is still the reference
    assert second["kl"] > 1e-6
    for got, want in zip(scenario.steps, scenario.steps_alone):
        for key in ("kl", "loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-15), key
    assert_same(scenario.trained, scenario.trained_alone)
    # Resharded after its forward (no backward comes to do it): a shard, not the matrix.
    assert isinstance(scenario.reference_root, DTensor)
