"""A continuous-batching rollout engine on virtual time, to drive `rpk.loop` unchanged.

Cost model. A decode step of a continuous-batching engine (vLLM) produces one token for
every running sequence. On a GPU it is memory bound: the weights are read once per step
whatever the batch, so its time is nearly flat in the batch size,
`step_s(batch) = base_s + per_seq_s * batch`, with `base_s` dominating. At most
`max_concurrency` sequences run; the others wait FIFO for a free slot. An admitted
sequence adds `prefill_s` (and `prefill_token_s` per token it brings) to its first step;
a weight update stalls for `sync_s`. Response lengths come from `length_of(request)`,
capped by the request's `max_tokens`.

KV memory and tensor parallelism (`rpk.sim.cost`). With `kv_tokens` set, a replica holds
that many tokens of KV cache per device; every running sequence holds its prompt and the
tokens it produced. When the next step does not fit, the replica preempts its most
recently admitted sequences, as vLLM does: they go back to the front of the queue, keep
their tokens, and pay the recomputation of all of them (prefill) when re-admitted. A
replica of `tp` devices divides its step by `tp`, pays `tp_comm_s` per extra device per
step, and holds more KV (its weights are spread over more devices).

Replicas share a `SimNode` (`rpk.sim.node`): one virtual clock and one stepping task;
how it moves the clock and when a replica jumps across steps is told there.

Why virtual time. The questions the scheduler answers (how long a round waits for its
longest response, how much of the engine idles meanwhile, whether tail batching pays)
depend on the shape of the length distribution and of the cost curve, not on a model's
weights. On virtual time a round of hundreds of requests of hundreds of tokens runs in a
fraction of a real second and reproduces exactly, so tests can assert timings and bubble
ratios, and benchmarks can sweep policies, all through the real `run_round`/`run_step`.

Speculative decoding (`spec`, `rpk.sim.spec`). A replica given a `SimSpec` takes the
draft plan and texts the speculative tail hands every replica (`set_drafts`,
`add_drafts`): each step, its rows with a text to draft from verify the k drafts the
plan gives the live batch size, a step costs `CostModel.verify_s` over the tokens it
runs, and each row gains its accepted drafts (drawn from the acceptance model) and one
token more. It reports what a vLLM replica does: the speculation counters, its steps'
seconds against their tokens, each finished request's accepted drafts, the partial
responses of the requests it aborted. Without a `SimSpec` drafts change nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.modes import RestLevel
from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.engine.vllm_stats import ReplicaCounters
from rpk.sim.cost import EPS, CostModel
from rpk.sim.node import SimEngineError, SimNode
from rpk.sim.spec import SimDrafts, SimSpec, Verifies, step_fit


@dataclass(slots=True, eq=False)
class _Seq:
    request: GenRequest
    stop: int  # tokens produced when it finishes (or fails)
    reason: FinishReason | None  # None: the request fails when it gets there
    outbox: asyncio.Queue[GenDelta | BaseException]
    produced: int = 0
    sent: int = 0
    preemptions: int = 0
    accepted: int = 0  # drafted tokens it accepted (speculative decoding)
    texts: set[DraftSource] | None = None  # its prompt's draft texts, as of `texts_epoch`
    texts_epoch: int = -1
    draft: DraftSource | None = None  # the source it drafts from, as of `texts_epoch`

    @property
    def kv(self) -> int:
        """KV-cache tokens it holds while running (and recomputes on re-admission)."""
        return len(self.request.prompt_token_ids) + self.produced


@dataclass(frozen=True, slots=True)
class _Jump:
    """`k` steps of a batch of `n` from `start`: the first takes `first` (prefill
    included), the others `dt` each. Under speculative decoding, `verifies` holds what
    each row's drafts gained over them; `x` and `first_x` are the tokens a step runs."""

    start: float
    first: float
    dt: float
    k: int
    n: int
    verifies: Verifies | None = None
    x: float = 0.0
    first_x: float = 0.0

    @property
    def end(self) -> float:
        return self.start + self.first + (self.k - 1) * self.dt

    def steps_done(self, now: float) -> int:
        """Whole steps completed by `now` (fewer than `k`: the last one ends the jump)."""
        if now < self.start + self.first - EPS:
            return 0
        return min(self.k - 1, 1 + math.floor((now - self.start - self.first) / self.dt + EPS))


