"""How many drafted tokens a simulated verify accepts: per draft source and position, and
calibrated to published figures for RL rollouts at scale, not to rpk's tiny model (whose
responses repeat numbers across siblings and accept far more).

The model. A verify of k drafts accepts its first j tokens and rejects the next with the
chance `a1 ... aj (1 - a(j+1))` (all k: `a1 ... ak`), where `ai` is the chance the i-th
drafted token is accepted once every earlier one was: vLLM's rejection sampling stops at
the first rejection. The rates by position are `rpk.sched.speculate.Acceptance`, the same
record the planner measures, one per draft source. Acceptance falls with the position,
`ai = a1 * fall^(i - 1)`: a draft copied from another response drifts from the one being
sampled the further it runs past the point where the two last agreed.

The calibration (docs/speculative.md, "In the simulator"):
- NeMo-RL's EAGLE-3 rollouts (arXiv 2604.26779, an 8B model at RL sampling) verify
  2.05-2.47 tokens per verify. The draft length behind that range is not in the figure
  rpk quotes; the model takes k = 3 (vLLM's EAGLE examples'), and sets `a1` so that
  tau(3) is the range's floor, 2.05: the published floor, not a rate chosen for its
  outcome. The fall (`FALL`) is an assumption (no
  per-position figure is quoted): with it tau stays inside the published range at every
  k from 3 to rpk's longest draft (8), which `inside_range` checks.
- rpk's sources that copy a response further along (a finished sibling, an aborted
  partial, an earlier epoch's response) share those rates: no published figure separates
  them. Seer drafts from a prompt's other responses, DAS from recent rollouts, and
  neither reports a per-token rate. The prompt's own n-grams have no row: no published
  rollout figure gives their rate, and the simulated runs do not draft from them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rpk.core.drafts import DraftSource
from rpk.sched.speculate import Acceptance

# NeMo-RL's EAGLE-3 rollouts: tokens per verify over its two workloads; the draft length
# the model assumes behind them.
NEMO_RL_TAU = (2.05, 2.47)
NEMO_RL_K = 3
# The draft lengths the model must keep inside the published range: the assumed one, up
# to rpk's longest (`SpecRule.max_k`).
CALIBRATED_KS = (3, 8)
# Acceptance at position i + 1 over that at i (an assumption, see the module docstring).
FALL = 0.9
# The sources that copy another response of the prompt (those the rates stand for).
TEXT_SOURCES = (DraftSource.SIBLING, DraftSource.PARTIAL, DraftSource.EPOCH)


def falling(a1: float, fall: float = FALL, positions: int = CALIBRATED_KS[1]) -> Acceptance:
    """`a1 * fall^(i - 1)` at positions 1..`positions` (later ones repeat the last)."""
    if not (0 < fall <= 1 and 0 <= a1 <= 1):
        raise ValueError(f"need 0 <= a1 <= 1 and 0 < fall <= 1, got a1={a1}, fall={fall}")
    return Acceptance(tuple(a1 * fall ** i for i in range(positions)))


def first_rate(tau: float, k: int, fall: float = FALL) -> float:
    """The `a1` whose k drafts give `tau` tokens per verify at this fall."""
    if k < 1 or not 1 <= tau <= falling(1.0, fall).tokens_per_verify(k):
        raise ValueError(f"no first-position rate gives tau={tau} at k={k}, fall={fall}")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # tau is increasing in a1: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if falling(mid, fall).tokens_per_verify(k) < tau else (lo, mid)
    return (lo + hi) / 2


def inside_range(acceptance: Acceptance, taus: tuple[float, float] = NEMO_RL_TAU,
                 ks: tuple[int, int] = CALIBRATED_KS) -> bool:
    """Whether tau(k) is within `taus` (to 1e-6) at every k in `ks` (inclusive)."""
    return all(taus[0] - 1e-6 <= acceptance.tokens_per_verify(k) <= taus[1] + 1e-6
               for k in range(ks[0], ks[1] + 1))


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


def calibrated(tau: float = NEMO_RL_TAU[0], fall: float = FALL) -> AcceptanceModel:
    """The published calibration (the module docstring): every text source with tau(3)
    = `tau`, acceptance falling by `fall` a position."""
    if not (math.isfinite(tau) and tau >= 1):
        raise ValueError(f"tokens per verify is >= 1, got {tau}")
    acc = falling(first_rate(tau, NEMO_RL_K, fall), fall)
    return AcceptanceModel({s: acc for s in TEXT_SOURCES})
