"""A continuous-batching rollout engine on virtual time, to drive `rpk.loop` unchanged.

Cost model. A decode step of a continuous-batching engine (vLLM) produces one token for
every running sequence. On a GPU it is memory bound: the weights are read once per step
whatever the batch, so its time is nearly flat in the batch size,
`step_s(batch) = base_s + per_seq_s * batch`, with `base_s` dominating. At most
`max_concurrency` sequences run; the others wait FIFO for a free slot. An admitted
sequence adds `prefill_s` to its first step; a weight update stalls for `sync_s`.
Response lengths come from `length_of(request)`, capped by the request's `max_tokens`.

Why virtual time. The questions the scheduler answers (how long a round waits for its
longest response, how much of the engine idles meanwhile, whether tail batching pays)
depend on the shape of the length distribution and of the cost curve, not on a model's
weights. On virtual time a round of hundreds of requests of hundreds of tokens runs in a
fraction of a real second and reproduces exactly, so tests can assert timings and bubble
ratios, and benchmarks can sweep policies, all through the real `run_round`/`run_step`.

How it runs. One owned task steps the engine. Before each step it lets the event loop
drain, so every consumer's reaction to the last step (scoring, cancelling siblings,
aborts, new requests) lands first, as if instantaneous. Between such decision points
nothing can change the batch, so the engine jumps across steps in O(1): to the next step
where a sequence finishes, a delta is due (every `chunk` steps) or a clock sleeper wakes.
The trajectory is the one of stepping one token at a time, only reported more coarsely.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator, Callable, Sequence

from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest

# Virtual times are sums of float step times: deadlines are met within this slack.
_EPS = 1e-9


class SimEngineError(RuntimeError):
    """A simulated failure of one request (`fail_after`), or the engine shut down."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Virtual seconds per engine operation. The defaults resemble a 7B model decoding
    on one H100-class GPU: ~15 ms per step, growing slowly with the batch."""

    base_s: float = 0.015  # per decode step: reading the weights
    per_seq_s: float = 5e-5  # per running sequence in that step: its KV cache, sampling
    prefill_s: float = 0.0  # once per admitted sequence, in its first step
    sync_s: float = 0.0  # per weight update

    def __post_init__(self) -> None:
        costs = {f: getattr(self, f) for f in ("base_s", "per_seq_s", "prefill_s", "sync_s")}
        negative = {f: v for f, v in costs.items() if not v >= 0}
        if negative:
            raise ValueError(f"CostModel costs must be >= 0, got {negative}")
        if self.base_s + self.per_seq_s <= 0:
            raise ValueError(
                f"a decode step must take time: base_s ({self.base_s}) + per_seq_s "
                f"({self.per_seq_s}) is 0"
            )

    def step_s(self, batch: int) -> float:
        return self.base_s + self.per_seq_s * batch


class VirtualClock:
    """Simulated seconds, moved only by the engine that owns it (one engine per clock).
    Pass `clock.now` (or the clock itself) as `clock=` to run_round/run_step."""

    def __init__(self) -> None:
        self._now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        if not dt >= 0:
            raise ValueError(f"virtual time only moves forward, got dt={dt}")
        self._now += dt
        while self._sleepers and self._sleepers[0][0] <= self._now + _EPS:
            fut = heapq.heappop(self._sleepers)[2]
            if not fut.done():
                fut.set_result(None)

    def next_deadline(self) -> float | None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)  # a sleeper that was cancelled
        return self._sleepers[0][0] if self._sleepers else None

    async def sleep_until(self, t: float) -> None:
        """Wake when virtual time reaches `t`. Time moves only while the engine decodes:
        with nothing to decode, a sleeper waits until something is."""
        if t <= self._now + _EPS:
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (t, next(self._order), fut))
        await fut


@dataclass(slots=True, eq=False)
class _Seq:
    request: GenRequest
    stop: int  # tokens produced when it finishes (or fails)
    reason: FinishReason | None  # None: the request fails when it gets there
    outbox: asyncio.Queue[GenDelta | BaseException]
    produced: int = 0
    sent: int = 0


class SimEngine:
    """The Engine protocol on virtual time; see the module docstring for the model.

    `length_of(request)` is the response length the request would reach (at least 1);
    `fail_after(request)`, when given, makes a request fail after that many tokens (None:
    it does not). Deltas carry the tokens new since the last one: every `chunk` steps,
    and on finishing. `settle_turns` bounds the event-loop turns the engine lets consumers
    react before its next step; where the loop's ready queue is not visible (uvloop) it
    always waits that many."""

    def __init__(
        self,
        length_of: Callable[[GenRequest], int],
        *,
        cost: CostModel = CostModel(),
        max_concurrency: int = 256,
        chunk: int = 16,
        logprob: float = -0.5,
        fail_after: Callable[[GenRequest], int | None] | None = None,
        settle_turns: int = 64,
    ) -> None:
        counts = {"max_concurrency": max_concurrency, "chunk": chunk, "settle_turns": settle_turns}
        bad = {k: v for k, v in counts.items() if v < 1}
        if bad:
            raise ValueError(f"SimEngine needs positive values, got {bad}")
        self.length_of = length_of
        self.fail_after = fail_after
        self.cost = cost
        self.chunk = chunk
        self.logprob = logprob
        self.settle_turns = settle_turns
        self._max_concurrency = max_concurrency
        self.clock = VirtualClock()
        self._running: dict[str, _Seq] = {}  # insertion order: admission order
        self._waiting: dict[str, _Seq] = {}  # insertion order: FIFO
        self._fresh = 0  # admitted since the last step: they pay prefill in the next one
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # What happened, for tests and benchmarks.
        self.seen: list[str] = []
        self.aborted: list[str] = []
        self.failed: list[str] = []
        self.admitted_at: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.steps = 0
        self.tokens_generated = 0
        self.decode_s = 0.0
        self.peak_running = 0
        self.weights_version = 0
        self.weight_updates: list[tuple[float, int]] = []  # (virtual time, version)

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @property
    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(self._waiting)

    @property
    def loop_running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Queue every request now, in order (admission is FIFO); a stream each."""
        return {r.request_id: self._stream(self._submit(r)) for r in requests}

    async def _stream(self, seq: _Seq) -> AsyncIterator[GenDelta]:
        try:
            while True:
                item = await seq.outbox.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # The consumer left (cancelled, closed the stream): free the slot at once, as
            # vLLM does when a client disconnects.
            self._forget(seq)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        seq = self._drop(request_id)
        if seq is not None:
            self._emit(seq, finished=True, reason=FinishReason.ABORT)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        async for _ in buckets:
            pass
        self.weight_updates.append((self.clock.now(), version))
        self.weights_version = version
        self.clock.advance(self.cost.sync_s)

    async def shutdown(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            raise SimEngineError("the engine loop had failed") from task.exception()

    def _submit(self, request: GenRequest) -> _Seq:
        rid = request.request_id
        if self._closed:
            raise SimEngineError(f"request {rid}: the engine is shut down")
        if rid in self._running or rid in self._waiting:
            raise ValueError(f"request id {rid!r} is already in the engine")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens is {request.max_tokens}, must be >= 1")
        length = self.length_of(request)
        if length < 1:
            raise ValueError(f"length_of({rid!r}) is {length}: a response has at least one token")
        stop = min(length, request.max_tokens)
        reason: FinishReason | None = (
            FinishReason.LENGTH if length >= request.max_tokens else FinishReason.STOP
        )
        fail = self.fail_after(request) if self.fail_after else None
        if fail is not None:
            if fail < 1:
                raise ValueError(f"fail_after({rid!r}) is {fail}, must be >= 1 or None")
            if fail <= stop:
                stop, reason = fail, None
        self._ensure_loop()
        seq = _Seq(request, stop, reason, asyncio.Queue())
        self._waiting[rid] = seq
        self.seen.append(rid)
        self._wake.set()
        return seq

    def _ensure_loop(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        elif self._task.done():
            raise SimEngineError("the engine loop has failed") from self._task.exception()

    def _drop(self, rid: str) -> _Seq | None:
        return self._running.pop(rid, None) or self._waiting.pop(rid, None)

    def _forget(self, seq: _Seq) -> None:
        # By identity: a stream finalised late must not drop a newer request of its id.
        rid = seq.request.request_id
        for table in (self._running, self._waiting):
            if table.get(rid) is seq:
                del table[rid]

    def _emit(self, seq: _Seq, *, finished: bool, reason: FinishReason | None) -> None:
        start, seq.sent = seq.sent, seq.produced
        n = seq.produced - start
        seq.outbox.put_nowait(
            GenDelta(
                seq.request.request_id,
                tuple(range(start, seq.produced)),
                (self.logprob,) * n,
                finished=finished,
                finish_reason=reason,
            )
        )

    async def _run(self) -> None:
        try:
            while True:
                await self._settle()
                self._admit()
                if self._running:
                    self._step()
                    continue
                self._wake.clear()
                await self._wake.wait()
        except BaseException as exc:
            # Shut down or broken: no consumer may wait forever for its next delta.
            shut = isinstance(exc, asyncio.CancelledError)
            why = "the engine shut down" if shut else "the engine loop failed"
            for seq in [*self._running.values(), *self._waiting.values()]:
                err = SimEngineError(f"request {seq.request.request_id}: {why}")
                err.__cause__ = None if shut else exc
                seq.outbox.put_nowait(err)
            self._running.clear()
            self._waiting.clear()
            raise

    async def _settle(self) -> None:
        """Yield until every other ready callback has run: the consumers have taken their
        deltas and acted on them. asyncio's ready queue is the only place that tells
        whether anything else is runnable; it is not public, hence the getattr."""
        ready = getattr(asyncio.get_running_loop(), "_ready", None)
        for _ in range(self.settle_turns):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                return

    def _admit(self) -> None:
        now = self.clock.now()
        while self._waiting and len(self._running) < self._max_concurrency:
            rid = next(iter(self._waiting))
            self._running[rid] = self._waiting.pop(rid)
            self.admitted_at[rid] = now
            self._fresh += 1
        self.peak_running = max(self.peak_running, len(self._running))

    def _step(self) -> None:
        """Advance to the next step where something is due, and deliver what is."""
        n = len(self._running)
        dt = self.cost.step_s(n)
        first = dt + self.cost.prefill_s * self._fresh
        k = min(s.stop - s.produced for s in self._running.values())
        k = min(k, self.chunk - self.steps % self.chunk)
        deadline = self.clock.next_deadline()
        if deadline is not None:
            remaining = deadline - self.clock.now()
            if remaining <= first + _EPS:
                k = 1
            else:
                k = min(k, 1 + math.ceil((remaining - first) / dt - _EPS))
        elapsed = first + (k - 1) * dt
        self._fresh = 0
        self.steps += k
        self.tokens_generated += k * n
        self.decode_s += elapsed
        self.clock.advance(elapsed)
        now = self.clock.now()
        due = self.steps % self.chunk == 0
        for rid, seq in list(self._running.items()):
            seq.produced += k
            if seq.produced >= seq.stop:
                del self._running[rid]
                if seq.reason is None:
                    self.failed.append(rid)
                    why = f"request {rid}: simulated failure after {seq.produced} tokens"
                    seq.outbox.put_nowait(SimEngineError(why))
                else:
                    self.finished_at[rid] = now
                    self._emit(seq, finished=True, reason=seq.reason)
            elif due:
                self._emit(seq, finished=False, reason=None)
