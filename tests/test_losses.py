"""The pure-torch GRPO pieces against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rpk.train.losses import (
    group_advantages,
    ppo_clip_token_loss,
    token_logprobs,
    token_logprobs_and_entropy,
)


def test_group_advantages_hand_example() -> None:
    # rewards 1, 0, 0, 1, 1: mean 0.6; deviations +0.4 (x3), -0.6 (x2);
    # unbiased var = (3 * 0.16 + 2 * 0.36) / 4 = 0.3, std = sqrt(0.3) = 0.5477225575
    # -> +0.4 / 0.5477225575 = 0.7302967433, -0.6 / 0.5477225575 = -1.0954451150
    adv = group_advantages([1, 0, 0, 1, 1], eps=0.0)
    expected = [0.7302967433, -1.0954451150, -1.0954451150, 0.7302967433, 0.7302967433]
    assert adv == pytest.approx(expected, abs=1e-9)
    # eps sits in the denominator: std + 1e-6
    adv_eps = group_advantages([1, 0, 0, 1, 1])
    assert adv_eps[0] == pytest.approx(0.4 / (math.sqrt(0.3) + 1e-6), abs=1e-12)
    # Dr. GRPO: centred only
    assert group_advantages([1, 0, 0, 1, 1], scale_by_std=False) == pytest.approx(
        [0.4, -0.6, -0.6, 0.4, 0.4]
    )


def test_group_advantages_two_members() -> None:
    # rewards 1, 3: mean 2, unbiased std = sqrt((1 + 1) / 1) = sqrt(2) -> -+1/sqrt(2)
    assert group_advantages([1.0, 3.0], eps=0.0) == pytest.approx(
        [-1 / math.sqrt(2), 1 / math.sqrt(2)]
    )


@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0] * 8, [0.0, 0.0], [0.7]])
def test_group_advantages_zero_variance_is_exactly_zero(rewards: list[float]) -> None:
    assert group_advantages(rewards) == [0.0] * len(rewards)
    assert group_advantages(rewards, scale_by_std=False) == [0.0] * len(rewards)


def test_group_advantages_empty() -> None:
    assert group_advantages([]) == []


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16))
def test_group_advantages_are_standardised(rewards: list[float]) -> None:
    adv = group_advantages(rewards, eps=0.0)
    assert all(math.isfinite(a) for a in adv)
    if max(rewards) - min(rewards) < 1e-6:
        return  # near-constant groups are dominated by rounding
    t = torch.tensor(adv, dtype=torch.float64)
    assert abs(t.mean().item()) < 1e-9
    assert t.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-9)


def test_token_logprobs_with_temperature() -> None:
    # logits [0, ln 3]: softmax = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    targets = torch.tensor([1, 0])
    lp = token_logprobs(logits, targets, temperature=1.0)
    assert lp.tolist() == pytest.approx([math.log(0.75), math.log(0.25)])
    # temperature 2: logits/2 = [0, ln sqrt 3] -> p1 = sqrt3 / (1 + sqrt3)
    s3 = math.sqrt(3.0)
    lp2 = token_logprobs(logits, targets, temperature=2.0)
    assert lp2.tolist() == pytest.approx([math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))])
    # entropy of [1/4, 3/4] = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351446
    lp3, ent = token_logprobs_and_entropy(logits, targets, temperature=1.0)
    assert torch.equal(lp3, lp)
    assert ent.tolist() == pytest.approx([0.5623351446, 0.5623351446])
    assert not ent.requires_grad


def test_token_logprobs_widens_bf16() -> None:
    logits = torch.randn(3, 5, 11).to(torch.bfloat16)
    targets = torch.randint(0, 11, (3, 5))
    lp = token_logprobs(logits, targets, 1.0)
    assert lp.dtype == torch.float32 and lp.shape == (3, 5)
    assert token_logprobs(logits.double(), targets, 1.0).dtype == torch.float64


def test_token_logprobs_rejects_bad_temperature() -> None:
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0)


def test_ppo_clip_loss_hand_example() -> None:
    # old_logp = 0 so ratio = exp(logp) = r exactly as chosen; clip range [0.8, 1.28].
    #  tok  r    A   unclipped r*A  clipped c(r)*A  min     loss=-min  clipped?  dloss/dlogp
    #  0   1.1  +1   1.1            1.1             1.1     -1.1       no        -A*r = -1.1
    #  1   1.5  +2   3.0            1.28*2 = 2.56   2.56    -2.56      yes       0
    #  2   0.5  +1   0.5            0.8             0.5     -0.5       no        -0.5
    #  3   0.5  -1   -0.5           -0.8            -0.8    +0.8       yes       0
    #  4   1.5  -1   -1.5           -1.28           -1.5    +1.5       no        +1.5
    #  5   3.0  +5   (masked out: contributes nothing)
    # sum = -1.1 - 2.56 - 0.5 + 0.8 + 1.5 = -1.86
    r = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 3.0], dtype=torch.float64)
    logp = r.log().requires_grad_(True)
    old = torch.zeros(6, dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, 1.0, -1.0, -1.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    loss, stats = ppo_clip_token_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.86, abs=1e-12)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.1, 0.0, -0.5, 0.0, 1.5, 0.0], abs=1e-12)
    assert stats["tokens"].item() == 5
    assert stats["clipped_tokens"].item() == 2
    assert stats["ratio_sum"].item() == pytest.approx(1.1 + 1.5 + 0.5 + 0.5 + 1.5)
    # |ln 1.1| + 2 |ln 1.5| + 2 |ln 0.5|
    expected_diff = math.log(1.1) + 2 * math.log(1.5) + 2 * math.log(2.0)
    assert stats["abs_logp_diff"].item() == pytest.approx(expected_diff)
    assert not any(v.requires_grad for v in stats.values())


def test_ppo_clip_loss_on_policy_is_minus_advantage_sum() -> None:
    # logp == old_logp: ratio 1 everywhere, nothing clipped, loss = -sum(A) over mask,
    # and the gradient is the REINFORCE one, -A per token.
    logp = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[0.5], [-2.0]], dtype=torch.float64)  # per row, broadcast
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    loss, stats = ppo_clip_token_loss(logp, logp.detach(), adv, mask, 0.2, 0.2)
    assert loss.item() == pytest.approx(-(3 * 0.5 + 2 * -2.0))
    loss.backward()
    expected = torch.tensor([[-0.5, -0.5, -0.5, 0.0], [2.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected)
    assert stats["clipped_tokens"].item() == 0
    assert stats["ratio_sum"].item() == pytest.approx(5.0)


def test_ppo_clip_loss_ignores_nonfinite_padding() -> None:
    logp = torch.tensor([-1.0, float("nan")], requires_grad=True)
    old = torch.tensor([-1.0, float("-inf")])
    loss, stats = ppo_clip_token_loss(
        logp, old, torch.tensor(1.0), torch.tensor([True, False]), 0.2, 0.2
    )
    assert loss.item() == pytest.approx(-1.0)
    assert math.isfinite(stats["abs_logp_diff"].item())
    loss.backward()
    assert logp.grad.tolist() == [-1.0, 0.0]  # no nan from the padded position
