"""The judge on every rollout GPU (rpk.judge.pool.JudgePool and JudgePlan, rpk.assembly.box.judge_plan): the routing
over the engines, their start, rest and death, and the per-GPU engines the build starts
from the memory plan, checked against vLLM's signatures (no GPU here)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from rpk.assembly import box
from rpk.assembly.dry_run import dry_run
from rpk.config import ConfigError, from_argv
from rpk.core.records import Prompt, Response
from rpk.engine.vllm_settings import engine_kwargs
from rpk.gpu.plan import Target, explain
from rpk.judge.pool import JudgePool, least_loaded, start_pool
from rpk.judge.rest import with_judge
from rpk.judge.vllm import VLLMJudge, judge_vllm_settings, offloaded_by, prefetch_groups
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeScorer, JudgeSettings, Reading

MODELS = Path(__file__).parent / "fixtures" / "models"


# -- routing ------------------------------------------------------------------------------


def test_least_loaded_takes_the_smallest_load_and_rotates_among_equals() -> None:
    assert least_loaded([3, 1, 2], after=-1) == 1
    assert [least_loaded([0, 0, 0], after=a) for a in (-1, 0, 1, 2)] == [0, 1, 2, 0]
    assert least_loaded([1, 0, 0, 1], after=1) == 2 and least_loaded([1, 0, 0, 1], after=2) == 1
    with pytest.raises(ValueError, match="no judge engines"):
        least_loaded([], after=0)


class _FakeJudge:
    def __init__(self, log: list, name: str, gate: asyncio.Event | None = None, dies: bool = False) -> None:
        self.log, self.name, self.gate, self.dies = log, name, gate, dies
        self.can_sleep = True
        self.in_flight = 0
        self.peak = 0

    async def ready(self) -> None:
        self.log.append((self.name, "ready"))

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.dies:
                raise JudgeDied(f"the judge {self.name} died: EngineDeadError")
            if self.gate is not None:
                await self.gate.wait()
            self.log.append((self.name, request_id))
            return Reading(yes_logprob=0.0, no_logprob=-10.0)
        finally:
            self.in_flight -= 1

    async def sleep(self) -> None:
        self.log.append((self.name, "sleep"))

    async def aclose(self) -> None:
        self.log.append((self.name, "closed"))


def _response(i: int) -> Response:
    return Response(Prompt(f"q{i}", (1,), "qa", "4"), 0, (5,), (-0.1,), "stop", 0, text="4")


async def test_the_scorer_cap_spreads_evenly_no_engine_holds_more_than_its_share() -> None:
    gate, log = asyncio.Event(), []
    engines = [_FakeJudge(log, f"g{i}", gate) for i in range(3)]
    scorer = JudgeScorer(JudgeSettings(model="j", max_concurrency=7), JudgePool(engines, ["GPU 0", "GPU 1", "GPU 2"]))
    tasks = [asyncio.create_task(scorer.score(_response(i))) for i in range(20)]
    await asyncio.sleep(0.01)
    assert [e.in_flight for e in engines] == [3, 2, 2]  # 7 in flight: ceil(7 / 3) at most each
    gate.set()
    scored = await asyncio.gather(*tasks)
    verdicts = [e for e in log if e[1] != "ready"]
    assert all(s.error is None for s in scored) and len(verdicts) == 20
    assert max(e.peak for e in engines) == 3 and {n for n, _ in verdicts} == {"g0", "g1", "g2"}


async def test_one_engine_dying_stops_the_run_in_one_line_naming_its_gpu() -> None:
    log: list = []
    pool = JudgePool([_FakeJudge(log, "g0", dies=True), _FakeJudge(log, "g1")], ["GPU 0", "GPU 1"])
    scorer = JudgeScorer(JudgeSettings(model="j"), pool)
    with pytest.raises(JudgeDied) as e:
        await scorer.score(_response(0))
    assert str(e.value) == "judge engine 0 of 2 (GPU 0): the judge g0 died: EngineDeadError"
    assert pool.loads == [0, 0]


class _Fleet:
    rest_level, resting = 1, None

    def __init__(self, log: list) -> None:
        self.log = log

    async def rest(self, level: int) -> None:
        self.log.append(("fleet", f"rest {level}"))

    async def wake_from_rest(self) -> None:
        self.log.append(("fleet", "wake"))


async def test_every_engine_rests_with_the_fleet() -> None:
    log: list = []
    scorer = JudgeScorer(JudgeSettings(model="j"), JudgePool([_FakeJudge(log, "g0"), _FakeJudge(log, "g1")],
                                                             ["GPU 0", "GPU 1"]))
    await with_judge(_Fleet(log), scorer, log.append).rest(2)
    # At level 1 whatever the fleet's level: the judge's own rest (rpk.judge.rest).
    assert log == [("fleet", "rest 2"), ("g0", "sleep"), ("g1", "sleep")]


async def test_a_failed_start_stops_the_engines_already_started_newest_first() -> None:
    log: list = []

    async def fails() -> Any:
        raise RuntimeError("vLLM failed to start on GPU 2")

    def ok(name: str) -> Any:
        async def launch() -> _FakeJudge:
            return _FakeJudge(log, name)
        return launch

    with pytest.raises(RuntimeError, match="GPU 2"):
        await start_pool([ok("g0"), ok("g1"), fails, ok("g3")], ["GPU 0", "GPU 1", "GPU 2", "GPU 3"])
    assert log == [("g1", "closed"), ("g0", "closed")]
    pool = await start_pool([ok("g0"), ok("g1")], ["GPU 0", "GPU 1"])
    assert len(pool.engines) == 2 and pool.where == ["GPU 0", "GPU 1"]


# -- the per-GPU engines the build starts from the plan -----------------------------------

ARGV = ["--model.path", str(MODELS / "qwen2.5-14b"), "--rollout.max_tokens", "16384",
        "--reward.judge.model", str(MODELS / "qwen2.5-7b"), "--reward.judge.max_concurrency", "30"]


def _box() -> tuple[Any, Any]:
    cfg = from_argv(ARGV)
    hf = json.loads((MODELS / "qwen2.5-14b" / "config.json").read_text())
    judge_hf = json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text())
    target = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9, host_bytes=2 * 10**12)
    return cfg, box.resolve_box(cfg, hf, target, judge_hf)


def test_the_build_places_a_judge_engine_on_every_rollout_gpu_as_the_plan_prices_it() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    cfg, b = _box()
    places = box.judge_plan(cfg, b).places(visible="4,5,6,7,8,9,10,11")
    assert [p.gpu for p in places] == list(range(8))
    assert [p.env for p in places] == [{"CUDA_VISIBLE_DEVICES": str(4 + i)} for i in range(8)]
    d = places[0].device
    plan = explain.judge_dict(b.memory)  # what the dry run prints for the same plan
    assert d.max_num_seqs == plan["engine_args"]["max_num_seqs"] == 4  # ceil(30 / 8)
    assert d.max_model_len == plan["engine_args"]["max_model_len"]
    assert d.gpu_memory_utilization == plan["engine_args"]["gpu_memory_utilization"]
    assert d.offloaded == plan["offloaded_layers"] > 0 and d.layers == 28
    kwargs = engine_kwargs(judge_vllm_settings(JudgeSettings(model="j", max_concurrency=30), Path("/m"), 0, d),
                           cuda=True)
    assert set(kwargs) <= set(inspect.signature(AsyncEngineArgs).parameters)
    assert (kwargs["max_num_seqs"], kwargs["max_model_len"]) == (4, d.max_model_len)
    groups = prefetch_groups(d.layers, d.offloaded, d.prefetch_step)
    assert groups is not None and offloaded_by(groups.group_size, groups.num_in_group, 28) == d.offloaded


def test_on_cpu_there_are_no_gpu_places_and_on_gpus_a_judge_outside_the_plan_is_refused() -> None:
    cfg = from_argv(["--reward.judge.model", str(MODELS / "qwen2.5-7b")])
    plan = box.judge_plan(cfg, box.resolve_box(cfg, {}, None))
    assert plan is not None and plan.device is None and plan.places(None) == []
    # A judge on the GPUs the memory plan does not price would start at vLLM's defaults
    # (0.9 of GPU 0, no sleep mode) beside the rollout: refused before anything starts.
    cfg, b = _box()
    with pytest.raises(ConfigError, match="the memory plan has no judge"):
        box.judge_plan(cfg, dataclasses.replace(b, memory=dataclasses.replace(b.memory, judge=None)))


async def test_the_launcher_starts_one_pinned_engine_per_gpu_with_vllm_judges_arguments(monkeypatch) -> None:
    cfg, b = _box()
    calls: list[dict] = []
    signature = inspect.signature(VLLMJudge.launch)

    async def launch(settings: JudgeSettings, **kwargs: Any) -> _FakeJudge:
        signature.bind(settings, **kwargs)  # what the real launch accepts
        calls.append(kwargs)
        return _FakeJudge([], str(len(calls)))

    monkeypatch.setattr(VLLMJudge, "launch", launch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = JudgeSettings(model="j", max_concurrency=30)
    pool = await box.judge_plan(cfg, b).launcher(None)(settings)
    assert isinstance(pool, JudgePool) and pool.where == [f"GPU {i}" for i in range(8)]
    assert [c["env"] for c in calls] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(8)]
    assert {c["device"].max_num_seqs for c in calls} == {4} and calls[0]["seed"] == cfg.run.seed
    calls.clear()
    cpu_plan = box.judge_plan(cfg, box.resolve_box(cfg, {}, None))
    assert cpu_plan is not None
    cpu = await cpu_plan.launcher(None)(settings)
    assert isinstance(cpu, _FakeJudge) and "device" not in calls[0] and "env" not in calls[0]
    line = box.judge_plan(cfg, b).describe(None)
    assert line.startswith(f"judge: {MODELS / 'qwen2.5-7b'} (logprob verdicts)")
    assert "GPUs [0, 1, 2, 3, 4, 5, 6, 7]" in line and "max_num_seqs 4" in line


def test_the_dry_run_lists_the_judge_engine_each_gpu_gets(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h")
    cfg = from_argv([*ARGV, "--dist.gpus", "8", "--dist.gpu_mem_gb", "80"])
    d = dry_run(cfg, MODELS / "qwen2.5-14b", cuda=(0, 0))
    engines = d["judges"]
    assert [e["env"] for e in engines] == [{"CUDA_VISIBLE_DEVICES": f"GPU-{c}"} for c in "abcdefgh"]
    planned = d["plan"]["judge"]["engine_args"]
    for e in engines:
        args = e["engine_args"]
        assert {k: args[k] for k in ("max_num_seqs", "max_model_len", "gpu_memory_utilization")} == {
            k: planned[k] for k in ("max_num_seqs", "max_model_len", "gpu_memory_utilization")}
        assert args["offload_backend"] == "prefetch" and args["enable_sleep_mode"] is True
    assert "judges" not in dry_run(from_argv(ARGV), MODELS / "qwen2.5-14b", cuda=(0, 0))
