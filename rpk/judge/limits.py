"""Requests and tokens per minute for an external judge: token buckets on explicit time.

A provider's limits are per minute ("500 requests, 200,000 tokens a minute"), and a
client that bursts past them is answered 429 until the minute turns. Each limit here is
a token bucket whose burst and refill together never pass the limit in any 60 seconds:
it holds at most `burst` (a tenth of the limit, at least one request's worth) and refills
at (limit - burst) / 60 a second, so any minute sees at most burst + (limit - burst).

`Budget` is the policy, pure and synchronous: the caller passes the time, so the tests
drive it on virtual time. `RateLimiter` is the thin async driver over a clock: callers
queue in order, each waits as long as the budget says, then takes its share.

A request's tokens are not known until it is answered (its prompt is tokenised by the
server, its completion is yet to come): it takes an estimate when it leaves and the
difference once `usage` comes back (`settle`). A request larger than a whole bucket
waits for a full one and leaves it in debt, which the next requests wait out: it is
never refused.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

MINUTE_S = 60.0
_ROUNDING = 1e-9


class TokenBucket:
    """One per-minute limit (see the module docstring), its level at time `t`."""

    def __init__(self, per_minute: float, now: float, burst: float | None = None) -> None:
        if not per_minute > 0:
            raise ValueError(f"a per-minute limit must be > 0, got {per_minute}")
        self.per_minute = per_minute
        self.capacity = burst if burst is not None else min(per_minute, max(1.0, per_minute / 10))
        if not 0 < self.capacity <= per_minute:
            raise ValueError(f"burst {self.capacity} must be in (0, {per_minute}]")
        # A burst of the whole limit leaves nothing to refill within the minute: then
        # it refills over the next (a limit of one a minute, or less).
        self.rate = (per_minute - self.capacity or per_minute) / MINUTE_S
        self.level = self.capacity
        self.t = now

    def _refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
            self.t = now

    def wait(self, now: float, amount: float) -> float:
        """Seconds from `now` until `amount` can be taken (0: now). More than a bucket
        holds waits for a full one."""
        self._refill(now)
        need = min(amount, self.capacity) - self.level
        # A shortfall of rounding is none: a clock that does not move past it (a virtual
        # one, at large times) would be asked to wait it forever.
        return 0.0 if need <= _ROUNDING * self.capacity else need / self.rate

    def take(self, now: float, amount: float) -> None:
        self._refill(now)
        self.level -= amount

    def settle(self, now: float, extra: float) -> None:
        """`extra` more than was taken (negative: fewer, given back up to the capacity)."""
        self._refill(now)
        self.level = min(self.capacity, self.level - extra)


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Requests and tokens per minute; None: no limit."""

    rpm: float | None = None
    tpm: float | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or unset, got {value}")


class Budget:
    """Both limits at once: a request leaves when each bucket has room for it."""

    def __init__(self, limits: RateLimits, now: float) -> None:
        self.requests = TokenBucket(limits.rpm, now) if limits.rpm is not None else None
        self.tokens = TokenBucket(limits.tpm, now) if limits.tpm is not None else None

    def wait(self, now: float, tokens: float) -> float:
        waits = [0.0]
        if self.requests is not None:
            waits.append(self.requests.wait(now, 1))
        if self.tokens is not None:
            waits.append(self.tokens.wait(now, tokens))
        return max(waits)

    def take(self, now: float, tokens: float) -> None:
        if self.requests is not None:
            self.requests.take(now, 1)
        if self.tokens is not None:
            self.tokens.take(now, tokens)

    def settle(self, now: float, extra: float) -> None:
        if self.tokens is not None:
            self.tokens.settle(now, extra)


class RateLimiter:
    """The async side of a `Budget`: `acquire` waits its turn (first come, first
    served), `settle` books a request's real token count. `clock` and `sleep` are
    the event loop's unless a test gives virtual ones."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        self.limits = limits
        self.clock = clock
        self.sleep = sleep
        self.budget = Budget(limits, clock())
        self._turn = asyncio.Lock()
        self.waited_s = 0.0

    @property
    def unlimited(self) -> bool:
        return self.limits.rpm is None and self.limits.tpm is None

    async def acquire(self, tokens: float) -> None:
        if self.unlimited:
            return
        async with self._turn:
            while (wait := self.budget.wait(self.clock(), tokens)) > 0:
                self.waited_s += wait
                await self.sleep(wait)
            self.budget.take(self.clock(), tokens)

    def settle(self, estimated: float, actual: float) -> None:
        if math.isfinite(actual):
            self.budget.settle(self.clock(), actual - estimated)
