"""The judge on every rollout GPU (rpk.judge.pool.JudgePool and JudgePlan, rpk.assembly.box.judge_plan): the routing
over the engines, their start, rest and death, and the per-GPU engines the build starts
from the memory plan, checked against vLLM's signatures (no GPU here)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rpk.assembly import box
from rpk.assembly.dry_run import dry_run
from rpk.assembly.settings import judge_tier
from rpk.config import ConfigError, from_argv
from rpk.core.backoff import Backoff
from rpk.core.records import Prompt, Response
from rpk.engine.vllm_settings import engine_kwargs
from rpk.gpu.plan import Target, explain
from rpk.judge.cache import CachedJudge, unwrap
from rpk.judge.pool import EngineState, JudgePool, least_loaded, start_pool
from rpk.judge.rest import EngineRest, RestState, with_judge
from rpk.judge.tier import start_tier
from rpk.judge.vllm import VLLMJudge, judge_vllm_settings, offloaded_by, prefetch_groups
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeScorer, JudgeSettings, Reading

MODELS = Path(__file__).parent / "fixtures" / "models"
ASKED = JudgeRequest((("user", "is {response} right?"),), (("response", "4"),))


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


async def test_an_engine_that_cannot_restart_stops_the_run_in_one_line_naming_every_gpu() -> None:
    log: list = []
    pool = JudgePool([_FakeJudge(log, "g0", dies=True), _FakeJudge(log, "g1")], ["GPU 0", "GPU 1"])
    scorer = JudgeScorer(JudgeSettings(model="j"), pool)
    with pytest.raises(JudgeDied) as e:
        await scorer.score(_response(0))
    assert str(e.value) == ("judge engine 0 of 2 (GPU 0): the judge g0 died: EngineDeadError; it cannot be "
                            "restarted [gone: GPU 0; live: GPU 1]")
    assert [(m.load, m.state) for m in pool.members] == [(0, EngineState.GONE), (0, EngineState.LIVE)]
    with pytest.raises(JudgeDied, match="GPU 0"):  # every later verdict too
        await pool.judge(ASKED, "again")


class _Mortal:
    """A judge engine whose verdicts wait for `gate` (None: answer at once) and that can
    be killed: its verdicts in flight and every later one then raise JudgeDied."""

    def __init__(self, name: str, gate: asyncio.Event | None = None) -> None:
        self.name, self.gate = name, gate
        self.can_sleep = True
        self.asked: list[str] = []
        self.dead = asyncio.Event()
        self.closed = False
        self.slept = 0
        self.woken = 0

    def kill(self) -> None:
        self.dead.set()

    async def ready(self) -> None:
        if self.dead.is_set():
            raise JudgeDied(f"the judge {self.name} died while waking: EngineDeadError")
        self.woken += 1

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        self.asked.append(request_id)
        if self.gate is not None and not self.dead.is_set():
            dead = asyncio.ensure_future(self.dead.wait())
            opened = asyncio.ensure_future(self.gate.wait())
            await asyncio.wait([dead, opened], return_when=asyncio.FIRST_COMPLETED)
            dead.cancel()
            opened.cancel()
        if self.dead.is_set():
            raise JudgeDied(f"the judge {self.name} died: EngineDeadError")
        return Reading(yes_logprob=0.0, no_logprob=-10.0)

    async def sleep(self) -> None:
        if self.dead.is_set():
            raise JudgeDied(f"the judge {self.name} died: EngineDeadError")
        self.slept += 1

    async def aclose(self) -> None:
        self.closed = True


class _Relauncher:
    """Starts `_Mortal`s named after the place, once `go` is set (None: at once); the
    first `fails` starts fail."""

    def __init__(self, name: str, go: asyncio.Event | None = None, fails: int = 0) -> None:
        self.name, self.go, self.fails = name, go, fails
        self.calls = 0
        self.started: list[_Mortal] = []
        self.closed_before: list[bool] = []

    async def __call__(self, dead: Any) -> _Mortal:
        self.calls += 1
        await dead.aclose()
        self.closed_before.append(dead.closed)
        if self.go is not None:
            await self.go.wait()
        if self.calls <= self.fails:
            raise RuntimeError(f"vLLM failed to start on {self.name}")
        engine = _Mortal(f"{self.name}'{self.calls}")
        self.started.append(engine)
        return engine


FAST = Backoff(limit=3, backoff_s=0.0)


async def _until(check: Any, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"never: {what}")


async def test_a_dead_engine_is_restarted_while_the_others_serve_and_its_verdicts_are_asked_again() -> None:
    gate, go = asyncio.Event(), asyncio.Event()
    g0, g1 = _Mortal("g0", gate), _Mortal("g1")
    lines: list[str] = []
    relaunch = _Relauncher("g0", go)
    pool = JudgePool([g0, g1], ["GPU 0", "GPU 1"], relaunch=[relaunch, None], restarts=FAST, log=lines.append)
    scorer = JudgeScorer(JudgeSettings(model="j", max_concurrency=8), pool)
    held = asyncio.create_task(scorer.score(_response(0)))  # goes to g0 and waits there
    await _until(lambda: g0.asked, "g0 got a verdict")
    g0.kill()
    assert (await held).error is None and g1.asked == ["judge-1-q0/0"]  # asked again of g1
    assert [m.state for m in pool.members] == [EngineState.DOWN, EngineState.LIVE] and relaunch.closed_before == [True]
    # While g0 restarts, every verdict goes to g1.
    scored = await asyncio.gather(*(scorer.score(_response(i)) for i in range(1, 5)))
    assert all(s.error is None for s in scored) and len(g1.asked) == 5 and g0.asked == ["judge-1-q0/0"]
    go.set()
    await _until(lambda: pool.members[0].state is EngineState.LIVE, "g0 rejoined")
    back = relaunch.started[0]
    assert pool.engines[0] is back
    await asyncio.gather(*(scorer.score(_response(i)) for i in range(5, 9)))
    assert back.asked, "the restarted engine serves again"
    metrics = scorer.metrics()
    assert (metrics["reward_judge_restarts"], metrics["reward_judge_restarts_total"]) == (1.0, 1.0)
    assert metrics["reward_judge_engines_live"] == 2.0
    assert scorer.metrics()["reward_judge_restarts"] == 0.0  # counted in its step alone
    assert [line.split(";")[0] for line in lines] == [
        "judge: judge engine 0 of 2 (GPU 0): the judge g0 died: EngineDeadError",
        "judge: engine 0 (GPU 0) is back (1 of 3 restarts used), live: GPU 0, GPU 1"]
    await pool.aclose()
    assert back.closed and g1.closed


async def test_with_every_engine_down_a_verdict_waits_for_the_first_back_within_its_timeout() -> None:
    go = asyncio.Event()
    only = _Mortal("cpu")
    relaunch = _Relauncher("cpu", go)
    pool = JudgePool([only], ["this process"], relaunch=[relaunch], restarts=FAST)
    only.kill()
    quick = JudgeScorer(JudgeSettings(model="j", timeout_s=0.05), pool)
    late = await quick.score(_response(0))  # the restart outlasts this verdict's timeout
    assert late.error is not None and quick.failures["judge_timeout"] == 1
    waiting = asyncio.create_task(JudgeScorer(JudgeSettings(model="j"), pool).score(_response(1)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    go.set()
    assert (await waiting).error is None and relaunch.started[0].asked == ["judge-1-q1/0"]
    await pool.aclose()


async def test_spent_restarts_stop_the_run_in_one_line_naming_every_gpu() -> None:
    g0, g1 = _Mortal("g0"), _Mortal("g1")
    relaunch = _Relauncher("g0", fails=10)
    pool = JudgePool([g0, g1], ["GPU 0", "GPU 1"], relaunch=[relaunch, None],
                     restarts=Backoff(limit=2, backoff_s=0.0))
    pool._last = 1  # the next verdict goes to g0
    g0.kill()
    assert (await pool.judge(ASKED, "r0")) is not None  # asked again of g1
    await _until(lambda: pool.members[0].state is EngineState.GONE, "g0 gave up")
    assert relaunch.calls == 2
    with pytest.raises(JudgeDied) as e:
        await pool.judge(ASKED, "r1")
    assert str(e.value) == ("judge engine 0 of 2 (GPU 0) stays dead: its restart failed: RuntimeError: vLLM "
                            "failed to start on g0; its restarts are spent (reward.judge.restarts=2) "
                            "[gone: GPU 0; live: GPU 1]")
    await pool.aclose()


async def test_an_engine_that_keeps_dying_uses_up_its_restarts_then_stops_the_run() -> None:
    class Doomed(_Relauncher):
        async def __call__(self, dead: Any) -> _Mortal:
            engine = await super().__call__(dead)
            engine.kill()  # up, and dead again at its first verdict
            return engine

    relaunch = Doomed("g0")
    pool = JudgePool([_Mortal("g0")], ["GPU 0"], relaunch=[relaunch], restarts=Backoff(limit=2, backoff_s=0.0))
    pool.engines[0].kill()
    with pytest.raises(JudgeDied, match=r"GPU 0\): the judge g0'2 died: EngineDeadError; its restarts are spent "
                                        r"\(2 of reward.judge.restarts=2\) \[gone: GPU 0\]"):
        await pool.judge(ASKED, "r0")
    assert relaunch.calls == 2 and pool.restarted == 2
    await pool.aclose()


async def test_no_restart_starts_while_the_pool_rests_and_a_dead_engine_does_not_stop_the_rest() -> None:
    g0, g1 = _Mortal("g0"), _Mortal("g1")
    relaunch = _Relauncher("g0")
    pool = JudgePool([g0, g1], ["GPU 0", "GPU 1"], relaunch=[relaunch, None], restarts=FAST)
    g0.kill()
    await pool.sleep()  # the trainer takes the GPUs: g0's death is found, not raised
    assert pool.members[0].state is EngineState.DOWN and g1.slept == 1
    await asyncio.sleep(0.02)
    assert relaunch.calls == 0, "no start while the pool rests"
    await pool.ready()  # the fleet is awake again: the live engines wake together
    assert g1.woken == 1
    await pool.judge(ASKED, "r0")
    await _until(lambda: pool.members[0].state is EngineState.LIVE, "g0 rejoined")
    await pool.aclose()


async def _mid_restart() -> tuple[JudgePool, _Relauncher, asyncio.Event, _Mortal, _Mortal]:
    """A pool of two whose g0 died at a verdict and is being restarted, held at `go`."""
    go = asyncio.Event()
    g0, g1 = _Mortal("g0"), _Mortal("g1")
    relaunch = _Relauncher("g0", go)
    pool = JudgePool([g0, g1], ["GPU 0", "GPU 1"], relaunch=[relaunch, None], restarts=FAST)
    pool._last = 1
    g0.kill()
    await pool.judge(ASKED, "r0")
    await _until(lambda: relaunch.calls == 1, "the restart began")
    return pool, relaunch, go, g0, g1


async def test_an_engine_restarted_while_the_pool_went_to_rest_sleeps_before_it_rejoins() -> None:
    pool, relaunch, go, g0, g1 = await _mid_restart()
    await pool.sleep()  # the trainer takes the GPUs mid-start
    go.set()
    await _until(lambda: pool.members[0].state is EngineState.LIVE, "g0 rejoined")
    assert relaunch.started[0].slept == 1 and g1.slept == 1
    await pool.aclose()


async def test_an_engine_that_dies_waking_is_restarted_and_the_others_wake_and_serve() -> None:
    g0, g1 = _Mortal("g0"), _Mortal("g1")
    relaunch = _Relauncher("g0")
    lines: list[str] = []
    pool = JudgePool([g0, g1], ["GPU 0", "GPU 1"], relaunch=[relaunch, None], restarts=FAST, log=lines.append)
    await pool.sleep()
    assert (g0.slept, g1.slept) == (1, 1)
    g0.kill()
    scorer = JudgeScorer(JudgeSettings(model="j"), pool)
    assert (await scorer.score(_response(0))).error is None  # ready: g0 dies waking, g1 wakes
    assert g1.woken == 1 and g1.asked == ["judge-1-q0/0"] and not g0.asked
    assert lines[0].startswith("judge: judge engine 0 of 2 (GPU 0): the judge g0 died while waking")
    await _until(lambda: pool.members[0].state is EngineState.LIVE, "g0 rejoined")
    await pool.aclose()


async def test_each_vote_is_a_request_of_its_own_on_the_least_loaded_engine() -> None:
    gate = asyncio.Event()
    engines = [_Mortal(f"g{i}", gate) for i in range(2)]
    pool = JudgePool(engines, ["GPU 0", "GPU 1"])
    scorer = JudgeScorer(JudgeSettings(model="j", verdict="score", votes=3, max_concurrency=2), pool)
    tasks = [asyncio.create_task(scorer.score(_response(i))) for i in range(2)]
    await _until(lambda: sum([m.load for m in pool.members]) == 6, "six votes in flight")
    assert [m.load for m in pool.members] == [3, 3]  # 2 verdicts x 3 votes, spread evenly
    gate.set()
    await asyncio.gather(*tasks)
    assert sorted(engines[0].asked + engines[1].asked) == sorted(
        f"judge-{k}-q{i}/0#{v}" for k, i in ((1, 0), (2, 1)) for v in range(3))
    await pool.aclose()


async def test_closing_the_pool_mid_restart_cancels_it_and_stops_every_engine() -> None:
    pool, relaunch, go, g0, g1 = await _mid_restart()
    await pool.aclose()
    assert not pool._tasks and g1.closed and not relaunch.started
    assert [m.state for m in pool.members] == [EngineState.CLOSED, EngineState.CLOSED]


def test_restart_waits_double_up_to_a_cap_and_states_reject_illegal_moves() -> None:
    r = Backoff(limit=5, backoff_s=2.0, max_backoff_s=10.0)
    assert [r.delay(k) for k in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 10.0]
    assert all(r.delay(k) / 2 <= r.jittered(k) <= r.delay(k) for k in (1, 2, 3, 4) for _ in range(50))
    with pytest.raises(ValueError, match="limit >= 0"):
        Backoff(limit=-1)
    assert EngineState.DOWN.can_become(EngineState.LIVE) and not EngineState.GONE.can_become(EngineState.LIVE)
    assert not EngineState.CLOSED.can_become(EngineState.DOWN)


class _DeadLLM:
    """What vLLM's AsyncLLM answers once its engine core is gone."""

    errored = True
    dead_error = "EngineCore encountered an issue"

    def get_num_unfinished_requests(self) -> int:
        return 0


