"""The judge's GPU branch without a GPU: its engine arguments against vLLM 0.32's
signatures and config dataclasses (prefetch offload, memory share, sleep mode, the
log-prob settings, the reward model's pooling runner), and its rest with the fleet
around training on a fake engine whose every call is bound to AsyncLLM's signature: at
level 1 whatever the fleet's level, woken outside the verdict's timeout, and never put
to sleep while a wake is in flight (../shared/GPU-AUDIT-2.md M1, M2)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest

from rpk.core.modes import RestLevel, Runner
from rpk.core.records import Prompt, Response
from rpk.engine.vllm_settings import VLLMSettings, engine_kwargs
from rpk.judge.rest import JUDGE_REST, FleetAndJudge, RestState, with_judge
from rpk.judge.vllm import (
    JudgeDevice,
    VLLMJudge,
    VLLMRewardModel,
    judge_engine_args,
    judge_vllm_settings,
    offloaded_by,
    prefetch_groups,
)
from rpk.reward.judge import JudgeScorer, JudgeSettings
from rpk.reward.verdict import Sampling, Verdict
from tests.judge_fakes import ScriptEngine, ScriptLLM, completion, judge_tokenizer

SETTINGS = JudgeSettings(model="judge", yes="Y", no="N", max_concurrency=8)
DEVICE = JudgeDevice(gpu_memory_utilization=0.25, layers=28, offloaded=14, prefetch_step=2)


def _gpu_kwargs(device: JudgeDevice = DEVICE) -> dict[str, Any]:
    return engine_kwargs(judge_vllm_settings(SETTINGS, Path("/m"), 0, device), cuda=True)


# -- the engine arguments, against vLLM 0.32 -----------------------------------------------


def test_the_judges_gpu_arguments_are_vllms_and_build_its_engine_args() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = _gpu_kwargs()
    accepted = inspect.signature(AsyncEngineArgs).parameters
    assert set(kwargs) <= set(accepted), set(kwargs) - set(accepted)
    assert {k: kwargs[k] for k in ("offload_backend", "offload_group_size", "offload_num_in_group",
                                   "offload_prefetch_step")} == {
        "offload_backend": "prefetch", "offload_group_size": 2, "offload_num_in_group": 1,
        "offload_prefetch_step": 2}
    assert kwargs["gpu_memory_utilization"] == 0.25 and kwargs["enable_sleep_mode"] is True
    # On CUDA the share alone sizes the KV cache: vLLM would let an explicit size override it.
    assert "kv_cache_memory_bytes" not in kwargs and kwargs["dtype"] == "bfloat16"
    AsyncEngineArgs(**kwargs)  # type: ignore[arg-type]


def test_the_judges_arguments_land_in_vllms_config_dataclasses() -> None:
    from vllm.config import CacheConfig, ModelConfig
    from vllm.config.offload import OffloadConfig, PrefetchOffloadConfig

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    kwargs = _gpu_kwargs()
    prefetch = {k: v for k, v in kwargs.items() if k.startswith("offload_") and k != "offload_backend"}
    assert set(prefetch) <= names(PrefetchOffloadConfig)
    assert "gpu_memory_utilization" in names(CacheConfig)
    assert {"enable_sleep_mode", "max_logprobs", "logprobs_mode"} <= names(ModelConfig)
    # vLLM's own validation of the offload section accepts what the judge asks for.
    OffloadConfig(offload_backend=kwargs["offload_backend"], prefetch=PrefetchOffloadConfig(**prefetch))


def test_the_logprob_settings_are_vllms() -> None:
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = _gpu_kwargs()
    assert kwargs["logprobs_mode"] in typing.get_args(LogprobsMode)
    # The yes and no ids count against max_logprobs.
    assert inspect.signature(AsyncEngineArgs).parameters["max_logprobs"].default >= 2
    judge = VLLMJudge(ScriptEngine(ScriptLLM([])), judge_tokenizer(), SETTINGS, owned=False)  # type: ignore[arg-type]
    params = judge.sampling_params(Sampling(1, 1.0), words=True)
    assert params.logprob_token_ids == judge._words and params.max_tokens == 1 and params.temperature == 1.0


def test_a_reward_model_runs_on_the_pooling_runner_without_sampling_settings() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = judge_vllm_settings(SETTINGS, Path("/m"), 0, DEVICE, VLLMRewardModel.runner)
    assert settings.runner is Runner.POOLING and VLLMJudge.runner is Runner.GENERATE
    kwargs = engine_kwargs(settings, cuda=True)
    assert kwargs["runner"] == "pooling" and "logprobs_mode" not in kwargs
    inspect.signature(AsyncEngineArgs).bind(**kwargs)
    assert "runner" not in engine_kwargs(judge_vllm_settings(SETTINGS, Path("/m"), 0, DEVICE), cuda=True)
    # What a dry run prints: the runner is the verdict kind's.
    reward_model = dataclasses.replace(SETTINGS, verdict=Verdict.CLASSIFY)
    assert judge_engine_args(reward_model, Path("/m"), 0, DEVICE, True) == kwargs
    assert "runner" not in judge_engine_args(SETTINGS, Path("/m"), 0, DEVICE, True)


def test_on_cpu_the_judge_takes_the_rollout_engines_defaults() -> None:
    settings = judge_vllm_settings(SETTINGS, Path("/m"), 3, None)
    assert settings == VLLMSettings(model=Path("/m"), max_num_seqs=8, seed=3)
    assert "offload_backend" not in engine_kwargs(settings, cuda=False)


def test_the_prefetch_groups_stream_the_fewest_layers_asked_spread_out() -> None:
    assert prefetch_groups(28, 0) is None
    for wanted in range(1, 29):
        g = prefetch_groups(28, wanted)
        assert g is not None
        streamed = offloaded_by(g.group_size, g.num_in_group, 28)
        assert streamed >= wanted
        assert all(offloaded_by(gs, k, 28) < wanted or offloaded_by(gs, k, 28) >= streamed
                   for gs in range(1, 29) for k in range(1, gs + 1)), wanted
    half = prefetch_groups(28, 14)
    assert half is not None and (half.group_size, half.num_in_group) == (2, 1)
    # vLLM's rule, counted by hand: groups of 8, the last 2 of each: 6,7,14,15,22,23 of 24
    # or 28 layers, and 30 too of 31.
    assert offloaded_by(8, 2, 24) == 6 and offloaded_by(8, 2, 28) == 6 and offloaded_by(8, 2, 31) == 7
    with pytest.raises(ValueError, match="cannot stream 29 of 28"):
        prefetch_groups(28, 29)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\), got 1.5"):
        JudgeDevice(gpu_memory_utilization=1.5, layers=28)
    with pytest.raises(ValueError, match="offloaded=30"):
        JudgeDevice(gpu_memory_utilization=0.3, layers=28, offloaded=30)


# -- resting with the fleet --------------------------------------------------------------


class _Fleet:
    def __init__(self, log: list, level: int) -> None:
        self.log = log
        self.rest_level = level
        self.resting: int | None = None

    async def rest(self, level: int) -> None:
        self.log.append(("fleet.rest", level))
        self.resting = level

    async def wake_from_rest(self) -> None:
        self.log.append(("fleet.wake",))
        self.resting = None


def _response(i: int) -> Response:
    return Response(Prompt(f"q{i}", (1,), "qa", "4"), 0, (5,), (-0.1,), "stop", 0, text="4")


def _judged(log: list, sleeps: bool = True, level: int = 2, busy: int = 0, wake_s: float = 0.01,
            timeout_s: float = 5.0):
    tok = judge_tokenizer()
    words = [tok.convert_tokens_to_ids(w) for w in ("Y", "N")]
    llm = ScriptLLM(log, lambda ids, p: completion(logprobs={words[0]: -0.1, words[1]: -2.5}),
                    wake_s=wake_s, busy=busy)
    settings = dataclasses.replace(SETTINGS, timeout_s=timeout_s)
    judge = VLLMJudge(ScriptEngine(llm, sleeps), tok, settings, owned=False)  # type: ignore[arg-type]
    scorer = JudgeScorer(settings, judge)
    said: list[str] = []
    return FleetAndJudge(_Fleet(log, level), scorer, said.append), scorer, said


@pytest.mark.parametrize("level", [RestLevel.KEEP_WEIGHTS, RestLevel.DROP_WEIGHTS])
async def test_the_judge_sleeps_at_level_1_whatever_the_fleets_level_and_wakes_when_next_asked(
        level: RestLevel) -> None:
    """Its weights never change: level 2 would reload them from disk every step and, with
    streamed layers, compute the first verdict after each wake with another layer's
    weights (GPU-AUDIT-2 M1)."""
    log: list = []
    rester, scorer, said = _judged(log, level=level)
    await rester.rest(rester.rest_level)
    assert rester.resting == level and JUDGE_REST is RestLevel.KEEP_WEIGHTS
    assert [e[0] for e in log] == ["fleet.rest", "sleep"] and log[1][2] == {"level": 1}
    await rester.wake_from_rest()
    assert "wake_up" not in [e[0] for e in log]  # not until the judge is asked
    # Two verdicts asked at once: one wake, and nothing reloaded.
    scored = await asyncio.gather(scorer.score(_response(0)), scorer.score(_response(1)))
    assert [s.error for s in scored] == [None, None] and scored[0].reward > 0.5
    calls = [e[0] for e in log]
    assert calls.count("wake_up") == 1 and log[calls.index("wake_up")][2] == {"tags": None}
    assert "collective_rpc" not in calls and calls.index("wake_up") < calls.index("generate")
    # Awake again: the next verdict wakes nothing.
    await scorer.score(_response(2))
    assert [e[0] for e in log].count("wake_up") == 1 and not said


async def test_a_slow_wake_is_no_verdicts_timeout() -> None:
    """A wake's time is not a verdict's: a judge that takes longer to wake than
    `timeout_s` still answers, and the step's metrics say how long it waited."""
    log: list = []
    rester, scorer, _ = _judged(log, wake_s=1.5, timeout_s=0.5)
    await rester.rest(1)
    scored = await scorer.score(_response(0))
    assert scored.error is None and scorer.failures["judge_timeout"] == 0
    m = scorer.metrics()
    assert m["reward_judge_wake_s"] >= 1.5 and m["reward_judge_latency_s"] < 0.5
    assert scorer.metrics()["reward_judge_wake_s"] == 0.0  # per step: read, then reset


