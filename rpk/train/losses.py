"""GRPO's pure-torch pieces: group-relative advantages, per-token log-probs and the
PPO-clipped surrogate.

These are the reference implementations: a fused, chunked log-prob kernel will replace
`token_logprobs` on GPU and is tested against it. Nothing here knows about models,
batches or devices beyond the tensors it is given.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

# Beyond e^20 the sample is garbage anyway; clamping keeps exp() finite so that one bad
# token cannot turn the whole step's loss into inf/nan (veRL clamps the same way).
_MAX_LOG_RATIO = 20.0


def group_advantages(
    rewards: Sequence[float], scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO's group-relative advantage of each response of one prompt.

    (r - mean) / (std + eps) with the *unbiased* (n-1) standard deviation, as TRL and
    veRL compute it (`torch.std`). `scale_by_std=False` gives plain r - mean (Dr. GRPO),
    which does not up-weight groups that barely disagree.

    A group whose rewards are all equal carries no signal and gets exact zeros (the
    float residue of r - mean divided by eps would otherwise be ~1e-11, not 0); so does
    a group of one, whose unbiased std is undefined.
    """
    n = len(rewards)
    if n == 0:
        return []
    values = [float(r) for r in rewards]
    if n == 1 or all(v == values[0] for v in values):
        return [0.0] * n
    mean = math.fsum(values) / n
    centered = [v - mean for v in values]
    if not scale_by_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / (n - 1))
    if std + eps == 0.0:  # eps=0 and a spread so tiny that its square underflows
        return [0.0] * n
    return [c / (std + eps) for c in centered]


def _scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # bf16/fp16 logits lose too much in log_softmax over a large vocabulary; float64
    # (used by the exactness tests) is kept as is.
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(wide / temperature, dim=-1)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-prob of each target token under softmax(logits / temperature).

    `logits` is [..., V], `targets` is [...] (int64); the result has the shape of
    `targets`, in at least float32. Dividing by the sampling temperature makes these
    the same distribution the sampler drew from, so the PPO ratio compares like with
    like.
    """
    logp_all = _scaled_log_softmax(logits, temperature)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus the (detached) entropy of each token's distribution,
    computed from the same log_softmax so the entropy metric costs one extra pass over
    the vocabulary and no second softmax."""
    logp_all = _scaled_log_softmax(logits, temperature)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ppo_clip_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped surrogate, summed over the masked tokens.

    Per token: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) with
    ratio = exp(logp - old_logp). The result is a *sum*, not a mean: the trainer divides
    the step's accumulated gradient by the step's total token count once, so the update
    does not depend on how the step was split into micro-batches.

    `advantages` broadcasts against `logp` (per token or per row); `mask` is bool or
    0/1. Masked-out positions are selected away with `where`, never multiplied by 0, so
    a non-finite value in padding reaches neither the sum nor the gradient.

    Stats (detached tensors, summed over the masked tokens, so callers can add them up
    across micro-batches and sync once):
      tokens          number of masked tokens
      clipped_tokens  tokens whose clipped term is the active one (zero gradient):
                      A > 0 and ratio > 1 + clip_high, or A < 0 and ratio < 1 - clip_low
      abs_logp_diff   sum of |logp - old_logp|: the sampler/trainer mismatch
      ratio_sum       sum of the ratios
    """
    mask = mask.to(torch.bool)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Masked positions are zeroed *before* the arithmetic: a nan in padding would
    # otherwise come back as a nan gradient (0 * nan) even though `where` drops it.
    logp = torch.where(mask, logp, zero)
    old_logp = torch.where(mask, old_logp.to(logp.dtype), zero)
    advantages = torch.where(mask, advantages.to(logp.dtype).expand_as(logp), zero)
    log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # exactly 0 where masked (A = 0)
    loss_sum = per_token.sum()

    with torch.no_grad():
        is_clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | (
            (advantages < 0) & (ratio < 1.0 - clip_low)
        )
        stats = {
            "tokens": mask.sum().to(per_token.dtype),
            "clipped_tokens": (is_clipped & mask).sum().to(per_token.dtype),
            "abs_logp_diff": (logp - old_logp).abs().sum(),
            "ratio_sum": torch.where(mask, ratio, zero).sum(),
        }
    return loss_sum, stats
