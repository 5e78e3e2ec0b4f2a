"""What a step has seen, and what it reports: `Tally` counts the samples, sequences,
tokens and micro-batches of a step (its loss stats a device tensor until the step's end),
`check_sample` refuses a sample the loss cannot take, and `stat_metrics` turns the
summed loss stats into the step's metrics. Pure bookkeeping: no model, no optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rpk.core.records import TrainSample
from rpk.train.losses import STAT_KEYS


@dataclass(slots=True)
class Tally:
    """What one step (or one `accumulate` call) has seen. The counts are known on the
    host from the samples; the loss stats stay a device tensor until `finish_step`."""

    samples: int = 0
    sequences: int = 0  # samples that entered the loss
    tokens: int = 0  # their response tokens
    micro_batches: int = 0
    overlong_filtered: int = 0
    sums: torch.Tensor | None = None  # STAT_KEYS order, float64

    def add(self, other: Tally) -> None:
        self.samples += other.samples
        self.sequences += other.sequences
        self.tokens += other.tokens
        self.micro_batches += other.micro_batches
        self.overlong_filtered += other.overlong_filtered
        if other.sums is not None:
            self.sums = other.sums if self.sums is None else self.sums + other.sums

    def counts(self) -> dict[str, float]:
        return {
            "train_samples": float(self.samples),
            "train_sequences": float(self.sequences),
            "train_tokens": float(self.tokens),
            "micro_batches": float(self.micro_batches),
            "overlong_filtered": float(self.overlong_filtered),
        }


def check_sample(s: TrainSample) -> None:
    if len(s.old_logprobs) != len(s.response_ids):
        raise ValueError(
            f"{len(s.response_ids)} response tokens but {len(s.old_logprobs)} old log-probs"
        )
    if s.loss_mask and (len(s.loss_mask) != len(s.response_ids) or not set(s.loss_mask) <= {0, 1}):
        raise ValueError(
            f"{len(s.response_ids)} response tokens but a loss mask of {len(s.loss_mask)} "
            f"values {sorted(set(s.loss_mask))} (one 0 or 1 per token)"
        )
    if s.response_ids and not s.prompt_ids:
        # The first response token needs a position that predicts it.
        raise ValueError("a sample with response tokens needs a non-empty prompt")
    # A nan here would not even show up in the gradient (the log-ratio clamp has zero
    # gradient at nan); it would silently drop the token and poison the loss metric.
    if not math.isfinite(s.advantage) or not all(map(math.isfinite, s.old_logprobs)):
        raise ValueError("non-finite advantage or old log-prob in a train sample")


def stat_metrics(
    sums: Mapping[str, float] | None, tokens: int, divisor: int, kl_on: bool
) -> dict[str, float]:
    """The step's loss (over the loss's own normaliser) and token means of the rest;
    zeros when nothing was seen."""
    values = dict(sums) if sums is not None else dict.fromkeys(STAT_KEYS, 0.0)
    per_token = 1.0 / tokens if tokens else 0.0
    low, high = values["clipped_low"] * per_token, values["clipped_high"] * per_token
    metrics = {
        "loss": values["loss_sum"] / divisor if divisor else 0.0,
        "clip_frac": low + high,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "logprob_mismatch": values["abs_logp_diff"] * per_token,
        "ratio_mean": values["ratio_sum"] * per_token,
        "entropy": values["entropy_sum"] * per_token,
    }
    if kl_on:
        metrics["kl"] = values["kl_sum"] * per_token
    return metrics