async def test_a_rest_while_a_wake_is_in_flight_waits_for_it_then_sleeps() -> None:
    """A verdict cancelled at the round's end leaves its engine's wake running (the other
    verdicts need it); the fleet's rest then waits for the wake instead of failing the
    step (GPU-AUDIT-2 M2)."""
    log: list = []
    rester, scorer, _ = _judged(log, wake_s=0.5)
    await rester.rest(2)
    verdict = asyncio.ensure_future(scorer.score(_response(0)))
    await asyncio.sleep(0.01)  # the wake has started
    verdict.cancel()
    await rester.rest(2)
    judge = scorer.engine
    assert isinstance(judge, VLLMJudge) and judge.rest.state is RestState.ASLEEP
    assert [e[0] for e in log if e[0] != "fleet.rest"] == ["sleep", "wake_up", "sleep"] and verdict.cancelled()
    # The next round's first verdict wakes it again.
    assert (await scorer.score(_response(1))).error is None
    assert [e[0] for e in log].count("wake_up") == 2


async def test_a_request_that_times_out_while_the_judge_wakes_does_not_cancel_the_wake() -> None:
    log: list = []
    rester, scorer, _ = _judged(log)
    await rester.rest(2)
    judge = scorer.engine
    assert isinstance(judge, VLLMJudge)
    first = asyncio.ensure_future(judge.ready())
    await asyncio.sleep(0)  # the wake has started
    first.cancel()
    assert (await scorer.score(_response(0))).error is None
    calls = [e[0] for e in log]
    assert calls.count("wake_up") == 1 and first.cancelled()


