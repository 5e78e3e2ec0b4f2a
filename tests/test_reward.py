"""In-process reward functions: veRL's signature, and per-sample failures contained."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from rpk.assembly.settings import reward_settings
from rpk.config import ConfigError, RewardConfig, from_argv
from rpk.core.records import Prompt, Response
from rpk.reward import (
    FunctionScorer,
    PoolSettings,
    ProcessScorer,
    RewardError,
    RewardSettings,
    ShapedScorer,
    Shaping,
    WeightedSum,
    builtin,
    load_function,
    make_scorer,
    resolve_rewards,
)
from rpk.reward import math as math_reward
from rpk.reward.pool import worker_memory_mb
from rpk.reward.shaping import overlong_penalty
from tests.reward_fns import MISBEHAVING


def response(text: str, truth: str = "42", source: str = "t", tokens: int = 2) -> Response:
    prompt = Prompt("u", (1,), source, truth, {"k": 1})
    return Response(prompt, 0, (5,) * tokens, (-0.1,) * tokens, "stop", 0, text=text)


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
    [*MISBEHAVING, ("slow", "timeout", "timed out after 0.1s")],
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
    assert resolve_rewards(None, ["rpk/arith"]) == {"rpk/arith": builtin("rpk/arith")}
    with pytest.raises(RewardError, match="no built-in reward for data_source 'my/data'"):
        resolve_rewards(None, ["rpk/arith", "my/data"])
    for source in ("openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "math_dapo"):
        assert resolve_rewards(None, [source])[source] is math_reward.compute_score
    fns = resolve_rewards("tests.reward_fns:exact", ["a", "b"])
    assert set(fns) == {"a", "b"}


def test_weighted_terms_sum_and_the_first_term_gives_the_verdict():
    fns = resolve_rewards(None, ["rpk/arith", "t"], ["tests.reward_fns:exact=2", "tests.reward_fns:prefix=-0.5"])
    fn = fns["t"]
    assert isinstance(fn, WeightedSum)
    assert fn("t", "42", "42") == {"score": 2 * 1.0 - 0.5 * 0.5, "acc": True}
    assert fn("t", "4", "42") == {"score": -0.25, "acc": False}
    with_builtin = resolve_rewards(None, ["rpk/arith"], ["builtin", "tests.reward_fns:as_dict=0.1"])
    assert with_builtin["rpk/arith"].terms[0] == (builtin("rpk/arith"), 1.0)
    with pytest.raises(RewardError, match="weight 'x' is not a number"):
        resolve_rewards(None, ["t"], ["tests.reward_fns:exact=x"])
    with pytest.raises(RewardError, match="not both"):
        resolve_rewards("tests.reward_fns:exact", ["t"], ["builtin"])


async def test_weighted_async_terms_run_in_a_thread_scorer():
    fns = resolve_rewards(None, ["t"], ["tests.reward_fns:async_exact=1", "tests.reward_fns:as_dict=1"])
    got = await FunctionScorer(fns, timeout_s=5, max_concurrency=2).score(response("42"))
    assert got.reward == 1.5 and got.correct is True


def test_overlong_penalty_by_hand():
    # L_max = 100, L_cache = 20: free up to 80 tokens, then -1/20 per token, -1 from 100.
    assert [overlong_penalty(n, 100, 20) for n in (0, 80, 81, 90, 99, 100, 130)] == [
        0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0,
    ]
    assert overlong_penalty(500, 100, 0) == 0.0


async def test_shaping_adds_format_and_overlong_terms_and_keeps_the_verdict():
    inner = FunctionScorer({"t": load_function("tests.reward_fns:exact")}, 5.0, 2)
    shaping = Shaping(
        format_regex=r"^\d+$", format_weight=0.25, max_tokens=100, overlong_buffer=20,
        overlong_weight=0.5,
    )
    s = ShapedScorer(inner, shaping)
    right_long = await s.score(response("42", tokens=90))  # 1 + 0.25 + 0.5 * -0.5
    assert right_long.reward == pytest.approx(1.0) and right_long.correct is True
    wrong_short = await s.score(response("41", tokens=10))  # 0 + 0.25
    assert wrong_short.reward == pytest.approx(0.25) and wrong_short.correct is False
    misformatted = await s.score(response("42!", tokens=100))  # 0 + 0 + 0.5 * -1
    assert misformatted.reward == pytest.approx(-0.5) and misformatted.correct is False
    m = s.metrics()
    assert m["reward_format_miss_total"] == 1.0 and m["reward_overlong_total"] == 2.0
    failed = await ShapedScorer(
        FunctionScorer({"t": load_function("tests.reward_fns:misbehaving")}, 5.0, 2), shaping
    ).score(response("raise", tokens=10))
    assert failed.reward == 0.0 and failed.error is not None  # a failure is not shaped


async def test_make_scorer_follows_the_config():
    fns = {"t": load_function("tests.reward_fns:exact")}
    process = make_scorer(RewardSettings(), fns, max_tokens=64)
    assert [type(s) for s in process.scorer.scorers] == [ProcessScorer]
    assert process.sandbox is None and process.name_of("t") == "tests.reward_fns:exact"
    await process.aclose()
    thread = make_scorer(RewardSettings(backend="thread"), fns, max_tokens=64)
    assert [type(s) for s in thread.scorer.scorers] == [FunctionScorer]
    assert thread.metrics()["reward_timeout_s"] == 30.0
    shaped = make_scorer(RewardSettings(backend="thread", overlong_buffer=16), fns, max_tokens=64)
    assert isinstance(shaped.scorer, ShapedScorer) and shaped.scorer.shaping.max_tokens == 64
    assert (await shaped.score(response("42", tokens=56))).reward == pytest.approx(0.5)
    with pytest.raises(RewardError, match="overlong_buffer=64 must be < rollout.max_tokens=64"):
        make_scorer(RewardSettings(overlong_buffer=64), fns, max_tokens=64)


async def test_pool_workers_get_a_memory_limit_by_default():
    fns = {"t": load_function("tests.reward_fns:exact")}
    total_mib = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 20
    assert worker_memory_mb(4) == pytest.approx(total_mib / 8, abs=1)  # half, over 4 workers
    for argv, limit in (([], worker_memory_mb(4)), (["--reward.worker_memory_mb", "512"], 512)):
        stack = make_scorer(reward_settings(from_argv(argv).reward), fns, max_tokens=64)
        (pool,) = stack.scorer.scorers
        assert isinstance(pool, ProcessScorer) and pool.settings.memory_mb == limit
        await stack.aclose()
    with pytest.raises(ValueError, match="memory_mb must be > 0, got 0"):
        PoolSettings(timeout_s=1.0, memory_mb=0)


def test_a_function_verl_cannot_call_is_refused_when_loaded():
    """veRL calls fn(data_source=, solution_str=, ground_truth=, extra_info=): checked by
    binding the signature, so no user code runs at start-up."""
    assert load_function("tests.reward_fns:keyword_only")
    cases = [
        ("wrong_names", "wrong_names(source, text, truth, extra_info=None) cannot be called "
         "as veRL calls it, fn(data_source=, solution_str=, ground_truth=, extra_info=): "
         "missing a required argument: 'source'"),
        ("too_many", "missing a required argument: 'tokenizer'"),
        ("no_extra_info", "got an unexpected keyword argument 'extra_info'"),
    ]
    for name, message in cases:
        with pytest.raises(RewardError, match=re.escape(f"reward function tests.reward_fns:{name}")):
            load_function(f"tests.reward_fns:{name}")
        with pytest.raises(RewardError, match=re.escape(message)):
            resolve_rewards(None, ["rpk/arith"], ["builtin", f"tests.reward_fns:{name}=1"])


async def test_the_check_refuses_before_the_engine_starts(tmp_path, monkeypatch):
    from rpk import assembly
    from rpk.config import Config

    async def start_engine(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(assembly.start, "start_engine", start_engine)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    prompts = [Prompt(f"p{i}", (1,), "t", "1") for i in range(32)]
    cfg = Config(reward=RewardConfig(function="tests.reward_fns:too_many"))
    with pytest.raises(RewardError, match=r"reward function tests.reward_fns:too_many\("):
        await assembly.start_parts(cfg, assembly.place(cfg.rollout), tmp_path, prompts, print)


async def test_a_start_that_fails_half_way_stops_what_started(tmp_path, monkeypatch):
    """The trainer loaded, then the engine's start fails: the trainer and the scorer's
    pool are stopped, newest first, and the engine's error is what the run sees."""
    from rpk import assembly
    from rpk.config import Config, RolloutConfig

    closed: list[str] = []

    class Trainer:
        async def aclose(self) -> None:
            closed.append("trainer")

    async def start_engine(*args, **kwargs):
        await asyncio.sleep(0.05)  # the trainer is loaded by now
        raise OSError("no such GPU")

    monkeypatch.setattr(assembly.start, "build_trainer", lambda cfg, model_dir, box, joined=None: Trainer())
    monkeypatch.setattr(assembly.start, "start_engine", start_engine)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    prompts = [Prompt(f"p{i}", (1,), "t", "1") for i in range(32)]
    cfg = Config(reward=RewardConfig(backend="thread", function="tests.reward_fns:exact"),
                 rollout=RolloutConfig(prompts_per_step=2))
    real_scorer = assembly.start.build_scorer

    def scorer(*args, **kwargs):
        stack = real_scorer(*args, **kwargs)
        close = stack.aclose

        async def counted() -> None:
            closed.append("scorer")
            await close()

        stack.aclose = counted
        return stack

    monkeypatch.setattr(assembly.start, "build_scorer", scorer)
    with pytest.raises(ExceptionGroup) as failed:
        await assembly.start_parts(cfg, assembly.place(cfg.rollout), tmp_path, prompts, print)
    assert failed.group_contains(OSError, match="no such GPU")
    assert closed == ["trainer", "scorer"]


