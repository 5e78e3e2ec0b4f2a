"""Verdicts kept by content: a judge asked the same thing twice answers once.

As the policy converges, a GRPO group repeats its short answers ("42", "The answer is
42."), and every copy would cost the judge a request. `CachedJudge` sits in front of any
judge engine (the pool of vLLM engines, an OpenAI-compatible endpoint) and keeps its
readings in a bounded LRU (`VerdictCache`) under a key of everything that decides a
reading: the judge's identity (its model or endpoint and every setting that shapes its
answer: the verdict kind, the yes/no words, the template and system message, ...) and
the request itself (`JudgeRequest`: its messages with their slots, the data fields'
values, whether the assistant's turn is opened), which is what the engines tokenise. So
a different reference, question or template misses, and a changed threshold still
applies (the reading is kept, not the reward).

A copy asked while the first is still in flight waits for it rather than asking too.
Only readings are kept: a request that failed (a timeout, a refused prompt, a dead
engine) is asked again next time. Greedy and log-prob readings are deterministic, which
is what makes a kept one as good as a new one; a judge that samples its votes
(`votes` > 1) would get one vote for all, so it has no cache (`samples`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections import OrderedDict
from typing import Any

from rpk.reward.judge import JudgeEngine, JudgeRequest, JudgeSettings, MeteredEngine
from rpk.reward.verdict import Reading

# Settings that act after the reading (how it becomes a reward) or on where and how
# often the judge is asked: the same reading serves every value of them.
_NOT_IN_KEY = frozenset({"data_sources", "threshold", "score_max", "max_concurrency", "timeout_s",
                         "compare_rules", "max_model_len"})


def judge_identity(settings: JudgeSettings, served_by: str) -> str:
    """What a reading depends on besides the messages: `served_by` (the model directory
    or the endpoint's URL and model) and every setting of `settings` that shapes the
    judge's answer, the template and system message included (hashed)."""
    fields = {k: v for k, v in dataclasses.asdict(settings).items() if k not in _NOT_IN_KEY}
    blob = json.dumps({"served_by": served_by, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def verdict_key(identity: str, request: JudgeRequest) -> str:
    blob = json.dumps([identity, request.to_dict()], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def samples(settings: JudgeSettings) -> bool:
    """Whether the judge samples its votes: each vote is a reading of its own, and one
    kept reading would stand for all of them."""
    return settings.kind.votes and settings.votes > 1


class VerdictCache:
    """At most `size` readings by key, the least recently used dropped first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a verdict cache holds >= 1 reading, got size {size}")
        self.size = size
        self._kept: OrderedDict[str, Reading] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: str) -> Reading | None:
        reading = self._kept.get(key)
        if reading is not None:
            self._kept.move_to_end(key)
        return reading

    def put(self, key: str, reading: Reading) -> None:
        self._kept[key] = reading
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)


class CachedJudge:
    """`JudgeEngine` over `inner`, its readings kept in a `VerdictCache` of `size`
    under `identity` (`judge_identity`); rests and stops as `inner` does."""

    def __init__(self, inner: JudgeEngine, identity: str, size: int) -> None:
        self.inner = inner
        self.identity = identity
        self.cache = VerdictCache(size)
        self._pending: dict[str, asyncio.Event] = {}  # keys asked and not yet answered
        self.lookups = 0
        self.hits = 0
        self._reported = (0, 0)

    @property
    def can_sleep(self) -> bool:
        return bool(getattr(self.inner, "can_sleep", False))

    async def sleep(self) -> None:
        await self.inner.sleep()  # type: ignore[attr-defined]

    async def ready(self) -> None:
        await self.inner.ready()

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        key = verdict_key(self.identity, request)
        self.lookups += 1
        while True:
            kept = self.cache.get(key)
            if kept is not None:
                self.hits += 1
                return kept
            pending = self._pending.get(key)
            if pending is None:
                break
            await pending.wait()  # then kept, or failed: asked again here
        done = self._pending[key] = asyncio.Event()
        try:
            reading = await self.inner.judge(request, request_id)
            self.cache.put(key, reading)
            return reading
        finally:
            del self._pending[key]
            done.set()

    def metrics(self) -> dict[str, float]:
        """The step's hit rate (since the last step's record; 0 when nothing was
        asked), its counts and totals, and `inner`'s own metrics."""
        lookups, hits = self.lookups - self._reported[0], self.hits - self._reported[1]
        self._reported = (self.lookups, self.hits)
        out: dict[str, Any] = dict(self.inner.metrics()) if isinstance(self.inner, MeteredEngine) else {}
        out.update({
            "reward_judge_cache_hit_rate": hits / lookups if lookups else 0.0,
            "reward_judge_cache_lookups": float(lookups),
            "reward_judge_cache_hits": float(hits),
            "reward_judge_cache_hits_total": float(self.hits),
            "reward_judge_cache_size": float(len(self.cache)),
        })
        return out

    async def aclose(self) -> None:
        await self.inner.aclose()


def unwrap(engine: Any) -> Any:
    """The engine behind any caches in front of it."""
    while isinstance(engine, CachedJudge):
        engine = engine.inner
    return engine
