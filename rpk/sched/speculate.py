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

`Speculation` is the state a run plans with, round by round: the draft texts it keeps
across rounds (`rpk.sched.drafts`), the engine's cost curve (`rpk.sched.provision.
CostCurve`, fitted on decode steps: a finished response's tokens less the drafts it
accepted) and the acceptance vLLM measured, per round kind and per replica. Before each
round it gives every replica its `DraftPlan`; a round where no draft length pays has a
plan of k = 0 throughout, and runs without speculation. It lives in the policy's state,
so it is in every checkpoint.

Pure: no I/O, no engine; the rollout drivers, the simulator and the benchmarks call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.outcomes import RoundResult
from rpk.core.records import Prompt, RoundKind
from rpk.sched.drafts import DraftStore, StoreLimits
from rpk.sched.provision import CostCurve
from rpk.sched.round import prompt_position


@dataclass(frozen=True, slots=True)
class StepCost:
    """One engine step's seconds: `fixed_s` (reading the weights) plus `per_token_s` per
    token it runs (a running sequence's one decoded token, or its k drafts and the bonus
    token when it verifies), plus `draft_s_per_token` per drafted token proposed, plus
    `verify_s` once in a step that verifies drafts at all: what the engine's
    speculative path costs beyond the tokens (vLLM's rejection sampler and bookkeeping;
    on the CPU engine, measured by `bench/spec_step_cost.py`, a large share of a step)."""

    fixed_s: float
    per_token_s: float
    draft_s_per_token: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self) -> None:
        bad = {n: v for n, v in (("fixed_s", self.fixed_s), ("per_token_s", self.per_token_s),
                                 ("draft_s_per_token", self.draft_s_per_token), ("verify_s", self.verify_s))
               if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"StepCost terms must be finite and >= 0, got {bad}")
        if self.fixed_s + self.per_token_s <= 0:
            raise ValueError(f"a step must cost time: fixed_s {self.fixed_s} + per_token_s {self.per_token_s} is 0")

    def seconds(self, batch: int, k: int) -> float:
        verify = self.verify_s if k > 0 else 0.0
        return self.fixed_s + verify + self.per_token_s * batch * (k + 1) + self.draft_s_per_token * batch * k


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


# Until the cost curve is measured: a step at 32 running sequences costs twice one at 1
# (rpk's CPU engine measured ~35; a GPU decoding a large model is far flatter).
PRIOR_COST = StepCost(fixed_s=1.0, per_token_s=1.0 / 32)


@dataclass(frozen=True, slots=True)
class SpecRule:
    """How a run speculates: `max_k` drafted tokens at most (vLLM's
    `num_speculative_tokens`, fixed when the engine starts); a draft length must promise
    `min_gain` over plain decoding; acceptance starts at `prior` (worth `prior_weight`
    drafts) and older rounds' counts fade by `decay` a round; `adaptive` False drafts
    `max_k` at every batch size."""

    max_k: int = 8
    min_gain: float = 1.05
    prior: float = 0.5
    prior_weight: float = 4.0
    decay: float = 0.7
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.max_k < 1 or self.min_gain < 1 or not 0 < self.prior < 1 or self.prior_weight <= 0 \
                or not 0 < self.decay <= 1:
            raise ValueError(
                f"SpecRule needs max_k >= 1, min_gain >= 1, 0 < prior < 1, prior_weight > 0 and "
                f"0 < decay <= 1, got {self.max_k}, {self.min_gain}, {self.prior}, "
                f"{self.prior_weight}, {self.decay}")


class Speculation:
    """The speculative tail's plan state: draft texts across rounds, the cost curve, the
    acceptance by round kind and replica. `concurrency`: the engine's, as the cost curve
    measures it (`CostCurve.observe`)."""

    def __init__(self, sources: Iterable[DraftSource], rule: SpecRule = SpecRule(), concurrency: int = 512,
                 limits: StoreLimits = StoreLimits()) -> None:
        self.sources = frozenset(sources)
        self.rule = rule
        self.concurrency = concurrency
        self.store = DraftStore(self.sources, limits)
        self.cost = CostCurve(rule.decay)
        # "kind/replica" -> [reached by position, accepted by position], decayed sums
        self.counts: dict[str, list[list[float]]] = {}
        # replica -> the engine's step seconds on tokens run: (n, x, y, xx, xy), decayed;
        # the steps that verified no draft
        self.steps: dict[str, list[float]] = {}
        # replica -> (n, x, y) of its steps that verified drafts, decayed
        self.verifies: dict[str, list[float]] = {}
        # "kind/source" -> [draft tokens, accepted], decayed
        self.by_source: dict[str, list[float]] = {}
        # kind -> [sequences running in steps that verified drafts, those steps], decayed
        self.batches: dict[str, list[float]] = {}

    def drafts(self, prompts: Sequence[Prompt]) -> tuple[PromptDrafts, ...]:
        """What a round's prompts can draft from before the round: the stored texts."""
        return tuple(self.store.drafts(p) for p in prompts)

    def observe_cut(self, result: RoundResult, cut: Mapping[str, tuple[int, ...]]) -> None:
        """The tokens the engine's aborted requests had, by request id: those of the
        prompts the round left incomplete are kept as their partials."""
        if not self.store.keeps_partials:
            return
        plan = result.plan
        incomplete = {p.uid for p in result.incomplete}
        texts: dict[int, list[tuple[int, ...]]] = {}
        for rid, tokens in cut.items():
            pos = prompt_position(rid, plan.step)
            if pos is not None and pos < len(plan.prompts) and plan.prompts[pos].uid in incomplete:
                texts.setdefault(pos, []).append(tokens)
        for pos, cuts in texts.items():
            self.store.keep_partials(plan.prompts[pos], cuts)

    def step_cost(self, replica: str = "", replicas: int = 1) -> StepCost:
        """`replica`'s step cost: its engine steps' seconds fitted on the tokens each ran
        (vLLM's step statistics; every replica's together for one not seen yet), where
        enough were seen, with what its verifying steps cost above that line
        (`verify_s`); else the cost curve of the round's finishes, fitted against
        the requests in flight over the whole fleet (spread over `replicas`, so its slope
        is one replica's over that many); else the prior."""
        sums = self.steps.get(replica) or [sum(col) for col in zip(*self.steps.values())]
        own = _fit_line(sums)
        if own is not None:
            verifies = self.verifies.get(replica) or [sum(col) for col in zip(*self.verifies.values())]
            return StepCost(fixed_s=own[0], per_token_s=own[1], verify_s=_verify_extra(verifies, *own))
        fit = self.cost.fit()
        if fit is None or fit[0] + fit[1] <= 0:
            return PRIOR_COST
        return StepCost(fixed_s=fit[0], per_token_s=fit[1] * max(1, replicas))

    def sources_for(self, kind: RoundKind) -> frozenset[DraftSource]:
        """The sources a round of `kind` drafts from: those whose draft tokens were
        accepted often enough, in rounds of `kind`, to pay for verifying them (one draft
        at the batch such rounds drafted at: 1 + a tokens a step against the step's cost
        with a token more a sequence), each starting from the prior."""
        r = self.rule
        cost = self.step_cost()
        rows, steps = self.batches.get(kind.value, (0.0, 0.0))
        batch = max(1, round(rows / steps)) if steps else 1
        need = cost.seconds(batch, 1) / cost.seconds(batch, 0) * r.min_gain - 1
        keep = set()
        for source in self.sources:
            tokens, accepted = self.by_source.get(f"{kind.value}/{source.label}", (0.0, 0.0))
            if (accepted + r.prior * r.prior_weight) / (tokens + r.prior_weight) >= need:
                keep.add(source)
        return frozenset(keep)

    def acceptance(self, kind: RoundKind, replica: str) -> Acceptance:
        """Measured for rounds of `kind` on `replica`, else on the other replicas' rounds
        of `kind`, else the prior. Another kind's rounds say little: a short round's
        tail is its responses that went astray, a long round's is whole long prompts."""
        r = self.rule
        own = self.counts.get(f"{kind.value}/{replica}")
        if own is None or not own[0] or own[0][0] <= 0:
            pooled = [c for key, c in self.counts.items() if key.startswith(f"{kind.value}/")]
            own = _sum_counts(pooled) if pooled else None
        if own is None or not own[0] or own[0][0] <= 0:
            return Acceptance.flat(r.prior)
        reached, accepted = own
        return Acceptance(tuple((a + r.prior * r.prior_weight) / (d + r.prior_weight)
                                for d, a in zip(reached, accepted)))

    def plan(self, kind: RoundKind, replica: str, max_batch: int, replicas: int = 1) -> DraftPlan:
        """`replica`'s draft length by batch size for the coming round of `kind`."""
        r = self.rule
        if not r.adaptive:
            return DraftPlan(((1, max_batch, r.max_k),))
        if not self.sources_for(kind):
            return DraftPlan(((1, max_batch, 0),))
        return plan_drafts(self.step_cost(replica, replicas), self.acceptance(kind, replica), max_batch,
                           r.max_k, r.min_gain)

    def observe(self, result: RoundResult) -> None:
        """A round's end (the policy's commit): the texts it leaves, its finishes for the
        cost curve."""
        self.store.observe(result)
        self.cost.observe(result.finishes, result.timeline, self.concurrency, result.launched)

    def observe_stats(self, kind: RoundKind, stats: Mapping[str, SpecStats]) -> None:
        """What each replica's speculative decoding did in a round of `kind`: its
        acceptance by position, over the drafts that reached each position with every
        earlier token accepted (`reached_by_position`). Every round
        fades the old counts, drafts or not: a kind whose acceptance was measured too low
        to draft drifts back to the prior, and is measured again."""
        decay = self.rule.decay
        for replica, s in stats.items():
            if s.step_fit:
                old_fit = self.steps.get(replica, [0.0] * 5)
                self.steps[replica] = [a * decay + b for a, b in zip(old_fit, s.step_fit)]
            if s.verify_fit:
                old_fit = self.verifies.get(replica, [0.0] * 3)
                self.verifies[replica] = [a * decay + b for a, b in zip(old_fit, s.verify_fit)]
            if s.spec_steps:
                rows, steps = self.batches.get(kind.value, (0.0, 0.0))
                self.batches[kind.value] = [rows * decay + s.spec_step_rows, steps * decay + s.spec_steps]
            for source, c in s.by_source.items():
                skey = f"{kind.value}/{source.label}"
                tokens, accepted = self.by_source.get(skey, (0.0, 0.0))
                self.by_source[skey] = [tokens * decay + c.tokens, accepted * decay + c.accepted]
            key = f"{kind.value}/{replica}"
            if not s.drafts:
                if key in self.counts:
                    old = self.counts[key]
                    self.counts[key] = [_add_decayed(old[0], [], decay), _add_decayed(old[1], [], decay)]
                continue
            reached = reached_by_position(s.drafts, s.drafted_by_pos, s.accepted_by_pos)
            accepted = [float(a) for a in s.accepted_by_pos[: len(reached)]]
            old = self.counts.get(key, [[], []])
            self.counts[key] = [_add_decayed(old[0], reached, decay), _add_decayed(old[1], accepted, decay)]

    def state_dict(self) -> dict[str, Any]:
        return {"store": self.store.state_dict(), "cost": self.cost.state_dict(),
                "counts": {k: [list(a), list(b)] for k, (a, b) in self.counts.items()},
                "steps": {k: list(v) for k, v in self.steps.items()},
                "verifies": {k: list(v) for k, v in self.verifies.items()},
                "by_source": {k: list(v) for k, v in self.by_source.items()},
                "batches": {k: list(v) for k, v in self.batches.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.store.load_state_dict(state.get("store", {}))
        if "cost" in state:
            self.cost.load_state_dict(state["cost"])
        self.counts = {str(k): [[float(x) for x in a], [float(x) for x in b]]
                       for k, (a, b) in state.get("counts", {}).items()}
        self.steps = {str(k): [float(x) for x in v] for k, v in state.get("steps", {}).items()}
        self.verifies = {str(k): [float(x) for x in v] for k, v in state.get("verifies", {}).items()}
        self.by_source = {str(k): [float(x) for x in v] for k, v in state.get("by_source", {}).items()}
        self.batches = {str(k): [float(x) for x in v] for k, v in state.get("batches", {}).items()}


def reached_by_position(drafts: int, drafted_by_pos: Sequence[int], accepted_by_pos: Sequence[int]
                        ) -> list[float]:
    """Per position, the drafts that reached it with every earlier token accepted: the
    denominators of the conditional acceptance. vLLM counts each position's drafts
    whatever came before, and a round's verifies draft different lengths (the plan's k
    follows the batch), so position i's share of the drafts accepted at i - 1 is taken
    as the share of drafts at i - 1 that went on to i (acceptance at i - 1 independent of
    the draft's length): `accepted[i-1] * drafted[i] / drafted[i-1]`. With one draft
    length throughout that is `accepted[i-1]`; bounding by it alone would count the
    acceptances of shorter drafts, which never drafted position i, and halve the
    rates measured past the first."""
    out: list[float] = []
    for i, d in enumerate(drafted_by_pos):
        if i == 0:
            out.append(float(min(d, drafts)))
            continue
        before = drafted_by_pos[i - 1]
        out.append(float(min(d, accepted_by_pos[i - 1] * d / before)) if before else 0.0)
    return out


# Engine steps a replica's step-cost fit needs before it replaces the cost curve.
_MIN_STEPS = 50.0
# Verifying steps needed before their extra cost counts (until then: 0, the tokens alone).
_MIN_VERIFIES = 20.0


def _fit_line(sums: Sequence[float]) -> tuple[float, float] | None:
    """(intercept, slope) >= 0 of a least-squares line from its sums (n, x, y, xx, xy);
    None with too few points or no spread in x."""
    if len(sums) != 5:
        return None
    n, sx, sy, sxx, sxy = sums
    det = n * sxx - sx * sx
    if n < _MIN_STEPS or det <= 1e-9 * n * sxx:
        return None
    slope = (n * sxy - sx * sy) / det
    base = (sy - slope * sx) / n
    if slope < 0:
        return sy / n, 0.0
    if base < 0:
        return 0.0, sxy / sxx
    return base, slope


def _verify_extra(sums: Sequence[float], fixed_s: float, per_token_s: float) -> float:
    """The mean seconds verifying steps took above the plain steps' line, >= 0, from
    their sums (n, x, y); 0 with too few of them."""
    if len(sums) != 3 or sums[0] < _MIN_VERIFIES:
        return 0.0
    n, sx, sy = sums
    return max(0.0, (sy - fixed_s * n - per_token_s * sx) / n)


def _add_decayed(old: Sequence[float], new: Sequence[float], decay: float) -> list[float]:
    n = max(len(old), len(new))
    return [(old[i] * decay if i < len(old) else 0.0) + (new[i] if i < len(new) else 0.0) for i in range(n)]


def _sum_counts(counts: Sequence[list[list[float]]]) -> list[list[float]]:
    out: list[list[float]] = [[], []]
    for c in counts:
        out = [_add_decayed(out[0], c[0], 1.0), _add_decayed(out[1], c[1], 1.0)]
    return out