async def test_keyword_only_functions_score_in_threads():
    s = scorer(load_function("tests.reward_fns:keyword_only"))
    assert (await s.score(response("42"))).reward == 1.0
    fns = resolve_rewards(None, ["t"], ["tests.reward_fns:keyword_only=2"])
    assert (await FunctionScorer(fns, 5.0, 2).score(response("42"))).reward == 2.0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"functions": ("exact",)}, "'exact' must look like module:function=weight"),
        ({"functions": ("m:f=x",)}, "weight 'x' is not a finite number"),
        ({"function": "m:f", "functions": ("builtin",)}, "function ('m:f') and functions (['builtin']): set one"),
        ({"min_workers": 5, "max_workers": 2}, "min_workers (5) must be <= max_workers (2)"),
        ({"max_workers": 0}, "max_workers must be > 0, got 0"),
        ({"format_regex": "("}, "format_regex '(' does not compile"),
        ({"backend": "ray"}, "ray"),
        ({"worker_memory_mb": -1}, "worker_memory_mb must be >= 0, got -1"),
        ({"max_failure_frac": 1.5}, "max_failure_frac must be in [0, 1], got 1.5"),
        ({"max_failure_steps": 0}, "max_failure_steps must be a positive integer, got 0"),
    ],
)
def test_reward_config_names_bad_values(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RewardConfig(**fields)


def test_pool_settings_name_bad_values():
    with pytest.raises(ValueError, match="min_workers=3, max_workers=2"):
        PoolSettings(timeout_s=1.0, min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        PoolSettings(timeout_s=0)


def test_shaping_rejects_a_buffer_as_long_as_the_budget():
    with pytest.raises(ValueError, match=r"overlong_buffer must be in \[0, max_tokens=8\), got 8"):
        Shaping(max_tokens=8, overlong_buffer=8)
    assert not Shaping(max_tokens=8).active
    assert Shaping(max_tokens=8, overlong_buffer=4).active
