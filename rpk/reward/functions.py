"""Reward functions with veRL's signature, and the scorer the loop calls per response.

`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returns a
float or a mapping with a "score" (and optionally "acc"); it may be `async def`.
One sample's failure (raise, timeout, NaN, wrong type) scores 0 and is counted; it
never stops the run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections import Counter
from typing import Any, Callable, Iterable, Mapping

from rpk.loop.records import Response, Scored
from rpk.tasks import arith

RewardFn = Callable[..., Any]

BUILTIN: dict[str, RewardFn] = {arith.DATA_SOURCE: arith.compute_score}


class RewardError(ValueError):
    """A reward function cannot be found or cannot serve the dataset."""


def load_function(spec: str) -> RewardFn:
    """`package.module:function` -> the callable."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"reward.function must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward.function {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward.function {spec!r}: {module_name} has no function {attr!r}")
    return fn


def resolve(spec: str | None, data_sources: Iterable[str]) -> dict[str, RewardFn]:
    """The function for each data source of the dataset, checked before training starts."""
    if spec is not None:
        fn = load_function(spec)
        return {ds: fn for ds in data_sources}
    missing = sorted(set(data_sources) - set(BUILTIN))
    if missing:
        raise RewardError(
            f"no built-in reward for data_source {missing[0]!r} "
            f"(built-in: {', '.join(sorted(BUILTIN))}); set reward.function to module:function"
        )
    return {ds: BUILTIN[ds] for ds in data_sources}


def _as_score(value: Any) -> tuple[float, bool | None]:
    """(score, acc) from what a reward function returned; ValueError when unusable."""
    acc = None
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError("returned a mapping without 'score'")
        acc = value.get("acc")
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"returned {type(value).__name__}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}")
    return score, (bool(acc) if acc is not None else None)


class FunctionScorer:
    """Scores responses with in-process reward functions, a bounded number at a time.

    Synchronous functions run in a worker thread so the event loop keeps serving the
    engine. A timed-out thread cannot be killed, only abandoned: functions that may hang
    for real belong in the process-pool scorer."""

    def __init__(
        self, functions: Mapping[str, RewardFn], timeout_s: float, max_concurrency: int
    ) -> None:
        self._functions = dict(functions)
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self.failures: Counter[str] = Counter()

    async def _call(self, fn: RewardFn, response: Response) -> Any:
        p = response.prompt
        args = (p.data_source, response.text, p.ground_truth, dict(p.extra_info))
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    async def score(self, response: Response) -> Scored:
        fn = self._functions[response.prompt.data_source]
        async with self._slots:
            try:
                value = await asyncio.wait_for(self._call(fn, response), self._timeout_s)
                score, acc = _as_score(value)
            except TimeoutError:
                return self._failed(response, "timeout", f"timed out after {self._timeout_s}s")
            except ValueError as e:
                return self._failed(response, "bad_value", str(e))
            except Exception as e:  # any error in user code costs this one sample
                return self._failed(response, "raised", f"{type(e).__name__}: {e}")
        return Scored(response, score, acc if acc is not None else score > 0)

    def _failed(self, response: Response, kind: str, why: str) -> Scored:
        self.failures[kind] += 1
        return Scored(response, 0.0, False, error=f"{kind}: {why}")

    async def aclose(self) -> None:
        return None
