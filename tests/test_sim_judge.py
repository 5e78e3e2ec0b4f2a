"""The judge's GPU cost model (rpk.sim.judge): layer streaming resident / unpipelined /
pipelined, and a step with the judge colocated or on a GPU of its own."""

from __future__ import annotations

import pytest

from rpk.sim.judge import (
    QWEN25_7B,
    GpuCost,
    JudgeShape,
    StepShape,
    colocated_step,
    dedicated_step,
    forward_s,
    layer_compute_s,
    offload_times,
    offloaded_layers,
    queue_end,
    qwen2_layer_params,
)

# One layer computes in 1 s and copies in 2 s: easy to add up by hand.
SHAPE = JudgeShape("toy", layers=4, hidden=1, layer_params=1000, bytes_per_param=1)
GPU = GpuCost(flops=2000.0, mfu=1.0, pcie_bytes_s=500.0)


def test_qwen_7b_has_the_published_size() -> None:
    # 28 layers of ~233M weights: 6.5B of Qwen2.5-7B's 7.6B (the rest: embeddings, head).
    assert QWEN25_7B.layers * QWEN25_7B.layer_params == pytest.approx(6.53e9, rel=0.01)
    assert qwen2_layer_params(3584, 18944, 28, 4) == QWEN25_7B.layer_params


def test_a_layer_costs_its_weights_and_causal_attention() -> None:
    # 2 x 1000 x 1 token + 2 x 1 x 1^2 = 2002 FLOPs at 2000 FLOP/s
    assert layer_compute_s(SHAPE, GPU, [1]) == pytest.approx(1.001)
    assert layer_compute_s(SHAPE, GPU, [2, 2]) == pytest.approx(2 * (4000 + 8) / 2000)
    # Sharing the SMs slows it by the share.
    half = GpuCost(flops=2000.0, mfu=1.0, pcie_bytes_s=500.0, sm_share=0.5)
    assert layer_compute_s(SHAPE, half, [1]) == pytest.approx(2.002)


def test_offloaded_layers_are_spread_each_last_of_its_stretch() -> None:
    assert offloaded_layers(28, 14) == tuple(range(1, 28, 2))
    assert offloaded_layers(4, 4) == (0, 1, 2, 3)
    assert offloaded_layers(4, 1) == (3,)
    assert offloaded_layers(4, 0) == ()
    with pytest.raises(ValueError, match=r"\[0, 4\], got 5"):
        offloaded_layers(4, 5)


def test_pipelining_hides_the_copies_behind_compute() -> None:
    compute = layer_compute_s(SHAPE, GPU, [1])
    copy = SHAPE.layer_bytes / GPU.pcie_bytes_s
    assert copy == pytest.approx(2.0)
    assert forward_s(SHAPE, GPU, [1], 0, pipelined=True) == pytest.approx(4 * compute)
    assert forward_s(SHAPE, GPU, [1], 4, pipelined=False) == pytest.approx(4 * (compute + copy))
    # All streamed, copies slower than compute: the copies set the pace, the last
    # layer's compute follows the last copy.
    assert forward_s(SHAPE, GPU, [1], 4, pipelined=True) == pytest.approx(4 * copy + compute)
    # Two of four streamed (layers 1 and 3): layer 1's copy overlaps layer 0, layer 3's
    # overlaps layers 1-2 once layer 1 started.
    assert forward_s(SHAPE, GPU, [1], 2, pipelined=True) == pytest.approx(copy + 3 * compute)
    # Deeper prefetch never hurts.
    assert forward_s(SHAPE, GPU, [1], 4, pipelined=True, prefetch=2) <= forward_s(
        SHAPE, GPU, [1], 4, pipelined=True)


def test_the_pipeline_pays_most_when_copy_and_compute_match() -> None:
    fast = GpuCost(flops=2000.0, mfu=1.0, pcie_bytes_s=1000.0)  # copy 1 s = compute
    t = offload_times(SHAPE, fast, [1], 4)
    assert t.pipeline_speedup == pytest.approx(4 * 2.001 / (1 + 4 * 1.001), rel=1e-3)
    assert t.pipeline_speedup > offload_times(SHAPE, GPU, [1], 4).pipeline_speedup
    assert t.pipelined_over_resident > 1 and t.resident == pytest.approx(4.004)
    with pytest.raises(ValueError, match="at least one"):
        offload_times(SHAPE, GPU, [], 4)


def test_the_judge_queue_batches_what_waits() -> None:
    # Each forward pass 1 s whatever its batch: the first request alone, then the two
    # that came while it ran, in one pass.
    end, busy = queue_end([(0.0, 1), (0.5, 1), (0.6, 1)], 1, lambda b: 1.0)
    assert (end, busy) == (2.0, [2.0])
    end, busy = queue_end([(0.0, 1), (0.5, 1), (0.6, 1)], 2, lambda b: 1.0)
    assert (end, busy) == (2.0, [2.0, 1.0])
    with pytest.raises(ValueError, match="servers must be >= 1, got 0"):
        queue_end([], 0, lambda b: 1.0)


def test_a_dedicated_judge_costs_a_gpu_and_exposes_its_backlog() -> None:
    step = StepShape(gpus=4, rollout_s=3.0, train_s=3.0, lengths=(1, 1, 1, 1))
    d = dedicated_step(step, SHAPE, GPU)
    # rollout and training on 3 of 4 GPUs; every response finishes at 4 s (same length);
    # one resident pass of 4 s judges all four together.
    assert (d.rollout_s, d.train_s) == (4.0, 4.0)
    assert d.reward_exposed_s == pytest.approx(4 * layer_compute_s(SHAPE, GPU, [1, 1, 1, 1]))
    c = colocated_step(step, SHAPE, GPU, offloaded=0, interference=0.0)
    # A judge per GPU, one request each, after the rollout.
    assert (c.rollout_s, c.train_s) == (3.0, 3.0)
    assert c.reward_exposed_s == pytest.approx(4 * layer_compute_s(SHAPE, GPU, [1]))
    slowed = colocated_step(step, SHAPE, GPU, offloaded=0, interference=0.5)
    assert slowed.rollout_s == pytest.approx(3.0 + 0.5 * c.reward_exposed_s)
    with pytest.raises(ValueError, match="interference must be in"):
        colocated_step(step, SHAPE, GPU, offloaded=0, interference=2.0)
    with pytest.raises(ValueError, match="gpus >= 2"):
        StepShape(gpus=1, rollout_s=1.0, train_s=1.0, lengths=(1,))
