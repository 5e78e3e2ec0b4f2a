"""What the simulator's operations cost, and the virtual clock they are paid on."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, fields

from rpk.sched.speculate import StepCost

# Virtual times are sums of float step times: deadlines are met within this slack.
EPS = 1e-9


@dataclass(frozen=True, slots=True)
class CostModel:
    """Virtual seconds per engine operation, and KV memory. The defaults resemble a 7B
    model decoding on one H100-class GPU: ~15 ms per step, growing slowly with the
    batch, and unbounded KV memory (no preemption).

    Tensor parallelism: a replica of `tp` devices splits a step's work over them and
    pays its all-reduces: `tp_comm_s` per extra device per step (their latency), and
    `tp_comm_per_seq_s` per running sequence scaled by a ring's 2 (tp - 1) / tp (their
    bytes: every sequence's activations cross the link twice a layer). Its KV cache is
    `tp * (kv_tokens + weight_tokens) - weight_tokens`: each device has room for
    `kv_tokens + weight_tokens` tokens, and the replica's one copy of the weights takes
    `weight_tokens` of that room in all.

    Speculative decoding: a step in which the running sequences verify `drafted` draft
    tokens between them runs `batch + drafted` tokens, and costs what a decode step of
    that many sequences costs (`verify_s`), plus `draft_token_s` per drafted token for
    the proposer (0 for drafts copied from text). That is `rpk.sched.speculate.StepCost`
    (`step_cost`): the planner's model of a step is the simulator's. A step of few
    sequences is bound by reading the weights (`base_s`), so its drafts cost little."""

    base_s: float = 0.015  # per decode step: reading the weights
    per_seq_s: float = 5e-5  # per running sequence in that step: its KV cache, sampling
    prefill_s: float = 0.0  # once per admitted sequence, in its first step
    sync_s: float = 0.0  # per weight update
    prefill_token_s: float = 0.0  # per token (re)computed at admission, in its first step
    kv_tokens: int | None = None  # KV cache of one device at TP 1, in tokens; None: unbounded
    weight_tokens: int = 0  # the weights' memory, in KV tokens
    tp_comm_s: float = 0.0  # per decode step, per extra device of a replica
    tp_comm_per_seq_s: float = 0.0  # per decode step and running sequence, at tp 2
    sleep_s: float = 0.0  # a replica going to sleep (dropping its weights)
    wake_s: float = 0.0  # a replica waking up (before its weights are loaded)
    draft_token_s: float = 0.0  # per drafted token, the proposer's (speculative decoding)

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self) if f.name != "kv_tokens"]
        negative = {f: getattr(self, f) for f in names if not getattr(self, f) >= 0}
        if negative:
            raise ValueError(f"CostModel costs must be >= 0, got {negative}")
        if self.base_s + self.per_seq_s <= 0:
            raise ValueError(
                f"a decode step must take time: base_s ({self.base_s}) + per_seq_s "
                f"({self.per_seq_s}) is 0"
            )
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"CostModel kv_tokens must be >= 1 or None, got {self.kv_tokens}")

    def step_s(self, batch: int, tp: int = 1) -> float:
        comm = self.tp_comm_s * (tp - 1) + self.tp_comm_per_seq_s * batch * 2 * (tp - 1) / tp
        return (self.base_s + self.per_seq_s * batch) / tp + comm

    def verify_s(self, batch: int, drafted: int, tp: int = 1) -> float:
        """A step of `batch` sequences verifying `drafted` draft tokens between them."""
        return self.step_s(batch + drafted, tp) + self.draft_token_s * drafted / tp

    def step_cost(self, tp: int = 1) -> StepCost:
        """`verify_s` as the planner's `StepCost`: at n sequences with k drafts each,
        `StepCost.seconds(n, k) == verify_s(n, n * k)`."""
        per_token = self.per_seq_s / tp + self.tp_comm_per_seq_s * 2 * (tp - 1) / tp
        return StepCost(self.base_s / tp + self.tp_comm_s * (tp - 1), per_token, self.draft_token_s / tp)

    def prefill_cost(self, seqs: int, tokens: int, tp: int = 1) -> float:
        return self.prefill_s * seqs + self.prefill_token_s * tokens / tp

    def kv_capacity(self, tp: int = 1) -> int | None:
        if self.kv_tokens is None:
            return None
        return tp * (self.kv_tokens + self.weight_tokens) - self.weight_tokens


class VirtualClock:
    """Simulated seconds, moved by the node that owns it (and by the weight loads,
    sleeps and wakes of its replicas while nothing decodes). Pass `clock.now` (or the
    clock itself) as `clock=` to run_round/run_step."""

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
        while self._sleepers and self._sleepers[0][0] <= self._now + EPS:
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
        if t <= self._now + EPS:
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (t, next(self._order), fut))
        await fut
