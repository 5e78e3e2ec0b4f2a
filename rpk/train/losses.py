"""The GRPO family's pure-torch pieces: group-relative advantages, per-token log-probs
and the policy losses, selected by name from `LOSSES`.

Every loss returns the *unnormalised sum* over its micro-batch and its `LossSpec`
declares the normaliser. The trainer adds the sums of a step up (as gradients) and
divides once, in `finish_step`, by the step's count: the update is then the same for any
split of the step into micro-batches and any arrival order, which lets the loop stream
groups into the trainer while rollout goes on.

`token_logprobs_and_entropy` is the plain full-logits path: the trainer's float64 path
(the exactness tests) and the reference the fused `rpk.kernels.logprob` agrees with.
Nothing here knows about models or devices.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` plus the entropy of each token's distribution, from the same
    log_softmax. The entropy is detached unless `entropy_grad` (the entropy bonus needs
    its gradient; the metric does not, and the graph it would keep is [tokens, V])."""
    logp_all = _scaled_log_softmax(logits, temperature)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# -- the losses ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PolicyBatch:
    """One micro-batch of responses, right-padded to [B, L].

    `mask` selects the tokens that enter the loss; a row without any is not a sequence
    of the step (padding rows, filtered samples). Padded positions may hold anything,
    non-finite values included: they are selected away, never multiplied by zero.
    """

    logp: torch.Tensor  # [B, L] the policy's log-probs (differentiable)
    old_logp: torch.Tensor  # [B, L] the sampler's
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, L] bool
    entropy: torch.Tensor | None = None  # [B, L]; differentiable for the entropy bonus
    ref_logp: torch.Tensor | None = None  # [B, L] frozen reference model, for the KL term


@dataclass(frozen=True, slots=True)
class LossSettings:
    clip_low: float
    clip_high: float
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


LossFn = Callable[[PolicyBatch, LossSettings], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Normaliser(enum.Enum):
    """What `finish_step` divides a step's summed loss (and gradient) by."""

    TOKENS = "tokens"  # every loss token of the step: a token-level mean
    SEQUENCES = "sequences"  # every sequence of the step: a mean over sequences
    SEQUENCE_BUDGET = "sequence_budget"  # sequences x max_tokens, a constant per sequence

    def divisor(self, tokens: int, sequences: int, max_tokens: int) -> int:
        if self is Normaliser.TOKENS:
            return tokens
        if self is Normaliser.SEQUENCES:
            return sequences
        return sequences * max_tokens


# Stats every loss returns: detached sums over the micro-batch's loss tokens, so that
# the trainer can add them up across micro-batches on device and sync once per step.
STAT_KEYS = (
    "loss_sum",  # the value whose gradient is taken (all terms, unnormalised)
    "clipped_low",  # tokens whose clipped term is active because the ratio fell below 1 - clip_low
    "clipped_high",  # ... because it rose above 1 + clip_high
    "abs_logp_diff",  # sum of |logp - old_logp|: the sampler/trainer mismatch
    "ratio_sum",  # sum of the token ratios exp(logp - old_logp)
    "kl_sum",  # sum of the k3 KL estimate to the reference (0 when off)
    "entropy_sum",  # sum of the token entropies (0 when not given)
)


def _safe(batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask-selected log-probs, log-ratio and per-token advantages. Masked positions are
    zeroed *before* any arithmetic: a nan in padding would otherwise come back as a nan
    gradient (0 * nan) even though a later `where` drops its value."""
    mask = batch.mask
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(mask, batch.logp, zero)
    old = torch.where(mask, batch.old_logp.to(logp.dtype), zero)
    adv = torch.where(mask, batch.advantages.to(logp.dtype).unsqueeze(-1), zero)
    log_ratio = (logp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return logp, log_ratio, adv


def _ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, s: LossSettings
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1 - low, 1 + high) A) and where each clip bound is the active
    term (zero gradient there)."""
    clipped = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) * adv
    per_token = -torch.minimum(ratio * adv, clipped)
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - s.clip_low)
        high = (adv > 0) & (ratio > 1.0 + s.clip_high)
    return per_token, low, high


