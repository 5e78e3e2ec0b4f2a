"""The pure-torch GRPO-family pieces against numbers worked out by hand."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rpk.config import TrainConfig
from rpk.train.losses import (
    LOSSES,
    LossFn,
    LossSettings,
    Normaliser,
    PolicyBatch,
    advantage_fn,
    group_advantages,
    grpo_loss,
    gspo_loss,
    loss_spec,
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


def f64(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def adv(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_token_logprobs_and_entropy_gradient_on_request() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    _, ent = token_logprobs_and_entropy(logits, torch.tensor([1]), 1.0, entropy_grad=True)
    ent.sum().backward()
    # H = -sum p ln p; dH/dz_v = -p_v (ln p_v + H): p = [1/4, 3/4], H = 0.5623351446
    # -> -1/4 (ln 1/4 + H) = 0.2060 and -3/4 (ln 3/4 + H) = -0.2060
    assert logits.grad.tolist()[0] == pytest.approx([0.2060, -0.2060], abs=1e-4)


def test_grpo_loss_hand_example() -> None:
    # old_logp = 0 so ratio = exp(logp) = r exactly as chosen; clip range [0.8, 1.28].
    #  tok  r    A   unclipped r*A  clipped c(r)*A  min     loss=-min  clipped?  dloss/dlogp
    #  0   1.1  +1   1.1            1.1             1.1     -1.1       no        -A*r = -1.1
    #  1   1.5  +2   3.0            1.28*2 = 2.56   2.56    -2.56      high      0
    #  2   0.5  +1   0.5            0.8             0.5     -0.5       no        -0.5
    #  3   0.5  -1   -0.5           -0.8            -0.8    +0.8       low       0
    #  4   1.5  -1   -1.5           -1.28           -1.5    +1.5       no        +1.5
    #  5   3.0  (masked out: contributes nothing)
    # One advantage per sequence, so each token is its own row here (B=6, L=1).
    # sum = -1.1 - 2.56 - 0.5 + 0.8 + 1.5 = -1.86
    r = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 3.0], dtype=torch.float64)
    logp = r.log().unsqueeze(1).requires_grad_(True)
    batch = PolicyBatch(
        logp=logp,
        old_logp=torch.zeros(6, 1, dtype=torch.float64),
        advantages=torch.tensor([1.0, 2.0, 1.0, -1.0, -1.0, 5.0], dtype=torch.float64),
        mask=torch.tensor([[True]] * 5 + [[False]]),
    )
    loss, stats = grpo_loss(batch, LossSettings(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(-1.86, abs=1e-12)
    loss.backward()
    expected_grad = [-1.1, 0.0, -0.5, 0.0, 1.5, 0.0]
    assert logp.grad.flatten().tolist() == pytest.approx(expected_grad, abs=1e-12)
    assert stats["clipped_low"].item() == 1 and stats["clipped_high"].item() == 1
    assert stats["ratio_sum"].item() == pytest.approx(1.1 + 1.5 + 0.5 + 0.5 + 1.5)
    # |ln 1.1| + 2 |ln 1.5| + 2 |ln 0.5|
    expected_diff = math.log(1.1) + 2 * math.log(1.5) + 2 * math.log(2.0)
    assert stats["abs_logp_diff"].item() == pytest.approx(expected_diff)
    assert stats["kl_sum"].item() == 0.0 and stats["entropy_sum"].item() == 0.0
    assert stats["loss_sum"].item() == loss.item()
    assert not any(v.requires_grad for v in stats.values())


def test_grpo_loss_on_policy_is_minus_advantage_sum() -> None:
    # logp == old_logp: ratio 1 everywhere, nothing clipped, loss = -sum(A) over mask,
    # and the gradient is the REINFORCE one, -A per token.
    logp = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    batch = PolicyBatch(logp, logp.detach(), adv(0.5, -2.0), mask)
    loss, stats = grpo_loss(batch, LossSettings(0.2, 0.2))
    assert loss.item() == pytest.approx(-(3 * 0.5 + 2 * -2.0))
    loss.backward()
    expected = f64([-0.5, -0.5, -0.5, 0.0], [2.0, 2.0, 0.0, 0.0])
    assert torch.allclose(logp.grad, expected)
    assert stats["clipped_low"].item() == stats["clipped_high"].item() == 0
    assert stats["ratio_sum"].item() == pytest.approx(5.0)


def test_dapo_clip_higher_lets_a_rising_positive_token_learn() -> None:
    # old_logp = 0, ratios 1.25 (A = +1) and 0.75 (A = -1).
    #  grpo [0.8, 1.2]:  tok 0: min(1.25, 1.2) = 1.2 -> -1.2, clipped high, grad 0
    #  dapo [0.8, 1.28]: tok 0: 1.25 inside        -> -1.25, grad -A r = -1.25
    #  both:             tok 1: min(-0.75, -0.8)  -> +0.8, clipped low, grad 0
    assert (LOSSES["dapo"].clip_low, LOSSES["dapo"].clip_high) == (0.2, 0.28)
    assert (LOSSES["grpo"].clip_low, LOSSES["grpo"].clip_high) == (0.2, 0.2)
    results = {}
    for name in ("grpo", "dapo"):
        spec = LOSSES[name]
        logp = f64([math.log(1.25)], [math.log(0.75)]).requires_grad_(True)  # B=2, L=1
        mask = torch.ones(2, 1, dtype=torch.bool)
        batch = PolicyBatch(logp, torch.zeros(2, 1), adv(1.0, -1.0), mask)
        loss, stats = spec.fn(batch, LossSettings(spec.clip_low, spec.clip_high))
        loss.backward()
        results[name] = (loss.item(), logp.grad.flatten().tolist(), stats)
    loss, grad, stats = results["grpo"]
    assert loss == pytest.approx(-1.2 + 0.8) and grad == pytest.approx([0.0, 0.0])
    assert stats["clipped_high"].item() == 1 and stats["clipped_low"].item() == 1
    loss, grad, stats = results["dapo"]
    assert loss == pytest.approx(-1.25 + 0.8) and grad == pytest.approx([-1.25, 0.0])
    assert stats["clipped_high"].item() == 0 and stats["clipped_low"].item() == 1
    assert LOSSES["dapo"].overlong_filter and not LOSSES["grpo"].overlong_filter
    assert LOSSES["dapo"].normaliser is Normaliser.TOKENS


def test_dr_grpo_advantages_and_constant_normaliser() -> None:
    # rewards 1, 0: grpo gives +-0.5 / std(unbiased) = +-0.5 / 0.7071 = +-0.7071;
    # Dr. GRPO only centres them: +-0.5.
    assert advantage_fn("grpo")([1.0, 0.0]) == pytest.approx([0.7071067, -0.7071067], abs=1e-6)
    assert advantage_fn("dr_grpo")([1.0, 0.0]) == [0.5, -0.5]
    # On policy, two sequences of 2 and 4 tokens with A = +0.5 and -0.5:
    # sum = -(2 * 0.5 + 4 * -0.5) = 1.0. grpo divides by the 6 tokens (1/6); Dr. GRPO by
    # sequences x max_tokens = 2 x 8 = 16, whatever the lengths: 1/16 = 0.0625.
    logp = torch.full((2, 4), -1.0, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    batch = PolicyBatch(logp, logp, adv(0.5, -0.5), mask)
    spec = LOSSES["dr_grpo"]
    loss, _ = spec.fn(batch, LossSettings(spec.clip_low, spec.clip_high))
    assert loss.item() == pytest.approx(1.0)
    assert loss.item() / spec.normaliser.divisor(6, 2, max_tokens=8) == pytest.approx(0.0625)
    assert loss.item() / LOSSES["grpo"].normaliser.divisor(6, 2, 8) == pytest.approx(1 / 6)


def test_gspo_loss_hand_example() -> None:
    # Clip range [1 - 3e-4, 1 + 4e-4] (the paper's). old_logp = 0, so logp = log ratio.
    # seq 0: log ratios 0.2, -0.1, 0.05 -> mean 0.05, s = e^0.05 = 1.0512710964, A = +1:
    #        min(s, 1.0004) = 1.0004 -> -1.0004, clipped high (its 3 tokens), grad 0
    # seq 1: log ratios 2e-4, 0 (+ a nan in padding) -> mean 1e-4, s = 1.0001000050, A = -2:
    #        inside the range -> -min(-2s, -2s) = 2s = 2.0002000100; per token
    #        d(2s)/dlogp_t = 2s * 1/2 = s = 1.0001000050
    # sum = 2s - 1.0004 = 0.9998000100; each sequence counts once, not per token.
    spec = LOSSES["gspo"]
    assert (spec.clip_low, spec.clip_high) == (3e-4, 4e-4)
    assert spec.normaliser is Normaliser.SEQUENCES
    logp = f64([0.2, -0.1, 0.05], [2e-4, 0.0, float("nan")]).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    batch = PolicyBatch(logp, torch.zeros(2, 3), adv(1.0, -2.0), mask)
    loss, stats = gspo_loss(batch, LossSettings(spec.clip_low, spec.clip_high))
    assert loss.item() == pytest.approx(0.9998000100003335, abs=1e-12)
    loss.backward()
    s = 1.0001000050001667
    expected = [[0.0, 0.0, 0.0], [s, s, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]
    assert stats["clipped_high"].item() == 3 and stats["clipped_low"].item() == 0


def test_gspo_ratio_is_the_geometric_mean() -> None:
    # A sequence of n tokens that all move by the same log ratio d has s = e^d, the same
    # as a single such token: the ratio does not compound with length.
    spec = LOSSES["gspo"]
    settings_ = LossSettings(clip_low=1.0, clip_high=10.0)  # nothing clipped
    for n in (1, 5):
        logp = torch.full((1, n), 0.3, dtype=torch.float64)
        mask = torch.ones(1, n, dtype=torch.bool)
        loss, _ = spec.fn(PolicyBatch(logp, torch.zeros(1, n), adv(1.0), mask), settings_)
        assert loss.item() == pytest.approx(-math.exp(0.3))


def test_kl_k3_penalty_and_entropy_bonus() -> None:
    # On policy with A = 0, so only the extra terms act. Token 0: ref - logp = ln 2,
    # k3 = e^(ln 2) - ln 2 - 1 = 0.3068528194, dk3/dlogp = 1 - e^(ref - logp) = -1.
    # Token 1: ref == logp, k3 = 0, gradient 0. Entropy bonus: -coef * H per token,
    # dloss/dH = -coef.
    logp = f64([math.log(0.5), math.log(0.25)]).requires_grad_(True)
    entropy = f64([1.0, 2.0]).requires_grad_(True)
    batch = PolicyBatch(
        logp, logp.detach(), adv(0.0), torch.ones(1, 2, dtype=torch.bool),
        entropy=entropy, ref_logp=f64([0.0, math.log(0.25)]),
    )
    loss, stats = grpo_loss(batch, LossSettings(0.2, 0.2, kl_coef=0.1, entropy_coef=0.01))
    # 0.1 * 0.3068528194 - 0.01 * (1 + 2)
    assert loss.item() == pytest.approx(0.03068528194400546 - 0.03, abs=1e-12)
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.1, 0.0], abs=1e-12)
    assert entropy.grad.tolist()[0] == pytest.approx([-0.01, -0.01])
    assert stats["kl_sum"].item() == pytest.approx(0.3068528194400546)
    assert stats["entropy_sum"].item() == pytest.approx(3.0)
    # A reference without a coefficient is not a penalty, and an entropy without one
    # is only a stat.
    off, off_stats = grpo_loss(batch, LossSettings(0.2, 0.2))
    assert off.item() == 0.0 and off_stats["kl_sum"].item() == 0.0
    assert off_stats["entropy_sum"].item() == pytest.approx(3.0)


def test_gspo_extra_terms_are_per_sequence_means() -> None:
    # Under GSPO the KL term is reduced like the policy term: a token mean per sequence.
    # Row of 2 tokens with k3 = 0.3068528194 and 0 -> mean 0.1534264097, times 0.1.
    logp = f64([math.log(0.5), math.log(0.25)])
    batch = PolicyBatch(
        logp, logp, adv(0.0), torch.ones(1, 2, dtype=torch.bool),
        ref_logp=f64([0.0, math.log(0.25)]),
    )
    loss, _ = gspo_loss(batch, LossSettings(3e-4, 4e-4, kl_coef=0.1))
    assert loss.item() == pytest.approx(0.01534264097200273, abs=1e-12)


def test_normaliser_divisors() -> None:
    # 10 loss tokens in 3 sequences, a budget of 8 tokens per response
    assert Normaliser.TOKENS.divisor(10, 3, 8) == 10
    assert Normaliser.SEQUENCES.divisor(10, 3, 8) == 3
    assert Normaliser.SEQUENCE_BUDGET.divisor(10, 3, 8) == 24


@pytest.mark.parametrize("fn", [grpo_loss, gspo_loss])
def test_losses_ignore_nonfinite_padding(fn: LossFn) -> None:
    logp = f64([-1.0, float("nan")]).requires_grad_(True)
    old = f64([-1.0, float("-inf")])
    batch = PolicyBatch(
        logp, old, adv(1.0), torch.tensor([[True, False]]),
        entropy=f64([0.5, float("nan")]), ref_logp=f64([-1.0, float("inf")]),
    )
    loss, stats = fn(batch, LossSettings(0.2, 0.2, kl_coef=0.1, entropy_coef=0.1))
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 0.5)
    assert all(math.isfinite(v.item()) for v in stats.values())
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 0.0])  # no nan from the padding


def test_registry_matches_the_config_choices() -> None:
    choices = typing.get_args(typing.get_type_hints(TrainConfig)["loss"])
    assert set(choices) == set(LOSSES)
    with pytest.raises(ValueError, match="'ppo'.*grpo"):
        loss_spec("ppo")
