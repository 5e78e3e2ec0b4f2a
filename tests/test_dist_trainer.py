"""The sharded trainer on two gloo ranks (this process and a follower subprocess, kept
for the module) against the unsharded one: the same update for any arrival order of
groups and any micro-batch budget, checkpoints that resume on 1 or 2 ranks, abandoned
steps, and weights gathered in bounded buckets."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rpk.gpu.launch import Joined
from tests.dist_harness import assert_same, dist_trainer, full_weights, make, one_step
from tests.dist_harness import two_ranks as harness_two_ranks
from tests.trainers import make_samples

# Every collective rpk issues is of a device its group serves on the GPU box.
pytestmark = pytest.mark.usefixtures("collective_guard")


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Joined]:
    with harness_two_ranks() as joined:
        yield joined


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), chunks=st.integers(1, 4), budget=st.sampled_from([40, 120, 10_000]))
def test_two_ranks_update_as_one_for_any_arrival_order_and_budget(
    two_ranks: Joined, tied_model_dir: Path, seed: int, chunks: int, budget: int
) -> None:
    samples = make_samples(12, seed)
    alone = make(tied_model_dir, None, budget)
    metrics_alone = one_step(alone, [samples])

    arrived = samples[:]
    random.Random(seed).shuffle(arrived)
    cut = sorted(random.Random(seed + 1).sample(range(1, len(arrived)), chunks - 1))
    pieces = [arrived[a:b] for a, b in zip([0, *cut], [*cut, len(arrived)])]
    sharded = dist_trainer(two_ranks, tied_model_dir, budget)
    metrics = one_step(sharded, pieces)

    assert_same(full_weights(sharded), full_weights(alone))
    for key in ("train_tokens", "train_sequences", "train_samples", "overlong_filtered", "stepped"):
        assert metrics[key] == metrics_alone[key], key
    assert metrics["loss"] == pytest.approx(metrics_alone["loss"], rel=1e-9)
    assert metrics["grad_norm"] == pytest.approx(metrics_alone["grad_norm"], rel=1e-9)


def test_a_checkpoint_on_two_ranks_resumes_on_one_and_on_two(
    two_ranks: Joined, tied_model_dir: Path, tmp_path: Path
) -> None:
    first, second = make_samples(10, 1), make_samples(10, 2)
    sharded = dist_trainer(two_ranks, tied_model_dir)
    one_step(sharded, [first])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sharded.save(ckpt)
    saved = safe_open(str(ckpt / "model.safetensors"), framework="pt")
    assert "lm_head.weight" not in saved.keys()  # tied: vLLM and HF tie it again
    assert AutoModelForCausalLM.from_pretrained(ckpt).config.tie_word_embeddings

    one_step(sharded, [second])
    continued = full_weights(sharded)

    resumed_two = dist_trainer(two_ranks, ckpt)
    resumed_two.load(ckpt)
    assert resumed_two.version == 1
    one_step(resumed_two, [second])
    assert_same(full_weights(resumed_two), continued)

    resumed_one = make(ckpt, None)
    resumed_one.load(ckpt)
    one_step(resumed_one, [second])
    assert_same(full_weights(resumed_one), continued)


def test_an_abandoned_step_leaves_nothing_behind(two_ranks: Joined, tied_model_dir: Path) -> None:
    samples = make_samples(10, 3)
    sharded = dist_trainer(two_ranks, tied_model_dir)
    sharded.begin_step()
    sharded.accumulate(make_samples(10, 4))  # gradients kept local on both ranks
    sharded.abandon_step()
    one_step(sharded, [samples])
    fresh = make(tied_model_dir, None)
    one_step(fresh, [samples])
    assert_same(full_weights(sharded), full_weights(fresh))
    assert sharded.version == 1


def test_weights_leave_in_bounded_buckets_with_hf_names(two_ranks: Joined, tied_model_dir: Path) -> None:
    sharded = dist_trainer(two_ranks, tied_model_dir)
    buckets = list(sharded.weight_buckets(8_000))
    hf = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float64).state_dict()
    sent = {name: t for bucket in buckets for name, t in bucket}
    assert sent.keys() == hf.keys() - {"lm_head.weight"}
    assert_same(sent, {k: v for k, v in hf.items() if k in sent})
    assert len(buckets) > 2
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= 8_000