class SimEngine:
    """The Engine protocol on virtual time, and a replica of a rollout fleet (pause,
    add, sleep, wake, per-round statistics); see the module docstring for the model.

    `length_of(request)` is the response length the request would reach (at least 1);
    `fail_after(request)`, when given, makes a request fail after that many tokens (None:
    it does not). Deltas carry the tokens new since the last one: every `chunk` steps,
    and on finishing. `tp` is the replica's device count. `node`: the node it decodes on
    (one of its own when None, with `settle_turns`)."""

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
        tp: int = 1,
        node: SimNode | None = None,
        call_latency_s: float = 0.0,
        spec: SimSpec | None = None,
    ) -> None:
        counts = {"max_concurrency": max_concurrency, "chunk": chunk, "tp": tp}
        bad = {k: v for k, v in counts.items() if v < 1}
        if bad:
            raise ValueError(f"SimEngine needs positive values, got {bad}")
        if not call_latency_s >= 0:
            raise ValueError(f"SimEngine call_latency_s must be >= 0, got {call_latency_s!r}")
        self.call_latency_s = call_latency_s
        self.length_of = length_of
        self.fail_after = fail_after
        self.cost = cost
        self.chunk = chunk
        self.logprob = logprob
        self.tp = tp
        self.kv_capacity = cost.kv_capacity(tp)
        self._max_concurrency = max_concurrency
        self.node = node if node is not None else SimNode(settle_turns)
        self.node._attach(self)
        self.clock = self.node.clock
        self._running: dict[str, _Seq] = {}  # insertion order: admission order
        self._waiting: dict[str, _Seq] = {}  # insertion order: FIFO
        self._jump: _Jump | None = None  # the steps under way; None: to be scheduled
        self._fresh = 0  # admitted since the last step: they pay prefill in the next one
        self._fresh_tokens = 0
        self._kv = 0  # KV-cache tokens held by the running sequences
        self.closed = False
        self.asleep = False
        # What happened, for tests and benchmarks.
        self.lifecycle: list[str] = []  # sleep1/sleep2/wake/wake:TAGS, in order
        self.seen: list[str] = []
        self.aborted: list[str] = []
        self.failed: list[str] = []
        self.admitted_at: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.steps = 0
        self.decode_s = 0.0
        self.peak_running = 0
        self.weight_version: int | None = 0
        self.weight_updates: list[tuple[float, int]] = []  # (virtual time, version)
        # preemptions, tokens and the KV peak, kept as a vLLM replica's are
        self.counters = ReplicaCounters()
        self.drafts = SimDrafts(spec) if spec is not None else None
        # Without a SimSpec: one token a step, no drafts and none of their cost.
        self.speculates = spec is not None

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
        return self.node.running

    @property
    def kv_used(self) -> int:
        return self._kv

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Queue every request now, in order (admission is FIFO); a stream each. They
        start together: the node decides only once the caller yields."""
        return {r.request_id: self._stream(self._submit(r)) for r in requests}

    async def add(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """As a fleet replica: `start`, after the host's round trip."""
        await self._round_trip()
        return await self.start(requests)

    async def _round_trip(self) -> None:
        if self.call_latency_s and self.node.running:
            await self.node.sleep_until(self.clock.now() + self.call_latency_s)

    def set_cost(self, cost: CostModel) -> None:
        """Decode at another cost from now on (the simulated trainer sharing the
        devices slows the steps): the steps done so far are kept."""
        self._touch()
        self.cost = cost
        self.node._poke()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """A fleet replica's pause around adding a round: nothing to do on virtual time."""
        yield

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
        await self._round_trip()
        self.aborted.append(request_id)
        seq = self._drop(request_id)
        if seq is not None:
            self._keep_cut(seq)
            self._emit(seq, finished=True, reason=FinishReason.ABORT)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        async for _ in buckets:
            pass
        await self.load_weights(version)

    async def load_weights(self, version: int) -> None:
        """Serve `version` from now on, after `sync_s` of virtual time."""
        self.weight_updates.append((self.clock.now(), version))
        await self._take(self.cost.sync_s)
        self.weight_version = version

    async def sleep(self, level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
        """vLLM's sleep: nothing runs until the KV cache wakes; level 2 also drops the
        weights (the version served is unknown until the next load)."""
        if self._running or self._waiting:
            raise SimEngineError("sleep with requests in the engine")
        self.asleep = True
        self.lifecycle.append(f"sleep{int(level)}")
        if level.drops_weights:
            self.weight_version = None
        await self._take(self.cost.sleep_s)

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake all, or only `tags`: with the weights alone awake, weights load but no
        request runs (its KV cache is still asleep)."""
        self.lifecycle.append("wake" if tags is None else "wake:" + ",".join(tags))
        await self._take(self.cost.wake_s)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    async def _take(self, seconds: float) -> None:
        """An operation of `seconds` of this replica's. Replicas doing it together (a
        fleet's weight update, a layout going to sleep) overlap, and the others decode
        on meanwhile."""
        await self.node.sleep_until(self.clock.now() + seconds)

    def take_stats(self) -> ReplicaStats:
        """Preemptions, the KV-cache peak and tokens generated since the last call."""
        # the usage now (freed KV included) is where the next peak starts from
        self.counters.record(0, self._usage())
        return self.counters.take()

    async def set_drafts(self, schedule: Sequence[tuple[int, int, int]], sources: Sequence[DraftSource],
                         prompts: Sequence[PromptDrafts]) -> None:
        """A round's draft lengths by batch size, its sources and its prompts' texts
        (without a `SimSpec` the replica decodes a token a step and ignores them)."""
        if self.drafts is not None:
            self._touch()
            self.drafts.set_round(schedule, sources, prompts)
            self.node._poke()

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        """More texts mid-round (finished siblings): rows of their prompts draft from now on."""
        if self.drafts is not None:
            self._touch()
            self.drafts.add(prompts)
            self.node._poke()

    async def take_spec_stats(self) -> SpecStats:
        stats = self.counters.take_spec()
        if self.drafts is None:
            return stats
        return dataclasses.replace(stats, cut=self.drafts.take_cut())

    @property
    def preemptions(self) -> int:
        """Sequences preempted for want of KV cache since the start."""
        return self.counters.preemptions

    @property
    def tokens_generated(self) -> int:
        """Tokens decoded since the start, preempted and aborted ones included."""
        return self.counters.generated

    async def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._touch()
        self._fail_all("the engine shut down", None)
        await self.node._stop_if_unused()

    def _submit(self, request: GenRequest) -> _Seq:
        rid = request.request_id
        if self.closed:
            raise SimEngineError(f"request {rid}: the engine is shut down")
        if self.asleep:
            raise SimEngineError(f"request {rid}: the engine is asleep")
        if rid in self._running or rid in self._waiting:
            raise ValueError(f"request id {rid!r} is already in the engine")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens is {request.max_tokens}, must be >= 1")
        need = len(request.prompt_token_ids) + request.max_tokens
        if self.kv_capacity is not None and need > self.kv_capacity:
            raise ValueError(
                f"request {rid}: prompt + max_tokens ({need} tokens) exceeds the KV cache "
                f"of a TP-{self.tp} replica ({self.kv_capacity} tokens)"
            )
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
        self.node._poke()
        self._touch()
        seq = _Seq(request, stop, reason, asyncio.Queue())
        self._waiting[rid] = seq
        self.seen.append(rid)
        return seq

    def _touch(self) -> None:
        """The batch is about to change: bank the steps completed so far and schedule
        afresh at the node's next decision."""
        jump, self._jump = self._jump, None
        if jump is None:
            return
        now = self.clock.now()
        done = jump.steps_done(now)
        self._advance(done, now - jump.start, jump, jump.verifies.part(done) if jump.verifies else None)

    def _drop(self, rid: str) -> _Seq | None:
        if rid in self._running:
            self._touch()
            seq = self._running.pop(rid)
            self._kv -= seq.kv
            return seq
        return self._waiting.pop(rid, None)

    def _forget(self, seq: _Seq) -> None:
        # By identity: a stream finalised late must not drop a newer request of its id.
        rid = seq.request.request_id
        if self._running.get(rid) is seq or self._waiting.get(rid) is seq:
            self._drop(rid)
            self._keep_cut(seq)

    def _keep_cut(self, seq: _Seq) -> None:
        """An unfinished request left: its tokens so far are a partial response, as a
        vLLM replica's abort output is (`VLLMEngine._keep_cut`)."""
        if self.drafts is not None:
            self.drafts.keep_cut(seq.request.request_id, seq.produced)

    def _fail_all(self, why: str, cause: BaseException | None) -> None:
        for seq in [*self._running.values(), *self._waiting.values()]:
            err = SimEngineError(f"request {seq.request.request_id}: {why}")
            err.__cause__ = cause
            seq.outbox.put_nowait(err)
        self._running.clear()
        self._waiting.clear()
        self._jump = None
        self._kv = 0

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
                accepted=seq.accepted if finished else 0,
            )
        )

    def _usage(self) -> float:
        return self._kv / self.kv_capacity if self.kv_capacity else 0.0

    def _schedule(self, now: float) -> None:
        """vLLM's scheduling step: make room for the running batch's next tokens
        (preempting from the most recently admitted); if nothing was preempted, admit
        from the queue; then plan the steps up to the next event."""
        if not self._make_room():
            self._admit(now)
        if not self._running:
            return
        n = len(self._running)
        prefill = self.cost.prefill_cost(self._fresh, self._fresh_tokens, self.tp)
        fresh_tokens, self._fresh, self._fresh_tokens = self._fresh_tokens, 0, 0
        verifies = None
        if self.drafts is not None:
            room = None if self.kv_capacity is None else self.kv_capacity - self._kv
            verifies = self.drafts.next(list(self._running.values()), self.chunk - self.steps % self.chunk, room)
        if verifies is not None:
            drafted = verifies.drafting * verifies.k
            dt = self.cost.verify_s(n, drafted, self.tp)
            self._jump = _Jump(now, dt + prefill, dt, verifies.steps, n, verifies, n + drafted,
                               n + drafted + fresh_tokens)
            return
        dt = self.cost.step_s(n, self.tp)
        k = min(s.stop - s.produced for s in self._running.values())
        k = min(k, self.chunk - self.steps % self.chunk)
        if self.kv_capacity is not None:
            k = min(k, (self.kv_capacity - self._kv) // n)
        self._jump = _Jump(now, dt + prefill, dt, k, n, None, n, n + fresh_tokens)

    def _make_room(self) -> bool:
        if self.kv_capacity is None:
            return False
        preempted = False
        # One sequence alone always fits (checked at submit), so the batch never empties.
        while self._kv + len(self._running) > self.kv_capacity:
            rid, seq = self._running.popitem()
            self._kv -= seq.kv
            seq.preemptions += 1
            self.counters.record(1, None)
            self._waiting = {rid: seq, **self._waiting}
            preempted = True
        return preempted

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._running) < self._max_concurrency:
            rid, seq = next(iter(self._waiting.items()))
            need = seq.kv  # the prompt, and what a preempted sequence had produced
            if self.kv_capacity is not None and (
                self._kv + need + len(self._running) + 1 > self.kv_capacity
            ):
                break  # FIFO: the head waits for room, and so does everyone behind it
            self._running[rid] = self._waiting.pop(rid)
            self.admitted_at.setdefault(rid, now)
            self._kv += need
            self._fresh += 1
            self._fresh_tokens += need
        self.peak_running = max(self.peak_running, len(self._running))
        self.counters.record(0, self._usage())

    def _advance(self, k: int, elapsed: float, jump: _Jump, verifies: Verifies | None = None) -> None:
        """Bank `k` decode steps of the running batch, taking `elapsed` seconds (and,
        under speculation, the drafted tokens each row accepted in them)."""
        n = len(self._running)
        self.steps += k
        self.decode_s += elapsed
        gained = k * n
        for i, seq in enumerate(self._running.values()):
            seq.produced += k
            if verifies is not None:
                extra = int(verifies.accepted[i])
                seq.produced += extra
                seq.accepted += extra
                gained += extra
        self._kv += gained
        spec = None
        if self.drafts is not None and k:
            spec = (verifies.stats(n, jump.x, jump.first, jump.dt, jump.first_x) if verifies is not None
                    else SpecStats(steps=k, step_fit=step_fit(k, jump.x, jump.first, jump.dt, jump.first_x)))
        self.counters.record(0, self._usage(), generated=gained, spec=spec)

    def _complete(self) -> None:
        """The planned steps are done: deliver what is due."""
        jump, self._jump = self._jump, None
        assert jump is not None
        self._advance(jump.k, jump.first + (jump.k - 1) * jump.dt, jump, jump.verifies)
        now = self.clock.now()
        due = self.steps % self.chunk == 0
        for rid, seq in list(self._running.items()):
            if seq.produced >= seq.stop:
                del self._running[rid]
                self._kv -= seq.kv
                if seq.reason is None:
                    self.failed.append(rid)
                    why = f"request {rid}: simulated failure after {seq.produced} tokens"
                    seq.outbox.put_nowait(SimEngineError(why))
                else:
                    self.finished_at[rid] = now
                    self._emit(seq, finished=True, reason=seq.reason)
            elif due:
                self._emit(seq, finished=False, reason=None)
