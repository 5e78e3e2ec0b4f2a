"""What a rollout fleet asks of its replicas and of the way weights reach them."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterable, AsyncIterator, Mapping, Protocol, Sequence

from rpk.core.protocols import WeightBucket
from rpk.core.records import GenDelta, GenRequest, ReplicaStats


class Replica(Protocol):
    """One engine of a fleet: the Engine protocol's request side, split so that a fleet
    can pause every replica before adding to any, plus sleep/wake and statistics."""

    weight_version: int | None  # None: unknown (its weights were dropped by a sleep)

    @property
    def max_concurrency(self) -> int: ...

    def paused(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    async def add(self, requests: Sequence[GenRequest]) -> Mapping[str, AsyncIterator[GenDelta]]: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(self, level: int = 2) -> None:
        """Level 1 keeps the weights (on host), level 2 drops them: `weight_version`
        becomes None."""
        ...

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake all, or only the parts in `tags` ("weights", "kv_cache")."""
        ...

    def take_stats(self) -> ReplicaStats: ...

    async def shutdown(self) -> None: ...


class WeightTransport(Protocol):
    """Carries one weight update (a stream of buckets, read once) into several replicas
    at once, and sets their `weight_version`."""

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Any], version: int
    ) -> None: ...
