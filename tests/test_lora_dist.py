"""LoRA on the sharded trainer, two gloo ranks (this process and a follower subprocess):
adapters added before FSDP2 shards the model, the KL reference the base with adapters
off, and one step equal to the single-process LoRA step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch.distributed.fsdp import FSDPModule

from rpk.gpu.launch import Joined
from rpk.train.dist import DistTrainer
from rpk.train.trainer import TorchTrainer
from tests.dist_harness import assert_same, full_weights, make, one_step
from tests.dist_harness import two_ranks as harness_two_ranks
from tests.trainers import make_samples

LORA = {"rank": 4, "alpha": 8.0}
KL = {"kl_coef": 0.1}

# Every collective rpk issues is of a device its group serves on the GPU box.
pytestmark = pytest.mark.usefixtures("collective_guard")


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Joined]:
    with harness_two_ranks(extra={"lora": LORA, **KL}) as joined:
        yield joined


def test_two_lora_ranks_update_as_one(two_ranks: Joined, tied_model_dir: Path) -> None:
    samples = make_samples(12, seed=5)
    alone = make(tied_model_dir, None, lora=LORA, **KL)
    def shard(directory: str) -> TorchTrainer:
        return make(directory, two_ranks.sharding, lora=LORA, **KL)

    sharded = DistTrainer(two_ranks.channel, shard, str(tied_model_dir))
    local = sharded.local
    assert isinstance(local.model, PeftModel)
    trainable = [p for p in local._policy.parameters() if p.requires_grad]
    assert trainable and all(hasattr(p, "placements") for p in trainable)  # sharded adapters

    before = full_weights(sharded)
    assert_same(before, full_weights(alone))  # rank 0's adapters reached every rank
    for samples_ in (samples, make_samples(12, seed=6)):
        metrics_alone = one_step(alone, [samples_])
        metrics = one_step(sharded, [samples_[:5], samples_[5:]])
        # FSDP fixed its dtypes at a forward with the adapters on (the first forward is
        # otherwise the reference's, adapters off): every group holding adapters reduces
        # their gradients in their own dtype (on a GPU: the policy's float32 reduce dtype).
        groups = [g for m in local._policy.modules() if isinstance(m, FSDPModule)
                  for g in m._get_fsdp_state()._fsdp_param_groups
                  if any(p.sharded_param.requires_grad for p in g.fsdp_params)]
        assert groups and all(g._orig_dtype is torch.float64 for g in groups)
        assert metrics["kl"] == pytest.approx(metrics_alone["kl"], rel=1e-9, abs=1e-15)
        assert metrics["grad_norm"] == pytest.approx(metrics_alone["grad_norm"], rel=1e-9)
    assert metrics["kl"] > 0.0  # the second step's reference is the base, not the policy
    after = full_weights(sharded)
    assert_same(after, full_weights(alone))
    assert any(not torch.equal(after[n], before[n]) for n in before if ".lora_B." in n)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in after)

