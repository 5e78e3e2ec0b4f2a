"""How many drafted tokens a simulated verify accepts: per draft source and position, and
calibrated to published figures for RL rollouts at scale, not to rpk's tiny model (whose
responses repeat numbers across siblings and accept far more).

The model. A verify of k drafts accepts its first j tokens and rejects the next with the
chance `a1 ... aj (1 - a(j+1))` (all k: `a1 ... ak`), where `ai` is the chance the i-th
drafted token is accepted once every earlier one was: vLLM's rejection sampling stops at
the first rejection. The rates by position are `rpk.sched.speculate.Acceptance`, the same
record the planner measures, one per draft source.

The calibration (docs/speculative.md, "In the simulator"):
- NeMo-RL's EAGLE-3 rollouts (arXiv 2604.26779; Qwen3-8B, RL sampling) verify
  2.05-2.47 tokens per verify at k = 3 (the draft length its guide configures and its
  paper finds stable). With one figure per workload at one k, the model has one free
  parameter: a flat per-token rate. tau(k) = (1 - a^(k+1)) / (1 - a) grows with k
  towards 1 / (1 - a), so a flat rate keeps tau inside the published range at every k
  from 3 to rpk's longest draft (8) only for a in [0.560, 0.599]; the model takes the
  low end (tau 2.05 at k = 3, at most 2.27 at any k): the published floor, not a rate
  chosen for its outcome.
- rpk's sources that copy a response further along (a finished sibling, an aborted
  partial, an earlier epoch's response) share that rate: no published figure separates
  them. Seer drafts from a prompt's other responses, DAS from recent rollouts, and
  neither reports a per-token rate. The prompt's own n-grams have no row: NeMo-RL reports
  n-gram drafting slower than none in RL rollouts, and no rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from rpk.core.drafts import DraftSource
from rpk.sched.speculate import Acceptance

# NeMo-RL's EAGLE-3 rollouts: tokens per verify over its two workloads, and its draft length.
NEMO_RL_TAU = (2.05, 2.47)
NEMO_RL_K = 3
# The draft lengths the model must keep inside the published range: NeMo-RL's, up to
# rpk's longest (`SpecRule.max_k`).
CALIBRATED_KS = (3, 8)
# The sources that copy another response of the prompt (those the rate stands for).
TEXT_SOURCES = (DraftSource.SIBLING, DraftSource.PARTIAL, DraftSource.EPOCH)


def flat_tau(rate: float, k: int) -> float:
    """Tokens per verify of k drafts at a flat per-token rate, the bonus token included."""
    return Acceptance.flat(rate).tokens_per_verify(k)


def flat_rate(tau: float, k: int) -> float:
    """The flat per-token rate whose k drafts give `tau` tokens per verify."""
    if k < 1 or not 1 <= tau <= k + 1:
        raise ValueError(f"tau must be in 1..k+1 for k >= 1, got tau={tau}, k={k}")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # tau is increasing in the rate: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if flat_tau(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def calibrated_band(taus: tuple[float, float] = NEMO_RL_TAU, ks: tuple[int, int] = CALIBRATED_KS
                    ) -> tuple[float, float]:
    """The flat rates whose tau stays within `taus` at every k in `ks` (inclusive): from
    the one that gives the floor at the shortest k to the one that gives the ceiling at
    the longest."""
    lo, hi = flat_rate(taus[0], ks[0]), flat_rate(taus[1], ks[1])
    if lo > hi:
        raise ValueError(f"no flat rate keeps tau in {taus} for k in {ks}: {lo:.4f} > {hi:.4f}")
    return lo, hi


@dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """Per-position acceptance of each draft source the simulator can draft from."""

    by_source: Mapping[DraftSource, Acceptance]

    def __post_init__(self) -> None:
        if not self.by_source:
            raise ValueError("AcceptanceModel needs a row for at least one source")

    def acceptance(self, source: DraftSource) -> Acceptance:
        got = self.by_source.get(source)
        if got is None:
            have = ", ".join(s.label for s in sorted(self.by_source))
            raise ValueError(f"the acceptance model has no rate for draft source {source.label!r} (it has {have})")
        return got

    def pmf(self, source: DraftSource, k: int) -> list[float]:
        """P(the verify accepts exactly j drafted tokens), j = 0..k."""
        acc = self.acceptance(source)
        out, survive = [], 1.0
        for i in range(1, k + 1):
            out.append(survive * (1 - acc.at(i)))
            survive *= acc.at(i)
        out.append(survive)
        return out

    def tokens_per_verify(self, source: DraftSource, k: int) -> float:
        return self.acceptance(source).tokens_per_verify(k)


def calibrated(rate: float | None = None) -> AcceptanceModel:
    """The published calibration (the module docstring): every text source at the flat
    `rate`, by default the low end of `calibrated_band()`."""
    a = calibrated_band()[0] if rate is None else rate
    if not (math.isfinite(a) and 0 <= a < 1):
        raise ValueError(f"a per-token acceptance rate is in [0, 1), got {a}")
    return AcceptanceModel({s: Acceptance.flat(a) for s in TEXT_SOURCES})
