"""Where speculation pays: the draft length for each live batch size, from the engine's
step cost and the measured acceptance.

A decode step's cost grows with the tokens it processes: `fixed_s + per_token_s * n *
(k + 1)` for n running sequences each verifying k drafted tokens (`StepCost`; rpk's
`CostCurve` measures `fixed_s` and the per-sequence slope online). A verify of k drafts
yields `tau(k) = 1 + a1 + a1 a2 + ... + a1...ak` tokens per sequence, where `ai` is the
chance the i-th drafted token is accepted once the ones before it were (`Acceptance`).
Speculating with k drafts at batch n pays when `n tau(k) / cost(n, k)` beats
`n / cost(n, 0)` by `min_gain`: at the tail of a round (n small, the step bound by
reading the weights) it does; at full batch, where the step is bound by the tokens, it
does not. `plan_drafts` turns that into vLLM's `num_speculative_tokens_per_batch_size`
(inclusive batch-size ranges, the first from 1), so "speculate only in the tail" is
configuration the engine applies step by step.

Pure: no I/O, no engine; the rollout drivers, the simulator and the benchmarks call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class StepCost:
    """One engine step's seconds: `fixed_s` (reading the weights) plus `per_token_s` per
    token it runs (a running sequence's one decoded token, or its k drafts and the bonus
    token when it verifies), plus `draft_s_per_token` per drafted token proposed."""

    fixed_s: float
    per_token_s: float
    draft_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        bad = {n: v for n, v in (("fixed_s", self.fixed_s), ("per_token_s", self.per_token_s),
                                 ("draft_s_per_token", self.draft_s_per_token))
               if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"StepCost terms must be finite and >= 0, got {bad}")
        if self.fixed_s + self.per_token_s <= 0:
            raise ValueError(f"a step must cost time: fixed_s {self.fixed_s} + per_token_s {self.per_token_s} is 0")

    def seconds(self, batch: int, k: int) -> float:
        return self.fixed_s + self.per_token_s * batch * (k + 1) + self.draft_s_per_token * batch * k


@dataclass(frozen=True, slots=True)
class Acceptance:
    """Per draft position i (from 1), the chance its token is accepted given every
    earlier one was; positions past the measured ones repeat the last."""

    by_position: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.by_position:
            raise ValueError("Acceptance needs at least one position")
        out = [a for a in self.by_position if not (math.isfinite(a) and 0 <= a <= 1)]
        if out:
            raise ValueError(f"acceptance rates must be in [0, 1], got {out} in {self.by_position}")

    @classmethod
    def flat(cls, rate: float) -> Acceptance:
        return cls((rate,))

    def at(self, position: int) -> float:
        return self.by_position[min(position, len(self.by_position)) - 1]

    def tokens_per_verify(self, k: int) -> float:
        """tau(k): the tokens one sequence gains from a verify of k drafts (the bonus
        token included)."""
        tau, survive = 1.0, 1.0
        for i in range(1, k + 1):
            survive *= self.at(i)
            tau += survive
        return tau


def best_k(cost: StepCost, acceptance: Acceptance, batch: int, max_k: int, min_gain: float = 1.05) -> int:
    """The draft length with the most tokens per second at `batch` running sequences; 0
    unless some k beats plain decoding by `min_gain` (a margin for the acceptance's
    error)."""
    if batch < 1 or max_k < 0:
        raise ValueError(f"batch must be >= 1 and max_k >= 0, got batch={batch}, max_k={max_k}")
    plain = 1.0 / cost.seconds(batch, 0)
    best, best_rate = 0, plain * min_gain
    for k in range(1, max_k + 1):
        rate = acceptance.tokens_per_verify(k) / cost.seconds(batch, k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """vLLM's batch-size schedule: `(lo, hi, k)` inclusive ranges from 1 to `max_batch`;
    `k` is 0 where speculation does not pay. `max_k` is the engine's
    `num_speculative_tokens`, the largest k of any range."""

    bands: tuple[tuple[int, int, int], ...]

    @property
    def max_k(self) -> int:
        return max(k for _, _, k in self.bands)

    @property
    def speculates(self) -> bool:
        return self.max_k > 0

    def k_for(self, batch: int) -> int:
        for lo, hi, k in self.bands:
            if lo <= batch <= hi:
                return k
        return self.bands[-1][2]

    def schedule(self) -> list[tuple[int, int, int]]:
        """`num_speculative_tokens_per_batch_size` as vLLM takes it."""
        return [tuple(b) for b in self.bands]  # type: ignore[misc]


def plan_drafts(
    cost: StepCost, acceptance: Acceptance, max_batch: int, max_k: int, min_gain: float = 1.05,
) -> DraftPlan:
    """The best k for every batch size 1..max_batch, as contiguous ranges."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    bands: list[tuple[int, int, int]] = []
    for n in range(1, max_batch + 1):
        k = best_k(cost, acceptance, n, max_k, min_gain)
        if bands and bands[-1][2] == k:
            bands[-1] = (bands[-1][0], n, k)
        else:
            bands.append((n, n, k))
    return DraftPlan(tuple(bands))


def acceptance_from_counts(drafted: Sequence[int], accepted: Sequence[int], prior: float = 0.5,
                           prior_weight: float = 4.0) -> Acceptance:
    """Per-position conditional acceptance from vLLM's counters: `drafted[i]` drafts
    reached position i+1 and `accepted[i]` were accepted there. A position's rate is
    accepted / reached, where the drafts that reached position i+1 are those accepted at
    position i; `prior` pulls positions with few drafts toward it (`prior_weight`
    pseudo-counts), so a cold start neither speculates blindly nor never."""
    if len(drafted) != len(accepted) or not drafted:
        raise ValueError("need one drafted and one accepted count per position, "
                         f"got {len(drafted)} and {len(accepted)}")
    rates = []
    for d, a in zip(drafted, accepted):
        if a < 0 or d < a:
            raise ValueError(f"accepted ({a}) must be in 0..drafted ({d})")
        rates.append((a + prior * prior_weight) / (d + prior_weight))
    return Acceptance(tuple(rates))
