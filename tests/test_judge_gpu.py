"""The judge's GPU branch without a GPU: its engine arguments against vLLM 0.32's
signatures and config dataclasses (prefetch offload, memory share, sleep mode, the
log-prob settings), and its rest with the fleet around training on a fake engine whose
every call is bound to AsyncLLM's signature."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rpk.core.records import Prompt, Response
from rpk.engine.vllm_engine import VLLMSettings, engine_kwargs
from rpk.reward.judge import JudgeScorer, JudgeSettings
from rpk.judge.vllm import (
    FleetAndJudge, JudgeDevice, VLLMJudge, judge_vllm_settings, offloaded_by, pooling_kwargs,
    prefetch_groups, with_judge,
)
from tests.fakes import SignedLLM

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
    judge = VLLMJudge(_Engine(_SignedLLM([]), sleeps=True), _Tokenizer(), SETTINGS, owned=False)
    params = judge.sampling_params()
    assert params.logprob_token_ids == [1, 2] and params.max_tokens == 1 and params.temperature == 1.0


def test_a_reward_model_runs_on_the_pooling_runner_without_sampling_settings() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = pooling_kwargs(judge_vllm_settings(SETTINGS, Path("/m"), 0, DEVICE), cuda=True)
    assert kwargs["runner"] == "pooling" and "logprobs_mode" not in kwargs
    inspect.signature(AsyncEngineArgs).bind(**kwargs)


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


class _SignedLLM(SignedLLM):
    """A `SignedLLM` that tracks whether it is awake, with `busy` requests in flight;
    `generate` answers a verdict with the yes/no log-probs."""

    def __init__(self, log: list, busy: int = 0) -> None:
        super().__init__(log)
        self.busy = busy
        self.awake = True

    async def sleep(self, *a: Any, **k: Any) -> None:
        await super().sleep(*a, **k)
        self.awake = False

    async def wake_up(self, *a: Any, **k: Any) -> bool:
        self._call("wake_up", *a, **k)
        await asyncio.sleep(0.01)  # long enough for a second request to arrive meanwhile
        self.awake = True
        return True

    def get_num_unfinished_requests(self) -> int:
        return self.busy

    async def generate(self, prompt: Any, params: Any, request_id: str):
        self._call("generate", prompt, params, request_id)
        assert self.awake, "a verdict asked of a sleeping judge"
        logprobs = {1: SimpleNamespace(logprob=-0.1), 2: SimpleNamespace(logprob=-2.0)}
        yield SimpleNamespace(outputs=[SimpleNamespace(text="Y", logprobs=[logprobs])])


class _Engine:
    def __init__(self, llm: _SignedLLM, sleeps: bool) -> None:
        self.llm = llm
        self.settings = VLLMSettings(model="judge", enable_sleep_mode=sleeps)


class _Tokenizer:
    ids = {"Y": 1, "N": 2}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.ids.get(text, 3)]}

    def apply_chat_template(self, messages: list, tokenize: bool, add_generation_prompt: bool) -> str:
        return "chat"


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


def _judged(log: list, sleeps: bool = True, level: int = 2, busy: int = 0):
    llm = _SignedLLM(log, busy)
    scorer = JudgeScorer(SETTINGS, VLLMJudge(_Engine(llm, sleeps), _Tokenizer(), SETTINGS, owned=False))
    said: list[str] = []
    return FleetAndJudge(_Fleet(log, level), scorer, said.append), scorer, said


@pytest.mark.parametrize("level", [1, 2])
async def test_the_judge_sleeps_with_the_fleet_and_wakes_when_next_asked(level: int) -> None:
    log: list = []
    rester, scorer, said = _judged(log, level=level)
    await rester.rest(rester.rest_level)
    assert rester.resting == level
    assert [e[0] for e in log] == ["fleet.rest", "sleep"] and log[1][2] == {"level": level}
    await rester.wake_from_rest()
    assert "wake_up" not in [e[0] for e in log]  # not until the judge is asked
    # Two verdicts asked at once: one wake; at level 2 the weights come back from disk.
    scored = await asyncio.gather(scorer.score(_response(0)), scorer.score(_response(1)))
    assert [s.error for s in scored] == [None, None] and scored[0].reward > 0.5
    calls = [e[0] for e in log]
    assert calls.count("wake_up") == 1 and log[calls.index("wake_up")][2] == {"tags": None}
    reloads = [e for e in log if e[0] == "collective_rpc"]
    assert reloads == ([("collective_rpc", ("reload_weights",), {})] if level == 2 else [])
    assert calls.index("wake_up") < calls.index("generate")
    # Awake again: the next verdict wakes nothing.
    await scorer.score(_response(2))
    assert [e[0] for e in log].count("wake_up") == 1 and not said


async def test_a_request_that_times_out_while_the_judge_wakes_does_not_cancel_the_wake() -> None:
    log: list = []
    rester, scorer, _ = _judged(log)
    await rester.rest(2)
    judge = scorer.engine
    first = asyncio.ensure_future(judge.judge([{"role": "user", "content": "q"}], "a"))
    await asyncio.sleep(0)  # the wake has started
    first.cancel()
    reading = await judge.judge([{"role": "user", "content": "q"}], "b")
    assert reading.yes_logprob == -0.1
    calls = [e[0] for e in log]
    assert calls.count("wake_up") == 1 and calls.count("collective_rpc") == 1 and first.cancelled()


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
    assert [e[0] for e in log].count("sleep") == 1 and scorer.engine.rest.level == 1
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
