"""In-process reward functions: veRL's signature, and per-sample failures contained."""

from __future__ import annotations

import pytest

from rpk.loop.records import Prompt, Response
from rpk.reward import BUILTIN, FunctionScorer, RewardError, load_function, resolve


def response(text: str, truth: str = "42", source: str = "t") -> Response:
    prompt = Prompt("u", (1,), source, truth, {"k": 1})
    return Response(prompt, 0, (5, 6), (-0.1, -0.2), "stop", 0, text=text)


def scorer(fn, timeout_s: float = 5.0) -> FunctionScorer:
    return FunctionScorer({"t": fn}, timeout_s=timeout_s, max_concurrency=4)


async def test_float_dict_and_async_functions():
    s = scorer(load_function("tests.reward_fns:exact"))
    assert (await s.score(response("42"))).reward == 1.0
    wrong = await s.score(response("41"))
    assert wrong.reward == 0.0 and wrong.correct is False and wrong.error is None
    d = await scorer(load_function("tests.reward_fns:as_dict")).score(response("x"))
    assert d.reward == 0.5 and d.correct is True
    a = await scorer(load_function("tests.reward_fns:async_exact")).score(response("42"))
    assert a.reward == 1.0


@pytest.mark.parametrize(
    "text, kind, why",
    [
        ("raise", "raised", "KeyError"),
        ("nan", "bad_value", "returned nan"),
        ("str", "bad_value", "returned str, not a number"),
        ("nodict", "bad_value", "without 'score'"),
        ("slow", "timeout", "timed out after 0.1s"),
    ],
)
async def test_one_bad_sample_costs_only_that_sample(text, kind, why):
    s = scorer(load_function("tests.reward_fns:misbehaving"), timeout_s=0.1)
    bad = await s.score(response(text))
    assert bad.reward == 0.0 and bad.correct is False
    assert bad.error.startswith(kind) and why in bad.error
    assert s.failures[kind] == 1
    good = await s.score(response("fine"))
    assert good.reward == 1.0 and good.error is None


def test_load_function_errors_are_clear():
    with pytest.raises(RewardError, match="cannot import 'no_such_module'"):
        load_function("no_such_module:f")
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_function("tests.reward_fns:nope")
    with pytest.raises(RewardError, match="must look like module:function"):
        load_function("tests.reward_fns")


def test_resolve_checks_every_data_source_before_training():
    assert resolve(None, ["rpk/arith"]) == {"rpk/arith": BUILTIN["rpk/arith"]}
    with pytest.raises(RewardError, match="no built-in reward for data_source 'openai/gsm8k'"):
        resolve(None, ["rpk/arith", "openai/gsm8k"])
    fns = resolve("tests.reward_fns:exact", ["a", "b"])
    assert set(fns) == {"a", "b"}
