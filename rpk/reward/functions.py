"""Reward functions with veRL's signature: finding them, combining them, calling them,
and the in-process (thread) scorer.

`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returns a
float or a mapping with a "score" (and optionally "acc"); it may be `async def`. It is
called as veRL calls it, with keyword arguments (so keyword-only functions work), and a
function that cannot be called so is refused when it is loaded, before any engine starts.
One sample's failure (raise, timeout, NaN, wrong type) scores 0 and is counted; it
never stops the run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rpk import tasks
from rpk.core.errors import UserError
from rpk.core.records import Response, Scored
from rpk.reward import code as code_reward
from rpk.reward import math as math_reward

RewardFn = Callable[..., Any]
# What serves a data source: a function, or the built-in code checker (a marker that the
# reward stack scores with the sandbox it owns), alone or as terms of a WeightedSum.
Reward = RewardFn | code_reward.CodeChecker

# The built-in checkers that are no task's; a built-in task's comes from its record
# (`rpk.tasks.by_source`), whose module loads when its data source is asked for.
OTHER_BUILTINS: dict[str, Reward] = {
    **{source: math_reward.compute_score for source in math_reward.DATA_SOURCES},
    **{source: code_reward.CHECKER for source in code_reward.DATA_SOURCES},
}


def builtin_sources() -> list[str]:
    """Every data source a built-in checker serves."""
    return sorted([*(t.data_source for t in tasks.TASKS.values()), *OTHER_BUILTINS])


def builtin(data_source: str) -> Reward:
    """The built-in checker of `data_source`; RewardError names the ones there are."""
    if (t := tasks.by_source(data_source)) is not None:
        return t.checker()
    if data_source in OTHER_BUILTINS:
        return OTHER_BUILTINS[data_source]
    raise RewardError(
        f"no built-in reward for data_source {data_source!r} "
        f"(built-in: {', '.join(builtin_sources())}); set reward.function to module:function"
    )


# The term of `reward.functions` that is the judge (`rpk.reward.hybrid`, weighted).
JUDGE_TERM = "judge"

# veRL calls a reward function with these keyword arguments.
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")

# Failure kinds a sample can be counted under; metrics report each, zeros included, so
# metrics.jsonl columns do not come and go.
FAILURE_KINDS = ("raised", "bad_value", "timeout", "crashed", "bad_input")

_MAX_MESSAGE_CHARS = 300  # an exception's text can be arbitrarily long


class RewardError(UserError, ValueError):
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
    check_signature(fn, spec)
    return fn


def check_signature(fn: RewardFn, name: str) -> None:
    """RewardError unless `fn` accepts veRL's keyword call. Binds the signature only:
    no user code runs at start-up."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some C callables have no signature to check; the first call will tell
    try:
        signature.bind(**dict.fromkeys(VERL_ARGS))
    except TypeError as e:
        raise RewardError(
            f"reward function {name}{signature} cannot be called as veRL calls it, "
            f"fn({'=, '.join(VERL_ARGS)}=): {e}"
        ) from None


def parse_term(spec: str) -> tuple[str, float]:
    """`module:function=weight`, `builtin=weight` or either without `=weight` (weight
    1) -> (name, weight)."""
    name, sep, weight_text = spec.partition("=")
    name = name.strip()
    try:
        weight = float(weight_text) if sep else 1.0
    except ValueError:
        raise RewardError(f"reward term {spec!r}: weight {weight_text!r} is not a number") from None
    if not math.isfinite(weight):
        raise RewardError(f"reward term {spec!r}: weight must be finite, got {weight}")
    if name not in ("builtin", JUDGE_TERM) and ":" not in name:
        raise RewardError(
            f"reward term {spec!r} must look like module:function=weight, builtin=weight or "
            f"{JUDGE_TERM}=weight"
        )
    return name, weight


@dataclass(frozen=True, slots=True)
class JudgeTermSpec:
    """The judge's term of `reward.functions`: its weight, and whether it is the first
    term (whose verdict is the sample's `correct`)."""

    weight: float
    first: bool


def split_judge_term(terms: Sequence[str]) -> tuple[JudgeTermSpec | None, tuple[str, ...]]:
    """(the judge's term, None without one; the other terms) of `reward.functions`."""
    names = [parse_term(t)[0] for t in terms]
    at = [i for i, name in enumerate(names) if name == JUDGE_TERM]
    if not at:
        return None, tuple(terms)
    if len(at) > 1:
        raise RewardError(f"reward.functions {list(terms)}: one {JUDGE_TERM} term at most")
    rest = tuple(t for i, t in enumerate(terms) if i != at[0])
    if not rest:
        raise RewardError(
            f"reward.functions {list(terms)}: a {JUDGE_TERM} term needs rule terms beside it "
            "(for the judge alone, judge the rows: reward.judge.data_sources)"
        )
    return JudgeTermSpec(parse_term(terms[at[0]])[1], at[0] == 0), rest


@dataclass(frozen=True, slots=True)
class WeightedSum:
    """Several reward functions as one: score = sum of weight * score. The first term
    is the task's checker: its verdict is the sample's `correct`. Picklable (functions
    travel by reference), so it runs whole in one pool worker under one timeout."""

    terms: tuple[tuple[Reward, float], ...]

    def __call__(
        self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None
    ) -> dict[str, Any]:
        total = 0.0
        verdict = False
        kwargs = verl_kwargs(data_source, solution_str, ground_truth, extra_info)
        for i, (fn, weight) in enumerate(self.terms):
            score, acc = as_score(call_sync(fn, kwargs))
            total += weight * score
            if i == 0:
                verdict = acc if acc is not None else score > 0
        return {"score": total, "acc": verdict}