async def test_a_sleep_or_wake_on_a_dead_vllm_engine_is_judge_died_not_vllms_error() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    def judge_on(llm: Any) -> VLLMJudge:
        # The engine's death checks alone: no model, no tokenizer.
        judge = VLLMJudge.__new__(VLLMJudge)
        judge.engine, judge.name = SimpleNamespace(llm=llm), "the judge m"
        judge.rest = EngineRest(llm, can_sleep=True, name=judge.name)
        return judge

    with pytest.raises(JudgeDied, match="the judge m died: EngineCore encountered an issue"):
        await judge_on(_DeadLLM()).sleep()

    class Dying(_DeadLLM):
        errored = False

        async def sleep(self, level: int) -> None:
            raise EngineDeadError()

        async def wake_up(self, tags: Any = None) -> None:
            raise EngineDeadError()

    dying = judge_on(Dying())
    with pytest.raises(JudgeDied, match="the judge m died while going to sleep"):
        await dying.sleep()
    dying.rest.state = RestState.ASLEEP
    with pytest.raises(JudgeDied, match="the judge m died while waking"):
        await dying.ready()


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
    assert len(pool.engines) == 2 and [m.where for m in pool.members] == ["GPU 0", "GPU 1"]


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


async def test_the_launcher_starts_one_pinned_engine_per_gpu_and_restarts_a_dead_one_in_its_place(monkeypatch) -> None:
    _, b = _box()
    cfg = from_argv([*ARGV, "--reward.judge.restart_backoff_s", "0"])
    calls: list[dict] = []
    signature = inspect.signature(VLLMJudge.launch)

    async def launch(settings: JudgeSettings, **kwargs: Any) -> _Mortal:
        signature.bind(settings, **kwargs)  # what the real launch accepts
        calls.append(kwargs)
        return _Mortal(str(len(calls)))

    monkeypatch.setattr(VLLMJudge, "launch", launch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = JudgeSettings(model="j", max_concurrency=30)
    plan = box.judge_plan(cfg, b)
    tier = await start_tier(settings, tier=judge_tier(cfg.reward.judge), plan=plan, visible=None, node=None,
                            log=lambda line: None)
    assert isinstance(tier, CachedJudge)  # the verdict cache in front, on by default
    pool = unwrap(tier)
    assert isinstance(pool, JudgePool) and [m.where for m in pool.members] == [f"GPU {i}" for i in range(8)]
    assert [c["env"] for c in calls] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(8)]
    assert {c["device"].max_num_seqs for c in calls} == {4} and calls[0]["seed"] == cfg.run.seed
    assert not any(c["in_thread"] for c in calls)  # before the run: nothing else to keep going
    pool.engines[3].kill()
    pool._last = 2  # the next verdict goes to GPU 3's engine
    await pool.judge(ASKED, "r0")
    await _until(lambda: len(calls) == 9 and pool.members[3].state is EngineState.LIVE, "GPU 3's engine is back")
    assert calls[8]["env"] == {"CUDA_VISIBLE_DEVICES": "3"} and calls[8]["device"] == calls[3]["device"]
    assert calls[8]["in_thread"] is True  # its model loads while the others serve
    await tier.aclose()
    calls.clear()
    cpu_plan = box.judge_plan(cfg, box.resolve_box(cfg, {}, None))
    assert cpu_plan is not None
    cpu = await cpu_plan.launcher(None)(settings)
    assert isinstance(cpu, JudgePool) and [m.where for m in cpu.members] == ["this process"]  # one, restartable
    assert "device" not in calls[0] and "env" not in calls[0] and cpu.members[0].relaunch is not None
    off = from_argv([*ARGV, "--reward.judge.cache", "false"])
    uncached = await start_tier(settings, tier=judge_tier(off.reward.judge), plan=cpu_plan, visible=None, node=None,
                                log=lambda line: None)
    assert isinstance(uncached, JudgePool)
    await asyncio.gather(cpu.aclose(), uncached.aclose())
    line = plan.describe(None)
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
