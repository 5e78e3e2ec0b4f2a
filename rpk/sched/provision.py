"""Adaptive over-provisioning: how much a short round speculates, chosen per round from
the predicted lengths of its prompts and the engine's measured cost curve.

`CostCurve` measures the engine as the loop sees it. In a continuous-batching engine
every running request gains one token per decode step, so requests that started
together and finished with L1 and L2 tokens finished L2 - L1 steps apart: the time
between, against the requests in flight meanwhile, gives the cost curve, fitted as
step_s = base_s + per_seq_s * running by least squares over windows of a round's
finishes (older rounds decayed). A finish is reported at its step, unlike tokens streamed in chunks,
so the fit is not biased by how the engine batches its output. No engine hooks.

`EtaChooser` simulates the coming round a few dozen times per candidate (Monte Carlo
over the predicted lengths, common random numbers across candidates) and keeps the
candidate with the least expected rollout time per trained prompt:
- a round's time is base_s * steps + per_seq_s * tokens, since every running request
  costs per_seq_s per step; steps run until the P0-th group completes;
- extra prompts (eta_prompts) replace prompts that turn out long; extra responses
  (eta_responses) go only to prompts whose length guess is unsure, and their group is
  its first R0 to finish;
- `defer_after` aborts a response past that many tokens, and gives its prompt up once
  it cannot complete, when the round can spare it;
- a prompt left unfinished costs its full generation later, in a round of long
  prompts: its tokens, and its share of that round's steps;
- a trajectory's tool calls delay its finish without costing decode work: its wait is
  drawn with its tail (`rpk.sched.toolwait`: a timeout now and then), so a round that
  would wait on a hung call is seen to, and spares that make it need not are priced.
Throughput-bound engines (a CPU) make waste dear and waiting cheap, so little
speculation wins; memory-bound ones (a GPU decoding a large model) the reverse.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rpk.sched.predictor import LengthGuess
from rpk.sched.toolwait import ToolWait, wait_seconds

_SAMPLES = 16
_SURE_SIGMA = 0.3  # a length guess this good (log space, ~30%) gets no extra responses
_MIN_GAIN = 0.01  # speculation must be expected to save at least 1%
_WINDOW_STEPS = 8  # the cost curve is fitted over windows of at least this many steps


class CostCurve:
    """The engine's decode step time against requests in flight, measured online."""

    def __init__(self, decay: float = 0.7) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        # Least squares of dt = base_s * steps + per_seq_s * steps * running over the
        # intervals between finishes: sums of x1 x1, x1 x2, x2 x2, x1 y, x2 y, and n.
        self.stats = [0.0] * 6
        # The last fit the stats gave: a round of trajectories, whose finishes are spaced
        # by tool waits more than by tokens, may add too few windows to keep the decayed
        # stats fitted, and a curve once measured beats none.
        self.last: tuple[float, float] | None = None

    def observe(
        self,
        finishes: Sequence[tuple[float, int]],
        timeline: Sequence[tuple[float, int]],
        capacity: int,
        launched: int,
    ) -> None:
        """Learn from one round: when its requests finished and with how many tokens,
        and how many were in flight meanwhile. Only a round whose requests all fit in
        the engine at once counts: then each started with the round, and one that
        finished with L tokens had been through L decode steps."""
        if launched > capacity or len(finishes) < 2:
            return
        self.stats = [v * self.decay for v in self.stats]
        area = _InFlight(timeline, capacity)
        t0, l0 = finishes[0]
        for t1, l1 in finishes[1:]:
            steps = l1 - l0
            # windows of a few steps: an engine hands over finishes in batches, so the
            # time between two single finishes is mostly noise
            if steps < _WINDOW_STEPS or t1 <= t0:
                continue
            x1, x2, y = steps, steps * area.mean(t0, t1), t1 - t0
            a, b, c, d, e, n = self.stats
            self.stats = [a + x1 * x1, b + x1 * x2, c + x2 * x2, d + x1 * y, e + x2 * y, n + 1]
            t0, l0 = t1, l1
        self.last = self._fit() or self.last

    def fit(self) -> tuple[float, float] | None:
        """(base_s, per_seq_s), both >= 0: from the stats, else the last fit they gave;
        None until enough intervals were seen."""
        return self._fit() or self.last

    def _fit(self) -> tuple[float, float] | None:
        a, b, c, d, e, n = self.stats
        det = a * c - b * b
        if n < 4 or det <= 1e-12 * a * c:
            return None
        base = (d * c - b * e) / det
        per_seq = (a * e - b * d) / det
        if per_seq < 0:
            return d / a, 0.0
        if base < 0:
            return 0.0, e / c
        return base, per_seq

    def state_dict(self) -> dict[str, Any]:
        return {"stats": list(self.stats), "last": list(self.last) if self.last else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stats = [float(v) for v in state["stats"]]
        last = state.get("last")  # absent from older checkpoints
        self.last = (float(last[0]), float(last[1])) if last else None


class _InFlight:
    """Time-averaged requests in flight (capped at the engine's concurrency) over
    intervals that come in time order."""

    def __init__(self, timeline: Sequence[tuple[float, int]], capacity: int) -> None:
        self.timeline = timeline
        self.capacity = capacity
        self.i = 0  # timeline[i] is the last point at or before the cursor
        self.t = timeline[0][0] if timeline else 0.0
        self.area = 0.0  # integral of in-flight from the start to self.t

    def _advance(self, t: float) -> float:
        tl = self.timeline
        while self.i + 1 < len(tl) and tl[self.i + 1][0] <= t:
            self.area += min(tl[self.i][1], self.capacity) * (tl[self.i + 1][0] - self.t)
            self.t = tl[self.i + 1][0]
            self.i += 1
        self.area += min(tl[self.i][1], self.capacity) * (t - self.t)
        self.t = t
        return self.area

    def mean(self, t0: float, t1: float) -> float:
        a0 = self._advance(t0)
        return (self._advance(t1) - a0) / (t1 - t0)


@dataclass(frozen=True, slots=True)
class EtaBounds:
    prompts: tuple[float, float] = (1.0, 1.5)
    responses: tuple[float, float] = (1.0, 1.5)

    def __post_init__(self) -> None:
        for name in ("prompts", "responses"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"eta {name} bounds must satisfy 1 <= lo <= hi, got {(lo, hi)}")


@dataclass(frozen=True, slots=True)
class Provision:
    """How one round speculates, and why."""

    prompts: int  # launched (P0 of them are trained)
    launch: tuple[int, ...]  # responses per launched prompt
    defer_after: int  # 0: responses may run to the length budget
    eta_prompts: float
    eta_responses: float  # for the prompts whose guess is unsure (the others get the least)
    expected_s: float  # modelled rollout seconds per trained prompt (0: not modelled)
    baseline_s: float  # ... without speculation
    reason: str

    def metrics(self) -> dict[str, float | str]:
        return {
            "eta_prompts": self.eta_prompts,
            "eta_responses": self.eta_responses,
            "defer_after": float(self.defer_after),
            "eta_expected_s": self.expected_s,
            "eta_expected_gain": self.baseline_s / self.expected_s if self.expected_s else 1.0,
            "eta_reason": self.reason,
        }


def fixed(prompts: int, responses: int, p0: int, r0: int, reason: str) -> Provision:
    """Every prompt gets the same responses and no cap: the plain tail's speculation."""
    return Provision(
        prompts, (responses,) * prompts, 0, prompts / p0, responses / r0, 0.0, 0.0, reason
    )


@dataclass(frozen=True, slots=True)
class _Candidate:
    prompts: int
    extra_k: int  # responses of an unsure prompt
    defer_after: int


@dataclass(frozen=True, slots=True)
class _Range:
    """The candidates a round may take: launched prompts in [n_lo, n_max], an unsure
    prompt's responses in [k_lo, k_hi]."""

    n_lo: int
    n_max: int
    k_lo: int
    k_hi: int


@dataclass(frozen=True, slots=True)
class _Waits:
    """Simulated responses' tool waits: seconds [samples, prompts, responses], and a
    decode step's seconds, which turns tokens into time beside them."""

    seconds: np.ndarray
    step_s: float


class EtaChooser:
    """Picks a round's speculation within `bounds`; see the module docstring."""

    def __init__(self, bounds: EtaBounds = EtaBounds(), samples: int = _SAMPLES) -> None:
        self.bounds = bounds
        self.samples = samples

    def choose(
        self,
        guesses: Sequence[LengthGuess],
        *,
        p0: int,
        r0: int,
        max_tokens: int,
        cost: tuple[float, float] | None,
        concurrency: int,
        seed: int,
        tools: ToolWait | None = None,
    ) -> Provision:
        """`guesses`: the candidate prompts in the order they would be launched (the
        first P0 without speculation, the next ones as extras), their lengths in sampled
        tokens. `tools`: what prices each trajectory's tool wait, drawn by its guess's
        calls; None: no waits."""
        if len(guesses) < p0:
            raise ValueError(f"{len(guesses)} candidates for {p0} prompts")
        span = self._range(len(guesses), p0, r0)
        if cost is None:
            return fixed(span.n_lo, span.k_lo, p0, r0, "cost curve not measured yet: least speculation")
        sim = self._simulate(guesses[: span.n_max], span, p0, r0, max_tokens, cost, concurrency, seed, tools)
        baseline = _Candidate(span.n_lo, span.k_lo, 0)
        base_j = sim.cost(baseline)
        best, best_j = _search(sim, span, baseline, base_j, max_tokens)
        if best_j > base_j * (1 - _MIN_GAIN):
            best, best_j = baseline, base_j
        return _provision(best, best_j, base_j, best == baseline, sim.unsure, span.k_lo, p0, r0)

    def _range(self, candidates: int, p0: int, r0: int) -> _Range:
        n_max = min(candidates, math.ceil(self.bounds.prompts[1] * p0 - 1e-9))
        n_lo = min(n_max, max(p0, math.ceil(self.bounds.prompts[0] * p0 - 1e-9)))
        return _Range(n_lo, n_max, math.ceil(self.bounds.responses[0] * r0 - 1e-9),
                      math.ceil(self.bounds.responses[1] * r0 - 1e-9))

    def _simulate(
        self, guesses: Sequence[LengthGuess], span: _Range, p0: int, r0: int, max_tokens: int,
        cost: tuple[float, float], concurrency: int, seed: int, tools: ToolWait | None,
    ) -> _Round:
        """The round sampled `samples` times: each guess's true length drawn from its
        uncertainty, each response's around it, and each trajectory's tool wait."""
        rng = np.random.default_rng(seed)
        mu = np.array([g.mu for g in guesses])
        sigma = np.array([g.sigma for g in guesses])
        true_mu = mu + sigma * rng.standard_normal((self.samples, len(guesses)))
        z = rng.standard_normal((self.samples, len(guesses), span.k_hi))
        lengths = np.clip(np.exp(true_mu[..., None] + guesses[0].spread * z), 1, max_tokens)
        calls = np.array([g.tool_calls for g in guesses])
        waits = None
        if tools is not None and calls.any():  # no calls expected: priced as no tools
            waits = _Waits(wait_seconds(rng, calls, tools.latency, tools.timeout_s, lengths.shape), tools.step_s)
        return _Round(lengths, waits, sigma > _SURE_SIGMA, p0, r0, span.k_lo, *cost, concurrency)


def _search(
    sim: _Round, span: _Range, baseline: _Candidate, base_j: float, max_tokens: int
) -> tuple[_Candidate, float]:
    """The cheapest candidate of a grid: launched prompts, an unsure prompt's responses,
    and a length cap at 1.25x or 2x the median end of the round without one."""
    best, best_j = baseline, base_j
    for n in _spaced(span.n_lo, span.n_max, 6):
        for k in _spaced(span.k_lo, span.k_hi, 3) if sim.unsure[:n].any() else [span.k_lo]:
            free = _Candidate(n, k, 0)
            median_end = float(np.median(sim.tokens_end(free)))
            limits = [math.ceil(median_end * f) for f in (1.25, 2.0)]
            for c in [free, *(_Candidate(n, k, lim) for lim in limits if lim < max_tokens)]:
                if (j := sim.cost(c)) < best_j:
                    best, best_j = c, j
    return best, best_j


def _provision(
    best: _Candidate, best_j: float, base_j: float, least: bool, unsure: np.ndarray, k_lo: int,
    p0: int, r0: int,
) -> Provision:
    launch = tuple(best.extra_k if u else k_lo for u in unsure[: best.prompts])
    n_unsure = int(unsure[: best.prompts].sum())
    if least:
        reason = f"least speculation: more would not save {_MIN_GAIN:.0%} of {base_j * 1e3:.3g} ms/prompt"
    else:
        reason = (f"{best_j * 1e3:.3g} ms/prompt against {base_j * 1e3:.3g} without speculation; "
                  f"{n_unsure} of {best.prompts} guesses unsure")
    return Provision(
        prompts=best.prompts, launch=launch, defer_after=best.defer_after,
        eta_prompts=best.prompts / p0, eta_responses=(best.extra_k if n_unsure else k_lo) / r0,
        expected_s=best_j, baseline_s=base_j, reason=reason,
    )


def _spaced(lo: int, hi: int, count: int) -> list[int]:
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})


