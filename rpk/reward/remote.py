"""Reward over HTTP: a Scorer that sends responses to a reward service in batches.

Wire format (JSON), one POST per batch:
    request  {"items": [{"data_source", "solution_str", "ground_truth", "extra_info", "uid"}, ...]}
    response {"results": [{"score": float, "acc": bool | null, "error": str | null}, ...]}
with the results in the order of the items. `python -m rpk.reward.server` speaks it.

Responses reach `score()` one at a time as they finish; a batch leaves when it is full
or when its first member has waited `linger_ms`. A batch that cannot be scored (timeout,
connection refused after the retries, an HTTP error, a malformed answer) scores each of
its members 0 and is counted by kind; only a rejected token stops the run, since every
later request would be rejected too.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from rpk.core.backoff import Backoff
from rpk.core.records import Response, Scored
from rpk.reward.functions import RewardError, failed, failure_metrics, reward_extra_info

# Every kind a sample can fail by; metrics list each, zeros included, so metrics.jsonl
# columns do not come and go. "remote": the service reported the item's own failure.
FAILURE_KINDS = ("remote", "timeout", "connection", "http_4xx", "http_5xx", "malformed", "encode")
# Retry delays stop doubling here: a service that is down for longer is down.
# How much of an error body goes into a sample's error message.
_BODY_EXCERPT = 200


# Compared by identity: a cancelled caller finds its own item, not an equal one.
@dataclass(frozen=True, slots=True, eq=False)
class _Item:
    response: Response
    body: str  # the item's JSON, encoded once when it arrives
    future: asyncio.Future[Scored]


def read_token(token_env: str | None, setting: str = "reward.token_env") -> str | None:
    """The bearer token from the environment variable `token_env` names, if one is named;
    `setting` is how the user named it, for the error."""
    if token_env is None:
        return None
    token = os.environ.get(token_env)
    if not token:
        raise RewardError(
            f"{setting}={token_env!r} but the environment variable {token_env} "
            "is unset or empty"
        )
    return token


class HTTPScorer:
    """Scores responses with a remote reward service (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        batch_size: int = 32,
        linger_ms: float = 5.0,
        retry: Backoff = Backoff(limit=3, backoff_s=0.5, max_backoff_s=30.0),
    ) -> None:
        self.url = url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)
        self._batch_size = batch_size
        self._linger_s = linger_ms / 1000
        self._retry = retry
        self._session: aiohttp.ClientSession | None = None
        self._pending: list[_Item] = []
        self._linger: asyncio.TimerHandle | None = None
        self._inflight: dict[asyncio.Task[None], tuple[_Item, ...]] = {}
        self._closed = False
        self.failures: Counter[str] = Counter()
        self.requests = 0
        self.retried = 0
        self.batches = 0
        self._latency_total_s = 0.0

    async def score(self, response: Response) -> Scored:
        if self._closed:
            raise RuntimeError(f"HTTPScorer for {self.url} is closed")
        p = response.prompt
        wire = {
            "data_source": p.data_source,
            "solution_str": response.text,
            "ground_truth": p.ground_truth,
            "extra_info": reward_extra_info(response),
            "uid": p.uid,
        }
        try:
            body = json.dumps(wire, allow_nan=False)
        except (TypeError, ValueError) as e:
            return failed(self.failures, response, "encode", f"cannot send as JSON: {e}")
        item = _Item(response, body, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        if len(self._pending) >= self._batch_size:
            self._flush()
        elif self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(self._linger_s, self._flush)
        try:
            return await item.future
        except asyncio.CancelledError:
            self._abandon(item)
            raise

    def _flush(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        while self._pending:
            items = tuple(self._pending[: self._batch_size])
            del self._pending[: self._batch_size]
            self.batches += 1
            task = asyncio.get_running_loop().create_task(
                self._send(items), name=f"reward-http:{self.batches}"
            )
            self._inflight[task] = items
            task.add_done_callback(self._inflight.pop)

    def _abandon(self, item: _Item) -> None:
        """The caller of `score(item)` was cancelled: drop the item, and its batch's
        request once no caller waits for it any more, so nothing outlives its callers."""
        if item in self._pending:
            self._pending.remove(item)
            if not self._pending and self._linger is not None:
                self._linger.cancel()
                self._linger = None
            return
        for task, items in self._inflight.items():
            if item in items:
                if all(i.future.done() for i in items):
                    task.cancel()
                return

    async def _send(self, items: tuple[_Item, ...]) -> None:
        try:
            outcome = await self._post_with_retries(items)
        except asyncio.CancelledError:
            # By aclose, or by the last caller leaving: nobody may be left waiting.
            for item in items:
                item.future.cancel()
            raise
        except Exception as e:  # a rejected token, or a bug: every caller raises it
            for item in items:
                if not item.future.done():
                    item.future.set_exception(e)
            return
        for item, scored in zip(items, outcome):
            if not item.future.done():
                item.future.set_result(scored)

    async def _post_with_retries(self, items: tuple[_Item, ...]) -> list[Scored]:
        payload = ('{"items": [' + ", ".join(i.body for i in items) + "]}").encode()
        last = ("connection", "no attempt made")
        for attempt in range(self._retry.limit + 1):
            if attempt:
                self.retried += 1
                await asyncio.sleep(self._retry.jittered(attempt))
            try:
                status, text = await self._post(payload)
            except TimeoutError:
                # Not retried: the request may still be running on the service, and a
                # retry would double its load when it is already too slow.
                return self._fail_all(items, "timeout", f"no answer within {self._timeout_s}s")
            except aiohttp.ClientError as e:
                last = ("connection", f"{type(e).__name__}: {e}")
                continue
            if status in (401, 403):
                raise RewardError(
                    f"reward service {self.url} rejected the request (HTTP {status}): "
                    "check reward.token_env and the token the service expects"
                )
            if status >= 500:
                last = ("http_5xx", f"HTTP {status}: {text[:_BODY_EXCERPT]}")
                continue
            if status != 200:
                return self._fail_all(items, "http_4xx", f"HTTP {status}: {text[:_BODY_EXCERPT]}")
            try:
                results = parse_results(text, len(items))
            except ValueError as e:
                return self._fail_all(items, "malformed", str(e))
            return [self._scored(item.response, r) for item, r in zip(items, results)]
        kind, why = last
        return self._fail_all(items, kind, f"{why} (after {self._retry.limit} retries)")

    async def _post(self, payload: bytes) -> tuple[int, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                headers={"Content-Type": "application/json", **self._headers},
                connector=aiohttp.TCPConnector(limit=self._max_concurrency),
            )
        async with self._slots:
            started = time.monotonic()
            try:
                async with self._session.post(self.url, data=payload) as resp:
                    return resp.status, await resp.text()
            finally:
                self.requests += 1
                self._latency_total_s += time.monotonic() - started

    def _scored(self, response: Response, result: dict[str, Any]) -> Scored:
        if result["error"] is not None:
            return failed(self.failures, response, "remote", result["error"])
        score, acc = float(result["score"]), result["acc"]
        return Scored(response, score, acc if acc is not None else score > 0)

    def _fail_all(self, items: tuple[_Item, ...], kind: str, why: str) -> list[Scored]:
        return [failed(self.failures, item.response, kind, why) for item in items]

    def metrics(self) -> dict[str, float]:
        """Totals since the start, for metrics.jsonl: failures count samples."""
        return {
            "reward_http_requests_total": float(self.requests),
            "reward_http_retries_total": float(self.retried),
            "reward_http_latency_mean_s": self._latency_total_s / max(self.requests, 1),
            **failure_metrics(self.failures, FAILURE_KINDS),
        }

    async def aclose(self) -> None:
        self._closed = True
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        for item in self._pending:
            item.future.cancel()
        self._pending.clear()
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None


def parse_results(text: str, expected: int) -> list[dict[str, Any]]:
    """The results of a service's answer, checked; ValueError says what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"answer is not JSON ({e}): {text[:_BODY_EXCERPT]!r}") from None
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise ValueError(f"answer has no 'results' list: {text[:_BODY_EXCERPT]!r}")
    if len(results) != expected:
        raise ValueError(f"answer has {len(results)} results for {expected} items")
    checked = []
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            raise ValueError(f"result {i} is {type(r).__name__}, not an object")
        score, acc, error = r.get("score"), r.get("acc"), r.get("error")
        number = isinstance(score, (int, float)) and not isinstance(score, bool)
        if not number or not math.isfinite(score):
            raise ValueError(f"result {i} has score {score!r}, not a finite number")
        if acc is not None and not isinstance(acc, bool):
            raise ValueError(f"result {i} has acc {acc!r}, not a bool or null")
        if error is not None and not isinstance(error, str):
            raise ValueError(f"result {i} has error {error!r}, not a string or null")
        checked.append({"score": score, "acc": acc, "error": error})
    return checked
