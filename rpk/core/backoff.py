"""Trying again after a failure that may pass: a restarted judge engine, a remote reward
service's batch, an external judge's request. All three wait the same way, doubling."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """At most `limit` tries after the first (0: the first failure is final); try k waits
    `backoff_s` * 2**(k-1) seconds, at most `max_backoff_s`."""

    limit: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.limit < 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"a backoff needs limit >= 0 and 0 <= backoff_s <= max_backoff_s, got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds before try `attempt` (1, 2, ...)."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)

    def jittered(self, attempt: int) -> float:
        """`delay`, drawn down to half at random: clients that failed together (the
        verdicts of one step, the batches of one service) do not retry together."""
        return self.delay(attempt) * random.uniform(0.5, 1.0)