class _Round:
    """One simulated round over sampled lengths [samples, prompts, responses].

    With tool waits (`waits`: seconds of the same shape, and a decode step's seconds),
    a response finishes at its tokens' decode time plus its waits, and a round takes
    the longer of its decoding and its wait for the P0-th group: a wait costs wall
    time whether or not others decode meanwhile. A response's tokens come evenly over
    its life."""

    def __init__(
        self, lengths: np.ndarray, waits: _Waits | None, unsure: np.ndarray,
        p0: int, r0: int, k_sure: int, base_s: float, per_seq_s: float, concurrency: int,
    ) -> None:
        self.lengths = lengths
        self.walled = waits is not None
        self.finish = lengths * waits.step_s + waits.seconds if waits is not None else lengths
        self.unsure = unsure
        self.p0, self.r0, self.k_sure = p0, r0, k_sure
        self.base_s, self.per_seq_s = base_s, per_seq_s
        self.concurrency = concurrency
        # What a prompt left unfinished costs later: its R0 responses' tokens, and its
        # share of a long round's steps (or of its wall time, with tool waits).
        first = lengths[..., :r0]
        share = base_s * first.max(-1)
        if self.walled:
            share = np.maximum(share, self.finish[..., :r0].max(-1))
        self.later = per_seq_s * first.sum(-1) + share / p0

    def _groups(self, c: _Candidate, finish: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(finishes with absent responses at inf, group completion step, per-prompt
        token cap), of the responses finishing at `finish`."""
        n = c.prompts
        k = np.where(self.unsure[:n], c.extra_k, self.k_sure)
        present = np.arange(finish.shape[-1]) < k[:, None]
        live = np.where(present, finish[:, :n, :], np.inf)
        free = np.sort(live, axis=-1)[..., self.r0 - 1]
        if not c.defer_after:
            return live, free, np.full(free.shape, np.inf)
        # defer_after counts sampled tokens: the responses under it finish.
        under = self.lengths[:, :n, :] <= c.defer_after
        capped = np.sort(np.where(under, live, np.inf), axis=-1)[..., self.r0 - 1]
        viable = np.isfinite(capped)
        # A prompt is given up only while the round can spare it. All responses cross
        # the cap in the same step; the round book decides in launch order, which is
        # the longest guess first, so the ones it needs are the shortest guesses.
        short = np.maximum(0, self.p0 - viable.sum(-1))
        exempt = ~viable & (np.cumsum(~viable, axis=-1) <= short[:, None])
        groups = np.where(viable, capped, np.where(exempt, free, np.inf))
        cap = np.where(exempt, np.inf, float(c.defer_after))
        return live, groups, cap

    def tokens_end(self, c: _Candidate) -> np.ndarray:
        """The round's end as it would be with no tool waits: in sampled tokens, the
        unit of defer_after."""
        _, groups, _ = self._groups(c, self.lengths)
        return np.sort(groups, axis=-1)[:, self.p0 - 1]

    def cost(self, c: _Candidate) -> float:
        """Expected rollout seconds per trained prompt, the later cost of the rest included."""
        live, groups, cap = self._groups(c, self.finish)
        end = np.sort(groups, axis=-1)[:, self.p0 - 1]
        done = groups <= end[:, None]
        stop = np.where(done, groups, end[:, None])
        lengths = self.lengths[:, : c.prompts, :]
        with np.errstate(invalid="ignore"):  # inf / inf of absent responses, masked below
            made = np.minimum(lengths * np.minimum(1.0, stop[..., None] / live), cap[..., None])
        tokens = np.where(np.isfinite(live), made, 0.0).sum((1, 2))
        if self.walled:
            decoding = np.maximum(self.tokens_end(c), tokens / self.concurrency)
            seconds = np.maximum(end, self.base_s * decoding + self.per_seq_s * tokens)
        else:
            seconds = self.base_s * np.maximum(end, tokens / self.concurrency) + self.per_seq_s * tokens
        left = ~done
        later = np.where(left, self.later[:, : c.prompts], 0.0).sum(-1)
        per_prompt = (seconds + later) / (done.sum(-1) + left.sum(-1))
        return float(per_prompt.mean())
