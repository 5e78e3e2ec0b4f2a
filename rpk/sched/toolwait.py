"""What a trajectory's tool calls cost a round: the wait, with its tail.

Priced at its mean, a trajectory's tool wait hides what decides a short round: a tool
call now and then never answers and ends at `agent.tool_timeout_s`. One call in a
hundred is a rare event per call but not per round: a trajectory of k calls hits one
with probability 1 - (1 - p)^k, and a round of many trajectories nearly always holds
some. Spares exist for exactly that trajectory; a mean wait shows none.

`CallLatency` is one call's seconds: answered calls log-normal (median, shape), a share
`timeout_p` that end at `timeout_s`. It comes from the latency model configured for the
task's tool (`from_model`), else from what the rounds saw (`CallLog`). `wait_seconds`
draws the tool waits of simulated trajectories, for `rpk.sched.provision`.
Pure: no clock, no engine.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

_Z99 = NormalDist().inv_cdf(0.99)
_MIN_TRAJECTORIES = 16  # observed trajectories with calls before their figures are used
_WINDOW = 512  # trajectories the observed figures are taken over


@dataclass(frozen=True, slots=True)
class CallLatency:
    """One tool call's seconds: log-normal with median `median_s` and shape `sigma` when
    it answers; a share `timeout_p` never answer and end at `timeout_s`."""

    median_s: float
    sigma: float
    timeout_p: float
    timeout_s: float

    def __post_init__(self) -> None:
        if not (0 <= self.median_s < math.inf and 0 <= self.sigma < math.inf):
            raise ValueError(f"call latency: median_s={self.median_s!r} and sigma={self.sigma!r} "
                             "must be finite and >= 0")
        if not 0 <= self.timeout_p < 1:
            raise ValueError(f"call latency: timeout_p={self.timeout_p!r} must be in [0, 1)")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"call latency: timeout_s={self.timeout_s!r} must be finite and > 0")

    @classmethod
    def from_model(cls, median_s: float, p99_s: float, timeout_frac: float, timeout_s: float) -> CallLatency:
        """From a latency model's figures (`rpk.agent.latency.LatencyModel`) and the
        timeout that ends a call which never answers."""
        sigma = math.log(p99_s / median_s) / _Z99 if median_s > 0 else 0.0
        return cls(median_s, sigma, timeout_frac, timeout_s)

    @property
    def answered_mean_s(self) -> float:
        return min(self.median_s * math.exp(0.5 * self.sigma**2), self.timeout_s)

    def p_timeout(self, calls: float) -> float:
        """The chance that a trajectory of `calls` calls has at least one timeout."""
        return float(self.p_timeout_of(np.asarray(calls, dtype=float)))

    def p_timeout_of(self, calls: np.ndarray) -> np.ndarray:
        return 1.0 - (1.0 - self.timeout_p) ** np.maximum(calls, 0.0)

    def mean_wait_s(self, calls: float) -> float:
        """A trajectory's expected seconds in `calls` calls, the timeouts included."""
        p = self.timeout_p
        return max(calls, 0.0) * ((1 - p) * self.answered_mean_s + p * self.timeout_s)


def wait_seconds(
    rng: np.random.Generator, calls: np.ndarray, latency: CallLatency, shape: tuple[int, int, int],
) -> np.ndarray:
    """Tool waits in seconds, [samples, prompts, responses] (`shape`), of trajectories
    whose prompts make `calls` calls each on average. A trajectory has a timeout with
    probability 1 - (1 - p)^k (one at most: p is small) and k - 1 answered calls beside
    it, else k answered calls; their sum varies as a mean of k log-normal calls does
    (shape sigma / sqrt(k), mean kept)."""
    k = np.broadcast_to(np.asarray(calls, dtype=float)[None, :, None], shape)
    hit = rng.random(shape) < latency.p_timeout_of(k)
    s = latency.sigma / np.sqrt(np.maximum(k, 1.0))
    body = latency.answered_mean_s * np.exp(s * rng.standard_normal(shape) - 0.5 * s**2)
    return np.maximum(k - hit, 0.0) * body + hit * latency.timeout_s


class CallLog:
    """Trajectories' tool calls as the rounds saw them: per-call seconds (a
    trajectory's seconds over its calls) and which ran into the timeout (their seconds
    reach `timeout_s`, which no answered call does), over a window of recent ones."""

    def __init__(self, timeout_s: float, window: int = _WINDOW) -> None:
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s={timeout_s!r} must be finite and > 0")
        self.timeout_s = timeout_s
        self.seen: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, calls)

    def observe(self, seconds: Sequence[float], calls: Sequence[int]) -> None:
        self.seen.extend((s, c) for s, c in zip(seconds, calls) if c > 0)

    def latency(self) -> CallLatency | None:
        """Per-call figures from the window (None until it holds enough): a trajectory
        of c calls that timed out says p = 1 - (1 - share)^(1 / mean calls); the
        answered ones' per-call seconds give the median and, by their 99th
        percentile, the shape."""
        if len(self.seen) < _MIN_TRAJECTORIES:
            return None
        hung = [s >= self.timeout_s for s, _ in self.seen]
        share = sum(hung) / len(hung)
        mean_calls = sum(c for _, c in self.seen) / len(self.seen)
        per_call = sorted(s / c for (s, c), h in zip(self.seen, hung) if not h)
        if not per_call:
            return CallLatency(0.0, 0.0, min(share, 0.99), self.timeout_s)
        median = float(np.quantile(per_call, 0.5))
        p99 = float(np.quantile(per_call, 0.99))
        sigma = math.log(p99 / median) / _Z99 if median > 0 and p99 > median else 0.0
        p = 1.0 - (1.0 - min(share, 0.99)) ** (1.0 / mean_calls)
        return CallLatency(median, sigma, p, self.timeout_s)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": [list(x) for x in self.seen]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seen.clear()
        self.seen.extend((float(s), int(c)) for s, c in state["seen"])
