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
  between rounds to another layout (`rpk.engine.layouts`); lends replicas to the
  trainer mid-round (`lend`: their requests move, with the tokens they have, to the
  others) and takes them back after it (`reclaim`), for the borrowing stream trainer.

Replicas are `VLLMEngine`s on devices (`rpk.engine.vllm_fleet`) or `SimEngine`s on
virtual time (`rpk.sim.fleet`); both satisfy `rpk.engine.replica.Replica`. How weights
reach them is a `WeightTransport`, chosen by the builder.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.modes import RestLevel
from rpk.core.outcomes import MigrationReport, RegroupReport
from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.engine.layouts import Layout, Layouts
from rpk.engine.replica import Replica
from rpk.sched.borrow import place_moves
from rpk.sync.protocols import WeightTransport

# Affinity keys remembered before the map starts afresh: a few rounds of trajectories.
_AFFINITY_KEYS = 1 << 16


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
        self._affine: dict[str, int] = {}  # affinity key -> the replica it went to last

    @property
    def busy(self) -> bool:
        return bool(self._where)

    def place(
        self, requests: Sequence[GenRequest], barred: Sequence[int] = ()
    ) -> list[list[GenRequest]]:
        """Each replica's share of `requests`, in their order. A prompt's requests (same
        prompt tokens) stay together; a request with an affinity key goes where the key
        went last (a trajectory's next turn, whose context that replica has cached);
        other prompts go, in order of first appearance, to the replica with the least
        load (in flight / capacity), the lowest index on a tie. No request goes to a
        `barred` replica (one lent to the trainer)."""
        open_ = [j for j in range(len(self.capacities)) if j not in barred]
        if not open_:
            raise ValueError(f"every replica is barred ({list(barred)})")
        groups: dict[tuple[int, ...], list[GenRequest]] = {}
        for r in requests:
            if r.request_id in self._where:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            groups.setdefault(r.prompt_token_ids, []).append(r)
        target: dict[str, int] = {}
        for group in groups.values():
            i = self._affine.get(group[0].affinity, -1) if group[0].affinity else -1
            if i not in open_:
                i = min(open_, key=lambda j: self.in_flight[j] / self.capacities[j])
            self.in_flight[i] += len(group)
            for r in group:
                target[r.request_id] = i
        if len(target) != len(requests):
            raise ValueError("request ids repeat within one start")
        self._where.update(target)
        if len(self._affine) > _AFFINITY_KEYS:
            self._affine.clear()  # a cache: forgetting costs a prefill, never a result
        self._affine.update((r.affinity, target[r.request_id]) for r in requests if r.affinity)
        shares: list[list[GenRequest]] = [[] for _ in self.capacities]
        for r in requests:
            shares[target[r.request_id]].append(r)
        return shares

    def in_flight_ids(self) -> dict[str, int]:
        """Each request in flight and its replica."""
        return dict(self._where)

    def replica_of(self, request_id: str) -> int | None:
        return self._where.get(request_id)

    def move(self, request_id: str, to: int) -> None:
        """The request now runs on replica `to`."""
        i = self._where[request_id]
        self.in_flight[i] -= 1
        self.in_flight[to] += 1
        self._where[request_id] = to

    def done(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): its slot is free."""
        i = self._where.pop(request_id, None)
        if i is not None:
            self.in_flight[i] -= 1


@dataclass(slots=True, eq=False)
class _Live:
    """One request the fleet handed out: the tokens it has generated so far (every
    delta passes through `Fleet._tracked`; their log-probs went on to the loop with
    them), where it runs, and a move under way."""

    request: GenRequest  # as the loop started it
    replica: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    move_to: int | None = None
    settled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    started: bool = False  # its stream was iterated: its `finally` will free the slot
    adding: asyncio.Task[Mapping[str, AsyncIterator[GenDelta]]] | None = None  # the continuation

    def continuation(self) -> GenRequest:
        """The rest of the response, on another replica: the prompt followed by the
        tokens so far (their KV recomputed there), the length budget less them, the
        same seed and sampling. Same weights on every replica, so the continuation is
        still sampled from the policy being trained; a greedy request continues with
        exactly the tokens it would have produced where it was."""
        r = self.request
        return dataclasses.replace(
            r, prompt_token_ids=r.prompt_token_ids + tuple(self.tokens),
            max_tokens=r.max_tokens - len(self.tokens),
        )


@dataclass(frozen=True, slots=True)
class Rest:
    """Colocation (`rpk.assembly.box.colocation`, `rpk.loop.step`'s rests): rollout and
    training share the devices, so the
    awake layout sleeps at vLLM's sleep `level` while the trainer trains, and the next
    weight sync wakes it in two parts around `before_kv` (the trainer moving its state
    out)."""

    level: RestLevel
    before_kv: Callable[[], Awaitable[None]]


class Fleet:
    """The `Engine` protocol over the replicas of the awake layout; `rest`: how it shares
    its devices with the trainer (None: it does not)."""

    def __init__(
        self,
        layouts: Layouts,
        transport: WeightTransport,
        *,
        version: int,
        clock: Callable[[], float] = time.monotonic,
        rest: Rest | None = None,
    ) -> None:
        self.layouts = layouts
        self.transport = transport
        self.version = version  # the weights every awake replica serves
        self.clock = clock
        stale = self._stale(layouts.awake)
        if stale:
            raise StaleReplicaError(f"replicas {stale} do not serve version {version}")
        self._router = Router([r.max_concurrency for r in layouts.awake.replicas])
        self._live: dict[str, _Live] = {}
        self.lent: tuple[int, ...] = ()  # asleep for the trainer until `reclaim`
        self.rest_level = rest.level if rest is not None else None
        self.resting: RestLevel | None = None  # the sleep level while resting
        self.before_kv = rest.before_kv if rest is not None else None

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

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per replica of the awake layout."""
        return tuple(self._router.in_flight)

    def replica_names(self, indices: Sequence[int]) -> list[str]:
        names = self.layouts.awake.names
        return [names[i] for i in indices]

    def versions(self) -> dict[str, int | None]:
        """The weight version each replica of every layout serves (None: dropped)."""
        return {
            name: r.weight_version
            for layout in self.layouts.all
            for name, r in zip(layout.names, layout.replicas)
        }

    def _stale(self, layout: Layout, skip: Sequence[int] = ()) -> list[str]:
        return [
            n for i, (n, r) in enumerate(zip(layout.names, layout.replicas))
            if i not in skip and r.weight_version != self.version
        ]

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Place `requests`, then add each replica's share with every receiving replica
        paused: on each replica the round's requests start at the same scheduler step."""
        if self.resting is not None:
            raise RuntimeError("start while the replicas rest for the trainer; sync or wake them first")
        if stale := self._stale(self.layouts.awake, skip=self.lent):
            raise StaleReplicaError(f"replicas {stale} do not serve version {self.version}")
        # Mid-round (a trajectory's next turn) the lent replicas sleep for the trainer.
        shares = self._router.place(requests, barred=self._barred())
        streams: dict[str, AsyncIterator[GenDelta]] = {}
        try:
            async with contextlib.AsyncExitStack() as paused:
                busy = [(r, share) for r, share in zip(self.replicas, shares) if share]
                # One request has nothing to start together with: pausing would only
                # stall the replica's other requests.
                for replica, _ in busy if len(requests) > 1 else ():
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
        out = {}
        for i, share in enumerate(shares):
            for r in share:
                live = self._live[r.request_id] = _Live(r, i)
                out[r.request_id] = self._tracked(live, streams[r.request_id])
        return {r.request_id: out[r.request_id] for r in requests}

    async def _tracked(self, live: _Live, stream: AsyncIterator[GenDelta]) -> AsyncIterator[GenDelta]:
        """The request's deltas, as the loop sees them. A request moved by `lend` ends
        where it was with an abort carrying its last tokens: those go on as an ordinary
        delta and the stream continues from the continuation, so the consumer sees one
        uninterrupted response (no token lost, none twice)."""
        router, rid = self._router, live.request.request_id
        finished = moved = False
        live.started = True
        try:
            handoff: GenDelta | None = None
            while True:
                async with contextlib.aclosing(stream):  # type: ignore[type-var]
                    if handoff is not None and handoff.token_ids:
                        yield handoff
                    handoff = None
                    async for delta in stream:
                        live.tokens.extend(delta.token_ids)
                        if live.move_to is not None and delta.finish_reason is FinishReason.ABORT:
                            handoff = dataclasses.replace(delta, finished=False, finish_reason=None)
                            break
                        yield delta
                        if delta.finished:
                            finished = True
                            return
                if handoff is None:
                    return
                moved = True
                stream = await self._resume(live)
        finally:
            # Bookkeeping first: a consumer cancelled again while the abort below is
            # awaited must not leave the request counted in flight.
            live.settled.set()
            self._live.pop(rid, None)
            router.done(rid)
            if moved and not finished:
                # Closed before its continuation's stream ran (which aborts it on
                # closing), or while it was being added: it must not run on.
                await asyncio.shield(self._abort_continuation(live))

    async def _resume(self, live: _Live) -> AsyncIterator[GenDelta]:
        to, live.move_to = live.move_to, None
        assert to is not None
        rid = live.request.request_id
        self._router.move(rid, to)
        live.replica = to
        # Its own task, so that a cancelled consumer cannot cut an add half-way and
        # leave a request the replica runs but nobody aborts.
        live.adding = asyncio.create_task(
            self.replicas[to].add([live.continuation()]), name=f"continue:{rid}"
        )
        streams = await asyncio.shield(live.adding)
        live.settled.set()
        return streams[rid]

    async def _abort_continuation(self, live: _Live) -> None:
        if live.adding is not None:
            await asyncio.wait([live.adding])
        await self.replicas[live.replica].abort(live.request.request_id)

    async def lend(self, indices: Sequence[int]) -> MigrationReport:
        """Mid-round: move every request of the replicas `indices` to the other awake
        replicas (`rpk.sched.borrow.place_moves`), then put those replicas to sleep, so
        their devices can train. Each request is aborted where it ran; `_tracked` starts
        its continuation on the target as soon as the abort reports its last tokens."""
        lent = tuple(sorted(set(indices)))
        n = len(self.replicas)
        if self.lent or not lent or len(lent) >= n or not all(0 <= i < n for i in lent):
            raise ValueError(
                f"cannot lend replicas {list(indices)} of {n} (already lent: {list(self.lent)})"
            )
        started = self.clock()
        kept = [i for i in range(n) if i not in lent]
        self.lent = lent
        count, tokens = await self._move(lent, kept)
        moved = self.clock()
        await asyncio.gather(*(self.replicas[i].sleep() for i in lent))
        return MigrationReport(lent, count, tokens, self.clock() - started, moved - started)

    async def _move(self, sources: Sequence[int], kept: Sequence[int],
                    only: Collection[str] | None = None) -> tuple[int, int]:
        """Every request of the replicas `sources` (those of `only`, if given) to the
        replicas `kept` (`rpk.sched.borrow.place_moves`), each aborted where it ran and
        continued with its tokens there; (requests, tokens) moved."""
        moving = [live for rid, live in self._live.items() if live.replica in sources
                  and (only is None or (rid in only and live.move_to is None))]
        target = place_moves(
            [(m.request.request_id, m.request.prompt_token_ids) for m in moving], kept,
            {i: self._router.in_flight[i] for i in kept},
            {i: self._router.capacities[i] for i in kept},
        )
        for m in moving:
            m.settled.clear()
            m.move_to = target[m.request.request_id]
        await asyncio.gather(*(self.replicas[m.replica].abort(m.request.request_id) for m in moving))
        await asyncio.gather(*(m.settled.wait() for m in moving))
        return len(moving), sum(len(m.tokens) for m in moving)

    async def reclaim(self) -> None:
        """After the round: wake the lent replicas. Their weights were dropped, so the
        next `update_weights` must reach them before a round starts (`start` refuses a
        stale replica). Resting (colocated), they stay asleep until the weight sync."""
        lent, self.lent = self.lent, ()
        if self.resting is None:
            await asyncio.gather(*(self.replicas[i].wake() for i in lent))

    async def rest(self, level: RestLevel) -> None:
        """Colocated, after the round: every replica of the awake layout sleeps (the lent
        ones already do) so that the trainer has the devices. Level 1 keeps the weights
        on host, level 2 drops them (the next sync replaces them anyway)."""
        if self._router.busy:
            raise RuntimeError(f"rest with requests in flight ({self._router.in_flight_ids()})")
        asleep = set(self.lent)
        self.lent = ()
        await asyncio.gather(*(r.sleep(level) for i, r in enumerate(self.replicas) if i not in asleep))
        if asleep and not level.drops_weights:
            # The lent replicas dropped their weights: they need the sync too.
            self.resting = RestLevel.DROP_WEIGHTS
        else:
            self.resting = level

    async def _rise(self, replicas: Sequence[Replica], buckets: AsyncIterable[WeightBucket] | None,
                    version: int) -> None:
        """Out of rest: the weights wake first and are synced, then the trainer's state
        leaves (`before_kv`), then the KV cache wakes into the memory it freed."""
        await asyncio.gather(*(r.wake(["weights"]) for r in replicas))
        if buckets is not None:
            await self.transport.push(buckets, replicas, version)
        if self.before_kv is not None:
            await self.before_kv()
        await asyncio.gather(*(r.wake(["kv_cache"]) for r in replicas))
        self.resting = None

    async def wake_from_rest(self) -> None:
        """A step without a weight update after a level-1 rest: the weights were kept."""
        if self.resting is None:
            return
        if self.resting.drops_weights:
            raise StaleReplicaError("replicas rested at level 2 dropped their weights: sync them")
        await self._rise(self.replicas, None, self.version)

    async def abort(self, request_id: str) -> None:
        i = self._router.replica_of(request_id)
        live = self._live.get(request_id)
        if live is not None and not live.started:
            # A stream nobody iterated never runs its `finally` (a task cancelled before
            # its first step): without this its slot stays taken and the next weight
            # sync refuses, "requests in flight".
            live.settled.set()
            del self._live[request_id]
            self._router.done(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        """Every awake replica serves `version` next; the buckets are read once. Asleep
        layouts are brought up to date when they are woken (`regroup`)."""
        if self._router.busy or self.lent:
            raise RuntimeError(
                f"update_weights with requests in flight ({self._router.in_flight_ids()}) or "
                f"replicas lent ({list(self.lent)})"
            )
        if self.resting is not None:
            await self._rise(self.replicas, buckets, version)
        else:
            await self.transport.push(buckets, self.replicas, version)
        self.version = version

    # -- speculative decoding (`rpk.loop.speculate`) ---------------------------------
    # A replica with speculative decoding pays for it every step, drafts or not (vLLM
    # verifies through its rejection sampler whenever speculation is configured). With
    # speculating twins (`rpk.engine.vllm_fleet`), a round runs on the plain replicas
    # and only rows of its tail, once small, are handed over to the twins
    # (`rpk.sched.handover` decides which).

    def _kinds(self) -> tuple[list[int], list[int]]:
        """(plain, speculating) replicas of the awake layout, by index."""
        plain: list[int] = []
        spec: list[int] = []
        for i, r in enumerate(self.replicas):
            # A replica that does not say (a test's, the simulator's) runs none.
            (spec if getattr(r, "speculates", False) else plain).append(i)
        return plain, spec

    def _barred(self) -> tuple[int, ...]:
        """Where no request goes: the lent replicas, and with twins the twins: a request
        gets there only by a hand-over (a trajectory's next turn starts plain too)."""
        plain, spec = self._kinds()
        if not (plain and spec):
            return self.lent
        return tuple(sorted({*self.lent, *spec}))

    def tail_rows(self, at: int) -> dict[str, tuple[int, ...]] | None:
        """With twins: each request in flight on the plain replicas (not already
        moving) and its prompt tokens, or none while more than `at` run there (asked at
        every finish: the count is O(replicas)); None without twins."""
        plain, spec = self._kinds()
        if not (plain and spec):
            return None
        if sum(self._router.in_flight[i] for i in plain) > at:
            return {}
        return {rid: live.request.prompt_token_ids for rid, live in self._live.items()
                if live.replica in plain and live.move_to is None}

    async def hand_over(self, request_ids: Collection[str]) -> MigrationReport:
        """Mid-round: the requests `request_ids` of the plain replicas move, with their
        tokens, to the speculating twins, which decode them with drafts; the others
        stay. Any number of times a round."""
        plain, spec = self._kinds()
        if not (plain and spec):
            return MigrationReport(())
        started = self.clock()
        count, tokens = await self._move([i for i in plain if i not in self.lent],
                                         [i for i in spec if i not in self.lent], set(request_ids))
        took = self.clock() - started
        return MigrationReport(tuple(plain), count, tokens, took, took)

    def draft_targets(self) -> dict[str, int]:
        """The replicas that draft in a round (awake, not lent; the twins, with twins)
        and their concurrency."""
        layout = self.layouts.awake
        plain, spec = self._kinds()
        drafting = spec if plain and spec else range(len(layout.replicas))
        return {layout.names[i]: layout.replicas[i].max_concurrency for i in drafting if i not in self.lent}

    async def set_drafts(self, schedules: Mapping[str, Sequence[tuple[int, int, int]]],
                         sources: Sequence[DraftSource], prompts: Sequence[PromptDrafts]) -> None:
        """Each replica of `schedules` its schedule, and every one the round's drafts:
        a prompt's requests all go to one replica, but which is decided at `start`."""
        layout = self.layouts.awake
        await asyncio.gather(*(r.set_drafts(schedules[n], sources, prompts)
                               for n, r in zip(layout.names, layout.replicas) if n in schedules))

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        await asyncio.gather(*(self.replicas[i].add_drafts(prompts) for i in range(len(self.replicas))
                               if i not in self.lent))

    async def take_spec_stats(self) -> dict[str, SpecStats]:
        """Per replica of the awake layout: its speculative decoding since the last call."""
        layout = self.layouts.awake
        got = await asyncio.gather(*(r.take_spec_stats() for r in layout.replicas))
        return dict(zip(layout.names, got))

    def take_round_stats(self) -> dict[str, ReplicaStats]:
        """Per replica of the awake layout: what its scheduler saw since the last call."""
        layout = self.layouts.awake
        return {name: r.take_stats() for name, r in zip(layout.names, layout.replicas)}

    async def regroup(
        self, tp: int, weights: Callable[[], AsyncIterable[WeightBucket]],
        version: int | None = None,
    ) -> RegroupReport:
        """Between rounds: put the awake layout to sleep, wake the layout of `tp`, bring
        its weights to the fleet's version (from `weights()`, read only if needed), and
        route to it. With `version`, `weights()` are that newer version and the fleet
        serves it next: the weight sync of a step goes straight into the next round's
        layout, and the layout put to sleep is not loaded with weights it drops."""
        old = self.tp
        if tp == old:
            return RegroupReport(old, tp)
        if self._router.busy or self.lent:
            raise RuntimeError(f"regroup to tp {tp} with requests in flight or replicas lent")
        started = self.clock()
        if version is not None:
            self.version = version
        resting = self.resting is not None
        layout, restarted = await self.layouts.switch(tp, wake=not resting)
        stale_names = set(self._stale(layout))
        stale = [r for n, r in zip(layout.names, layout.replicas) if n in stale_names]
        if resting:
            # Colocated: the target wakes in two parts around its sync.
            await self._rise(layout.replicas, weights() if stale else None, self.version)
        elif stale:
            await self.transport.push(weights(), stale, self.version)
        self._router = Router([r.max_concurrency for r in layout.replicas])
        return RegroupReport(old, tp, self.clock() - started, len(stale), restarted)

    async def shutdown(self) -> None:
        # A transport's groups end first, while their replicas still answer.
        try:
            await self.transport.close()
        finally:
            await self.layouts.shutdown()