def resolve_rewards(
    spec: str | None, data_sources: Iterable[str], terms: Sequence[str] = ()
) -> dict[str, Reward]:
    """The function for each data source of the dataset, checked before training starts:
    `spec` for all of them, else the weighted `terms`, else the built-in checker."""
    sources = sorted(set(data_sources))
    if spec is not None and terms:
        raise RewardError("set reward.function or reward.functions, not both")
    if spec is not None:
        fn = load_function(spec)
        return {ds: fn for ds in sources}
    if terms:
        parsed = [parse_term(t) for t in terms]
        if any(name == JUDGE_TERM for name, _ in parsed):
            raise RewardError(f"reward.functions {list(terms)}: the {JUDGE_TERM} term is the "
                              "judge's, not a function (split_judge_term)")
        loaded = {name: load_function(name) for name, _ in parsed if name != "builtin"}
        return {
            ds: WeightedSum(
                tuple((builtin(ds) if name == "builtin" else loaded[name], w) for name, w in parsed)
            )
            for ds in sources
        }
    return {ds: builtin(ds) for ds in sources}


def reward_name(reward: Reward) -> str:
    """How errors name a data source's reward: module:function, or its weighted terms."""
    if isinstance(reward, code_reward.CodeChecker):
        return "the built-in code checker"
    if isinstance(reward, WeightedSum):
        return " + ".join(f"{w:g}*{reward_name(fn)}" for fn, w in reward.terms)
    module = getattr(reward, "__module__", None) or "?"
    return f"{module}:{getattr(reward, '__qualname__', type(reward).__qualname__)}"


def verl_kwargs(
    data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any
) -> dict[str, Any]:
    return dict(zip(VERL_ARGS, (data_source, solution_str, ground_truth, extra_info)))


def reward_extra_info(response: Response) -> dict[str, Any]:
    """The row's `extra_info` as a reward function gets it; a multi-turn trajectory's
    adds its `num_turns`, `tool_calls`, `tool_failures` and its environment's
    `env_reward`, so that a function of veRL's signature can judge them."""
    info = dict(response.prompt.extra_info)
    if (t := response.turns) is not None:
        info.update(num_turns=t.turns, tool_calls=t.tools.calls, tool_failures=t.tools.failures,
                    env_reward=t.env_reward)
    return info


def response_kwargs(response: Response) -> dict[str, Any]:
    """A reward function's keyword arguments for `response`."""
    p = response.prompt
    return verl_kwargs(p.data_source, response.text, p.ground_truth, reward_extra_info(response))


def call_sync(fn: RewardFn, kwargs: Mapping[str, Any]) -> Any:
    """Call a reward function with veRL's keyword arguments from plain (non-async) code:
    an `async def` one gets its own event loop, so this works in a pool worker or a
    worker thread alike."""
    if is_async(fn):
        return asyncio.run(fn(**kwargs))
    return fn(**kwargs)


def is_async(fn: RewardFn) -> bool:
    """An `async def` function, or an object whose __call__ is one (a CodeScorer). The
    type's `__call__`, as a call looks it up."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def as_score(value: Any) -> tuple[float, bool | None]:
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


def describe(e: BaseException) -> str:
    """One short line for Scored.error."""
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def failed(failures: Counter[str], response: Response, kind: str, why: str) -> Scored:
    """The response scored 0 for a failure of `kind`, counted in `failures`."""
    failures[kind] += 1
    return Scored(response, 0.0, False, error=f"{kind}: {why}")


def failure_metrics(failures: Counter[str], kinds: Sequence[str] = FAILURE_KINDS) -> dict[str, float]:
    return {f"reward_failed_{kind}_total": float(failures[kind]) for kind in kinds}


class FunctionScorer:
    """Scores responses with in-process reward functions, a bounded number at a time
    (`reward.backend=thread`).

    Synchronous functions run in a worker thread so the event loop keeps serving the
    engine. A timed-out thread cannot be killed, only abandoned: functions that may hang
    for real belong in the process-pool scorer."""

    def __init__(
        self, functions: Mapping[str, RewardFn], timeout_s: float, max_concurrency: int
    ) -> None:
        self._functions = dict(functions)
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._slots = asyncio.Semaphore(max_concurrency)
        self._in_flight = 0
        self.failures: Counter[str] = Counter()

    async def _call(self, fn: RewardFn, response: Response) -> Any:
        kwargs = response_kwargs(response)
        if is_async(fn):
            return await fn(**kwargs)
        return await asyncio.to_thread(call_sync, fn, kwargs)

    async def score(self, response: Response) -> Scored:
        fn = self._functions[response.prompt.data_source]
        async with self._slots:
            self._in_flight += 1
            try:
                value = await asyncio.wait_for(self._call(fn, response), self._timeout_s)
            except TimeoutError:
                return failed(self.failures, response, "timeout", f"timed out after {self._timeout_s}s")
            except Exception as e:  # any error in user code costs this one sample
                return failed(self.failures, response, "raised", describe(e))
            finally:
                self._in_flight -= 1
        try:
            score, acc = as_score(value)
        except ValueError as e:
            return failed(self.failures, response, "bad_value", str(e))
        return Scored(response, score, acc if acc is not None else score > 0)

    def metrics(self) -> dict[str, float]:
        return {
            "reward_workers": float(self._max_concurrency),
            "reward_busy": float(self._in_flight),
            "reward_timeout_s": self._timeout_s,
            **failure_metrics(self.failures),
        }

    async def aclose(self) -> None:
        return None
