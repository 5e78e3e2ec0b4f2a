"""How long a tool takes: a seeded model of real agent tools' latency.

Remote tools (a code sandbox, a search API) answer after a latency with a long tail:
most calls near a median, a few several times slower, and now and then one that never
answers and runs into the caller's timeout. `LatencyModel` draws a call's seconds from
a log-normal given by its median and its 99th percentile, and with probability
`timeout_frac` returns infinity (the call hangs until `agent.tool_timeout_s` cuts it).

A draw is a hash of (seed, call number), not a shared random stream: a trajectory's
n-th call takes the same time whatever other trajectories called meanwhile, so runs
replay exactly (as `rpk.tasks.tool_add.fails` does for failures). Pure: the caller
sleeps, on the event loop's clock or a simulator's.

`Trajectories` gives each trajectory a seed of its own: the n-th trajectory started for
a row draws with (row seed, n), as the simulator's do (`rpk.sim.agent`). A remote
API's slow or lost call says nothing of the next attempt's, so neither the other
responses of a prompt nor the prompt's next round (tail batching's long round) inherit
its waits. Keyed on the row alone, every response of a prompt hung on the same call,
and a prompt deferred for a timeout met the same timeout in its long round.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable

_Z99 = NormalDist().inv_cdf(0.99)


def _uniform(*key: object) -> float:
    """A uniform draw in (0, 1) from `key`."""
    digest = hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2**64


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Log-normal seconds with median `median_s` and 99th percentile `p99_s`; a share
    `timeout_frac` of calls never answer (infinity). `median_s` 0: every call answers
    at once."""

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
        if self.median_s == 0:
            return 0.0
        if _uniform("timeout", seed, call) < self.timeout_frac:
            return math.inf
        z = NormalDist().inv_cdf(_uniform("latency", seed, call))
        return self.median_s * math.exp(self.sigma * z)


class Trajectories:
    """Latency draws per trajectory (see the module docstring): `start(seed)` is the
    draw function, call number -> seconds, of the next trajectory of the row `seed`."""

    __slots__ = ("model", "_started")

    def __init__(self, model: LatencyModel) -> None:
        self.model = model
        self._started: Counter[object] = Counter()

    def start(self, seed: object) -> Callable[[int], float]:
        n = self._started[seed]
        self._started[seed] += 1
        return functools.partial(self.model.seconds, f"{seed}/{n}")