async def test_on_cpu_resting_is_a_no_op_that_says_so_once() -> None:
    log: list = []
    rester, scorer, said = _judged(log, sleeps=False)
    for _ in range(3):
        await rester.rest(2)
        await rester.wake_from_rest()
    assert [e[0] for e in log].count("sleep") == 0 and len(said) == 1 and "sleep mode" in said[0]
    assert (await scorer.score(_response(0))).error is None
    assert "wake_up" not in [e[0] for e in log]


async def test_a_judge_never_asked_since_it_slept_is_not_put_to_sleep_again() -> None:
    log: list = []
    rester, scorer, _ = _judged(log, level=1)
    await rester.rest(1)
    await rester.wake_from_rest()
    await rester.rest(1)  # no verdict went to this engine: it still sleeps
    judge = scorer.engine
    assert isinstance(judge, VLLMJudge)
    assert [e[0] for e in log].count("sleep") == 1 and judge.rest.state is RestState.ASLEEP
    assert (await scorer.score(_response(0))).error is None
    await rester.rest(1)
    assert [e[0] for e in log].count("sleep") == 2


async def test_a_judge_with_requests_in_flight_refuses_to_sleep() -> None:
    rester, _, _ = _judged([], busy=3)
    with pytest.raises(RuntimeError, match="cannot sleep with 3 requests in flight"):
        await rester.rest(2)


def test_without_a_judge_the_fleet_rests_alone() -> None:
    fleet = _Fleet([], 2)
    assert with_judge(fleet, None, print) is fleet
    judge = JudgeScorer(SETTINGS)
    assert isinstance(with_judge(fleet, judge, print), FleetAndJudge)
