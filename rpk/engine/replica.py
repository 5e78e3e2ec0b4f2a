"""What a rollout fleet asks of its replicas (the way weights reach them is
`rpk.sync.protocols.WeightTransport`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.modes import RestLevel
from rpk.core.records import GenDelta, GenRequest, ReplicaStats


class Replica(Protocol):
    """One engine of a fleet: the Engine protocol's request side, split so that a fleet
    can pause every replica before adding to any, plus sleep/wake and statistics."""

    weight_version: int | None  # None: unknown (its weights were dropped by a sleep)

    @property
    def max_concurrency(self) -> int: ...

    @property
    def speculates(self) -> bool:
        """Whether it runs speculative decoding (every step pays for it)."""
        ...

    def paused(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    async def add(self, requests: Sequence[GenRequest]) -> Mapping[str, AsyncIterator[GenDelta]]: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(self, level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
        """`KEEP_WEIGHTS` keeps them (on host); `DROP_WEIGHTS` drops them: `weight_version`
        becomes None."""
        ...

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake all, or only the parts in `tags` ("weights", "kv_cache")."""
        ...

    def take_stats(self) -> ReplicaStats: ...

    async def set_drafts(self, schedule: Sequence[tuple[int, int, int]], sources: Sequence[DraftSource],
                         prompts: Sequence[PromptDrafts]) -> None:
        """A round's draft-length schedule, draft sources and prompts' draft texts
        (a replica that does not speculate from texts ignores them)."""
        ...

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None: ...

    async def take_spec_stats(self) -> SpecStats: ...

    async def shutdown(self) -> None: ...