def _finish(
    batch: PolicyBatch,
    s: LossSettings,
    logp: torch.Tensor,
    log_ratio: torch.Tensor,
    policy_term: torch.Tensor,
    clipped_low: torch.Tensor,
    clipped_high: torch.Tensor,
    per_sequence_mean: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the KL and entropy terms per token, reduce over the loss tokens (a plain sum,
    or a token mean within each sequence summed over sequences) and gather the stats."""
    mask = batch.mask
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    per_token = policy_term
    kl = None
    if batch.ref_logp is not None and s.kl_coef > 0:
        # k3 (Schulman's unbiased, always >= 0 estimator of KL(policy || ref)):
        # e^(ref - logp) - (ref - logp) - 1, as GRPO adds it per token.
        d = (torch.where(mask, batch.ref_logp.to(logp.dtype), zero) - logp).clamp(
            -_MAX_LOG_RATIO, _MAX_LOG_RATIO
        )
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + s.kl_coef * kl
    entropy = None
    if batch.entropy is not None:
        entropy = torch.where(mask, batch.entropy.to(logp.dtype), zero)
        if s.entropy_coef > 0:
            per_token = per_token - s.entropy_coef * entropy
    per_token = torch.where(mask, per_token, zero)
    if per_sequence_mean:
        lengths = mask.sum(-1)
        loss_sum = (per_token.sum(-1) / lengths.clamp(min=1).to(logp.dtype)).sum()
    else:
        loss_sum = per_token.sum()

    with torch.no_grad():
        stats = {
            "loss_sum": loss_sum.detach(),
            "clipped_low": (clipped_low & mask).sum().to(logp.dtype),
            "clipped_high": (clipped_high & mask).sum().to(logp.dtype),
            "abs_logp_diff": log_ratio.abs().sum(),
            "ratio_sum": torch.where(mask, log_ratio.exp(), zero).sum(),
            "kl_sum": kl.sum() if kl is not None else zero,
            "entropy_sum": entropy.sum() if entropy is not None else zero,
        }
    return loss_sum, stats


def grpo_loss(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per token against the sampler's log-probs; summed over tokens (the
    step's token-level mean, as DAPO and veRL's `token-mean`, after normalisation)."""
    logp, log_ratio, adv = _safe(batch)
    term, low, high = _ppo_clip(torch.exp(log_ratio), adv, s)
    return _finish(batch, s, logp, log_ratio, term, low, high, per_sequence_mean=False)


def gspo_loss(batch: PolicyBatch, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (arXiv 2507.18071): one importance ratio per sequence, the geometric mean of
    its token ratios exp(mean_t(logp - old_logp)), clipped at sequence level; each
    sequence counts once whatever its length (summed over sequences)."""
    logp, log_ratio, adv = _safe(batch)
    lengths = batch.mask.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / lengths)
    # The sequence's term broadcast to its tokens: the per-sequence token mean in
    # `_finish` gives back exactly one term per sequence.
    term, low, high = _ppo_clip(seq_ratio.expand_as(logp), adv, s)
    return _finish(batch, s, logp, log_ratio, term, low, high, per_sequence_mean=True)


@dataclass(frozen=True, slots=True)
class LossSpec:
    """A loss and what goes with it: its normaliser, its advantage estimator and the
    defaults that `train.clip_low`/`clip_high`/`overlong_filter` fall back to."""

    fn: LossFn
    normaliser: Normaliser
    clip_low: float
    clip_high: float
    scale_by_std: bool = True  # group advantages divided by the group's std
    overlong_filter: bool = False  # drop truncated responses from the loss


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(grpo_loss, Normaliser.TOKENS, clip_low=0.2, clip_high=0.2),
    # Dr. GRPO (arXiv 2503.20783): no std scaling of the advantages, and a constant
    # length normaliser, so long responses are not down-weighted per token.
    "dr_grpo": LossSpec(
        grpo_loss, Normaliser.SEQUENCE_BUDGET, clip_low=0.2, clip_high=0.2, scale_by_std=False
    ),
    # DAPO (arXiv 2503.14476): clip-higher and overlong filtering; its dynamic sampling
    # (dropping zero-variance groups) is the loop's business.
    "dapo": LossSpec(
        grpo_loss, Normaliser.TOKENS, clip_low=0.2, clip_high=0.28, overlong_filter=True
    ),
    # GSPO's sequence ratios sit within ~1e-3 of 1, hence the paper's tiny clip range.
    "gspo": LossSpec(gspo_loss, Normaliser.SEQUENCES, clip_low=3e-4, clip_high=4e-4),
}


def loss_spec(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}") from None


def advantage_fn(loss: str) -> Callable[[Sequence[float]], list[float]]:
    """The group-advantage estimator that goes with `loss` (what the loop is given)."""
    return functools.partial(group_advantages, scale_by_std=loss_spec(loss).scale_by_std)
