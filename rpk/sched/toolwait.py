"""How long a tool call takes, and what a trajectory's calls cost a round: one
`LatencyModel`, used by the built-in task's tool (`rpk.tasks.tool_add`), the simulator's
tools (`rpk.sim.agent`) and length_aware's provisioning (`rpk.sched.provision`).

Remote tools (a code sandbox, a search API) answer after a latency with a long tail:
most calls near a median, a few several times slower, and now and then one that never
answers and runs into the caller's timeout. `LatencyModel` is a log-normal given by its
median and its 99th percentile, and a share `timeout_frac` of calls that never answer.

A call's draw (`LatencyModel.seconds`) is a hash of (seed, call number), not a shared
random stream: a trajectory's n-th call takes the same time whatever other
trajectories called meanwhile, so runs replay exactly (`uniform`, which the adder's
failures draw from too). `LatencyDraws` gives each trajectory a seed of its own: the
n-th trajectory started for a row draws with (row seed, n). A remote API's slow or
lost call says nothing of the next attempt's, so neither the other responses of a
prompt nor the prompt's next round (tail batching's long round) inherit its waits.

Priced at its mean, a trajectory's tool wait hides what decides a short round: one call
in a hundred that never answers is a rare event per call but not per round: a
trajectory of k calls hits one with probability 1 - (1 - p)^k, and a round of many
trajectories nearly always holds some. Spares exist for exactly that trajectory; a mean
wait shows none. `wait_seconds` draws the waits of simulated trajectories with that
tail, and `CallLog` estimates the model from what the rounds saw where no model is
configured (a user's own tools).

Pure: no clock, no engine; the caller sleeps, on the event loop's clock or a simulator's.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

_Z99 = NormalDist().inv_cdf(0.99)
_MIN_TRAJECTORIES = 16  # observed trajectories with calls before their figures are used
_WINDOW = 512  # trajectories the observed figures are taken over


def uniform(*key: object) -> float:
    """A uniform draw in (0, 1), a hash of `key`."""
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """One tool call's seconds: log-normal with median `median_s` and 99th percentile
    `p99_s` when it answers; a share `timeout_frac` of calls never answer. `median_s`
    0: every call that answers does so at once."""

    median_s: float
    p99_s: float
    timeout_frac: float = 0.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or not math.isfinite(self.median_s):
            raise ValueError(f"tool latency: median_s={self.median_s!r} must be >= 0 and finite")
        if self.median_s > 0 and not (self.median_s <= self.p99_s < math.inf):
            raise ValueError(f"tool latency: p99_s={self.p99_s!r} must be finite and at least "
                             f"median_s={self.median_s!r}")
        if not 0.0 <= self.timeout_frac < 1.0:
            raise ValueError(f"tool latency: timeout_frac={self.timeout_frac!r} must be in [0, 1)")

    @property
    def sigma(self) -> float:
        """The log-normal's shape: ln(p99 / median) / z(0.99)."""
        return math.log(self.p99_s / self.median_s) / _Z99 if self.median_s > 0 else 0.0

    def seconds(self, seed: object, call: int) -> float:
        """The seconds call number `call` of a tool seeded `seed` takes (infinity: it
        never answers)."""
        if self.timeout_frac and uniform("timeout", seed, call) < self.timeout_frac:
            return math.inf
        if self.median_s == 0:
            return 0.0
        z = NormalDist().inv_cdf(uniform("latency", seed, call))
        return self.median_s * math.exp(self.sigma * z)

    def answered_mean_s(self, timeout_s: float) -> float:
        """The mean seconds of a call that answers (none waits past `timeout_s`)."""
        return min(self.median_s * math.exp(0.5 * self.sigma**2), timeout_s)

    def p_timeout_of(self, calls: np.ndarray) -> np.ndarray:
        """The chance that a trajectory of `calls` calls has at least one timeout."""
        return 1.0 - (1.0 - self.timeout_frac) ** np.maximum(calls, 0.0)


def _numbered(seed: object, n: int) -> object:
    return f"{seed}/{n}"


class LatencyDraws:
    """Latency draws per trajectory: `start(seed)` is the draw function, call number ->
    seconds, of the next trajectory of the row `seed`; the n-th one started for a seed
    draws with the key `key(seed, n)` (`seed/n`; the simulator names its own)."""

    __slots__ = ("model", "key", "_started")

    def __init__(self, model: LatencyModel, key: Callable[[object, int], object] = _numbered) -> None:
        self.model = model
        self.key = key
        self._started: Counter[object] = Counter()

    def start(self, seed: object) -> Callable[[int], float]:
        n = self._started[seed]
        self._started[seed] += 1
        return functools.partial(self.model.seconds, self.key(seed, n))


@dataclass(frozen=True, slots=True)
class ToolWait:
    """What prices a round's tool waits (`rpk.sched.provision.EtaChooser`): one call's
    latency, the timeout that ends a call which never answers, and a decode step's
    seconds, the unit a wait is weighed in against tokens."""

    latency: LatencyModel
    timeout_s: float
    step_s: float

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"tool wait: timeout_s={self.timeout_s!r} must be finite and > 0")


def wait_seconds(
    rng: np.random.Generator, calls: np.ndarray, latency: LatencyModel, timeout_s: float,
    shape: tuple[int, int, int],
) -> np.ndarray:
    """Tool waits in seconds, [samples, prompts, responses] (`shape`), of trajectories
    whose prompts make `calls` calls each on average. A trajectory has a timeout with
    probability 1 - (1 - p)^k (one at most: p is small) and k - 1 answered calls beside
    it, else k answered calls; their sum varies as a mean of k log-normal calls does
    (shape sigma / sqrt(k), mean kept)."""
    k = np.broadcast_to(np.asarray(calls, dtype=float)[None, :, None], shape)
    hit = rng.random(shape) < latency.p_timeout_of(k)
    s = latency.sigma / np.sqrt(np.maximum(k, 1.0))
    body = latency.answered_mean_s(timeout_s) * np.exp(s * rng.standard_normal(shape) - 0.5 * s**2)
    return np.maximum(k - hit, 0.0) * body + hit * timeout_s


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

    def latency(self) -> LatencyModel | None:
        """Per-call figures from the window (None until it holds enough): a trajectory
        of c calls that timed out says p = 1 - (1 - share)^(1 / mean calls); the
        answered ones' per-call seconds give the median and the 99th percentile."""
        if len(self.seen) < _MIN_TRAJECTORIES:
            return None
        hung = [s >= self.timeout_s for s, _ in self.seen]
        share = sum(hung) / len(hung)
        mean_calls = sum(c for _, c in self.seen) / len(self.seen)
        per_call = sorted(s / c for (s, c), h in zip(self.seen, hung) if not h)
        if not per_call:
            return LatencyModel(0.0, 0.0, min(share, 0.99))
        median = float(np.quantile(per_call, 0.5))
        p99 = max(float(np.quantile(per_call, 0.99)), median)
        p = 1.0 - (1.0 - min(share, 0.99)) ** (1.0 / mean_calls)
        return LatencyModel(median, p99, p)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": [list(x) for x in self.seen]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seen.clear()
        self.seen.extend((float(s), int(c)) for s, c in state["seen"])
