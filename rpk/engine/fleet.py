"""A fleet of rollout replicas behind the one `Engine` protocol, so `run_round` does not
change.

- `Router` (pure state, no await): where each request goes. All responses of a prompt
  go to one replica (they share the prompt's KV through prefix caching); prompts go to
  the least loaded replica (requests in flight over its concurrency); an abort goes
  where its request went.
- `Fleet` (the thin async driver): starts a round's requests with every receiving
  replica paused, so that on each replica they start together; fans one weight update
  out to every awake replica; tracks the weight version each replica serves and refuses
  to start a round on a stale one; reads per-replica statistics per round; regroups
  between rounds to another layout (`rpk.engine.layouts`).

Replicas are `VLLMEngine`s on devices (`rpk.engine.vllm_fleet`) or `SimEngine`s on
virtual time (`rpk.sim.fleet`); both satisfy `rpk.engine.replica.Replica`. How weights
reach them is a `WeightTransport`, chosen by the builder.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Callable, Sequence

from rpk.core.protocols import WeightBucket
from rpk.core.records import GenDelta, GenRequest, ReplicaStats
from rpk.engine.layouts import Layout, Layouts
from rpk.engine.replica import Replica, WeightTransport


class StaleReplicaError(RuntimeError):
    """A replica would serve other weights than the fleet's current version."""


class Router:
    """Placement over explicit state: requests in flight per replica, and where each
    request went. Each call is O(requests it is given)."""

    def __init__(self, capacities: Sequence[int]) -> None:
        if not capacities or any(c < 1 for c in capacities):
            raise ValueError(f"replica capacities must be >= 1, got {list(capacities)}")
        self.capacities = tuple(capacities)
        self.in_flight = [0] * len(capacities)
        self._where: dict[str, int] = {}

    @property
    def busy(self) -> bool:
        return bool(self._where)

    def place(self, requests: Sequence[GenRequest]) -> list[list[GenRequest]]:
        """Each replica's share of `requests`, in their order. A prompt's requests (same
        prompt tokens) stay together; prompts go, in order of first appearance, to the
        replica with the least load (in flight / capacity), the lowest index on a tie."""
        groups: dict[tuple[int, ...], list[GenRequest]] = {}
        for r in requests:
            if r.request_id in self._where:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            groups.setdefault(r.prompt_token_ids, []).append(r)
        target: dict[str, int] = {}
        for group in groups.values():
            i = min(range(len(self.capacities)), key=lambda j: self.in_flight[j] / self.capacities[j])
            self.in_flight[i] += len(group)
            for r in group:
                target[r.request_id] = i
        if len(target) != len(requests):
            raise ValueError("request ids repeat within one start")
        self._where.update(target)
        shares: list[list[GenRequest]] = [[] for _ in self.capacities]
        for r in requests:
            shares[target[r.request_id]].append(r)
        return shares

    def replica_of(self, request_id: str) -> int | None:
        return self._where.get(request_id)

    def done(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): its slot is free."""
        i = self._where.pop(request_id, None)
        if i is not None:
            self.in_flight[i] -= 1


@dataclass(frozen=True, slots=True)
class RegroupReport:
    from_tp: int
    to_tp: int
    seconds: float = 0.0
    synced: int = 0  # replicas whose weights were brought to the fleet's version
    restarted: bool = False  # the target layout was started anew (restart-on-switch)


class Fleet:
    """The `Engine` protocol over the replicas of the awake layout."""

    def __init__(
        self,
        layouts: Layouts,
        transport: WeightTransport,
        *,
        version: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layouts = layouts
        self.transport = transport
        self.version = version  # the weights every awake replica serves
        self.clock = clock
        stale = self._stale(layouts.awake)
        if stale:
            raise StaleReplicaError(f"replicas {stale} do not serve version {version}")
        self._router = Router([r.max_concurrency for r in layouts.awake.replicas])

    @property
    def tp(self) -> int:
        return self.layouts.awake.tp

    @property
    def replicas(self) -> Sequence[Replica]:
        return self.layouts.awake.replicas

    @property
    def max_concurrency(self) -> int:
        """The awake layout's total: what the loop's bubble accounting measures against."""
        return sum(r.max_concurrency for r in self.replicas)

    def versions(self) -> dict[str, int | None]:
        """The weight version each replica of every layout serves (None: dropped)."""
        return {
            name: r.weight_version
            for layout in self.layouts.all
            for name, r in zip(layout.names, layout.replicas)
        }

    def _stale(self, layout: Layout) -> list[str]:
        return [n for n, r in zip(layout.names, layout.replicas) if r.weight_version != self.version]

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Place `requests`, then add each replica's share with every receiving replica
        paused: on each replica the round's requests start at the same scheduler step."""
        if stale := self._stale(self.layouts.awake):
            raise StaleReplicaError(f"replicas {stale} do not serve version {self.version}")
        shares = self._router.place(requests)
        streams: dict[str, AsyncIterator[GenDelta]] = {}
        try:
            async with contextlib.AsyncExitStack() as paused:
                busy = [(r, share) for r, share in zip(self.replicas, shares) if share]
                for replica, _ in busy:
                    await paused.enter_async_context(replica.paused())
                for replica, share in busy:
                    streams.update(await replica.add(share))
        except BaseException:
            # Nothing was handed out: what did get in must not run on.
            for r in requests:
                if r.request_id in streams:
                    await self.abort(r.request_id)
                self._router.done(r.request_id)
            raise
        return {r.request_id: self._tracked(r.request_id, streams[r.request_id]) for r in requests}

    async def _tracked(self, rid: str, stream: AsyncIterator[GenDelta]) -> AsyncIterator[GenDelta]:
        router = self._router
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for delta in stream:
                    yield delta
        finally:
            router.done(rid)

    async def abort(self, request_id: str) -> None:
        i = self._router.replica_of(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        """Every awake replica serves `version` next; the buckets are read once. Asleep
        layouts are brought up to date when they are woken (`regroup`)."""
        if self._router.busy:
            raise RuntimeError("update_weights with requests in flight")
        await self.transport.push(buckets, self.replicas, version)
        self.version = version

    def take_round_stats(self) -> dict[str, ReplicaStats]:
        """Per replica of the awake layout: what its scheduler saw since the last call."""
        layout = self.layouts.awake
        return {name: r.take_stats() for name, r in zip(layout.names, layout.replicas)}

    async def regroup(
        self, tp: int, weights: Callable[[], AsyncIterable[WeightBucket]]
    ) -> RegroupReport:
        """Between rounds: put the awake layout to sleep, wake the layout of `tp`, bring
        its weights to the fleet's version (from `weights()`, read only if needed), and
        route to it."""
        old = self.tp
        if tp == old:
            return RegroupReport(old, tp)
        if self._router.busy:
            raise RuntimeError(f"regroup to tp {tp} with requests in flight")
        started = self.clock()
        layout, restarted = await self.layouts.switch(tp)
        stale_names = set(self._stale(layout))
        stale = [r for n, r in zip(layout.names, layout.replicas) if n in stale_names]
        if stale:
            await self.transport.push(weights(), stale, self.version)
        self._router = Router([r.max_concurrency for r in layout.replicas])
        return RegroupReport(old, tp, self.clock() - started, len(stale), restarted)

    async def shutdown(self) -> None:
        await self.layouts.shutdown()

