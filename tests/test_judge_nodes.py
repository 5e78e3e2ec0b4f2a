"""The judge on every engine node (rpk.cluster.host_judges, rpk.cluster.remote_judge.RemoteJudge,
rpk.judge.pool): a host's judge routes over real aiohttp on 127.0.0.1 with scripted
judge engines in place of vLLM (verdicts, a timeout, a refused request, a dead engine, a
lost host, rest and stop), the controller's pool over local and remote judges, and the
launch placed once by the controller reaching the other node's host (no GPU here)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rpk.assembly import box
from rpk.assembly.dry_run import dry_run
from rpk.cluster import host
from rpk.cluster.host import HostService, UploadCaps, make_app, serve
from rpk.cluster.host_judges import NodeJudges, start_judges
from rpk.cluster.nodes import EngineSpec, host_command, remote_judges
from rpk.cluster.remote import HostClient
from rpk.cluster.remote_judge import RemoteJudge
from rpk.config import from_argv
from rpk.core.backoff import Backoff
from rpk.core.records import Prompt, Response
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.gpu.plan import Target
from rpk.judge.pool import EngineState, JudgePlan, JudgePool
from rpk.judge.vllm import VLLMJudge
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeScorer, JudgeSettings, Reading
from tests.replicas import TOKEN, ScriptReplica

MODELS = Path(__file__).parent / "fixtures" / "models"
ASKED = JudgeRequest((("user", "x"),), ())


class ScriptJudge:
    """Answers YES (log-prob 0 against -5) when the response block says 4, else NO; `mode`
    makes it hang, refuse the request or die instead."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.can_sleep = True
        self.asked: list[str] = []
        self.cancelled: list[str] = []
        self.slept = 0
        self.readied = 0
        self.closed = False

    async def ready(self) -> None:
        self.readied += 1

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        self.asked.append(request_id)
        if self.mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request_id)
                raise
        if self.mode == "refuse":
            raise ValueError("the prompt is 9000 tokens, max_model_len 8192")
        if self.mode == "die":
            raise JudgeDied(f"the judge {self.name} died: EngineDeadError")
        yes = 0.0 if "<response>\n4\n" in request.chat()[-1]["content"] else -5.0
        no = -5.0 if yes == 0.0 else 0.0
        return Reading(text="YES" if yes == 0.0 else "NO", yes_logprob=yes, no_logprob=no)

    async def sleep(self) -> None:
        self.slept += 1
        if self.mode == "die":
            raise JudgeDied(f"the judge {self.name} died asleep: EngineDeadError")
        if self.mode == "refuse":
            raise RuntimeError("sleep mode is off")

    async def aclose(self) -> None:
        self.closed = True


async def _one_judge(client: HostClient, **settings: Any) -> tuple[JudgeScorer, RemoteJudge]:
    """A scorer over the node's one judge, through the client, and that remote judge."""
    (remote,) = await remote_judges({1: client})
    return JudgeScorer(JudgeSettings(model="j", **settings), JudgePool([remote], [remote.where])), remote


@contextlib.asynccontextmanager
async def judging(*fakes: ScriptJudge, gpus: tuple[int, ...] = (), middleware: Any = None):
    """Node 1's host serving one scripted replica and `fakes` as its judges on `gpus`
    (with `middleware` in front of its routes)."""
    layouts = Layouts([Layout(1, ("tp1.0",), [ScriptReplica()], LayoutState.AWAKE)])
    service = HostService(1, layouts, max_live=16, heartbeat_s=0.05, caps=UploadCaps(max_bucket_bytes=2**20))
    judges = NodeJudges(1, fakes, gpus or tuple(range(4, 4 + len(fakes))))
    app = make_app(service, TOKEN, judges)
    if middleware is not None:
        app.middlewares.insert(0, middleware)
    runner, port = await serve(app, "127.0.0.1", 0)
    client = HostClient(1, f"http://127.0.0.1:{port}", TOKEN)
    try:
        yield judges, client, runner
    finally:
        await client.close()
        await runner.cleanup()


def _response(i: int, text: str) -> Response:
    return Response(Prompt(f"q{i}", (1,), "qa", "4"), 0, (5,), (-0.1,), "stop", 0, text=text)


async def test_remote_judges_give_verdicts_and_the_pool_spans_local_and_remote_engines() -> None:
    local, far = ScriptJudge("local"), ScriptJudge("far")
    async with judging(far, gpus=(5,)) as (judges, client, _):
        (remote,) = await remote_judges({1: client})
        assert (remote.index, remote.gpu, remote.where, remote.can_sleep) == (0, 5, "node 1 GPU 5", True)
        pool = JudgePool([local], ["node 0 GPU 5"])
        pool.join([remote], [remote.where])
        scorer = JudgeScorer(JudgeSettings(model="j"), pool)
        scored = await asyncio.gather(*(scorer.score(_response(i, "4" if i % 2 else "5")) for i in range(6)))
        assert [s.correct for s in scored] == [i % 2 == 1 for i in range(6)]
        assert all(s.error is None for s in scored) and scorer.judged == 6
        # The local fake answers without waiting, so it is the least loaded again at once;
        # the remote one took the verdict asked while the first was in flight.
        assert len(local.asked) + len(far.asked) == 6 and far.asked == ["judge-2-q1/0"]
        assert judges.judged == [1] and judges.describe()[0]["state"] == "awake"
        with pytest.raises(ValueError, match="1 judge engines for 2 places"):
            pool.join([remote], ["a", "b"])


async def test_the_build_joins_every_hosts_judges_to_node_0s_pool() -> None:
    from rpk.assembly import start

    said: list[str] = []
    async with judging(ScriptJudge("a"), ScriptJudge("b"), gpus=(0, 1)) as (judges, client, _):
        scorer = JudgeScorer(JudgeSettings(model="j"), JudgePool([ScriptJudge("local")], ["node 0 GPU 0"]))
        await start._join_judges(scorer, {1: client}, said.append)
        pool = scorer.engine
        assert isinstance(pool, JudgePool)
        assert [m.where for m in pool.members] == ["node 0 GPU 0", "node 1 GPU 0", "node 1 GPU 1"]
        assert [m.load for m in pool.members] == [0, 0, 0] and said == ["judge: 2 more engines on nodes [1], 3 in all"]
    async with judging(ScriptJudge("a"), ScriptJudge("b"), gpus=(0, 1)) as (judges, client, _):
        single = JudgeScorer(JudgeSettings(model="j"), ScriptJudge("cpu"))
        with pytest.raises(RuntimeError, match="serve 2 judge engines, but node 0's judge is"):
            await start._join_judges(single, {1: client}, said.append)
        assert judges.state == ["stopped", "stopped"] and client.users == 0  # unjoined, stopped


async def test_a_timeout_costs_the_sample_and_aborts_the_request_on_the_host() -> None:
    hang = ScriptJudge("hang", mode="hang")
    async with judging(hang) as (_, client, _):
        scorer, _ = await _one_judge(client, timeout_s=0.3)
        scored = await scorer.score(_response(0, "4"))
        assert scored.error is not None and "no verdict within 0.3s" in scored.error
        assert scorer.failures["judge_timeout"] == 1
        for _ in range(100):  # the host sees the client leave and cancels the handler
            if hang.cancelled:
                break
            await asyncio.sleep(0.02)
        assert hang.cancelled == hang.asked and len(hang.asked) == 1


async def test_a_refused_request_costs_the_sample_alone() -> None:
    async with judging(ScriptJudge("r", mode="refuse")) as (judges, client, _):
        scorer, _ = await _one_judge(client)
        scored = await scorer.score(_response(0, "4"))
        assert scorer.failures["judge_engine"] == 1 and "9000 tokens" in str(scored.error)
        assert "node 1 judge engine 0 (GPU 4)" in str(scored.error) and judges.state == ["awake"]


async def test_a_dead_engine_stops_the_run_in_one_line_naming_node_and_gpu() -> None:
    async with judging(ScriptJudge("ok"), ScriptJudge("dead", mode="die"), gpus=(2, 3)) as (judges, client, _):
        remote = await remote_judges({1: client})
        pool = JudgePool(remote, [r.where for r in remote])
        pool._last = 0  # the next verdict goes to engine 1, the dying one
        scorer = JudgeScorer(JudgeSettings(model="j"), pool)
        with pytest.raises(JudgeDied) as e:
            await scorer.score(_response(0, "4"))
        assert str(e.value) == ("judge engine 1 of 2 (node 1 GPU 3): the judge on node 1 GPU 3 died: "
                                "node 1 judge engine 1 (GPU 3): the judge dead died: EngineDeadError; it "
                                "cannot be restarted [live: node 1 GPU 2; gone: node 1 GPU 3]")
        assert judges.state == ["awake", "dead"]
        with pytest.raises(JudgeDied, match="node 1 GPU 3 died: node 1 judge engine 1 .GPU 3. is dead"):
            await remote[1].judge(ASKED, "again")


async def test_a_dead_remote_engine_is_restarted_by_its_host_and_serves_again() -> None:
    dying, fresh = ScriptJudge("dying", mode="die"), ScriptJudge("fresh")
    relaunched: list[Any] = []

    async def relaunch(dead: Any) -> ScriptJudge:
        relaunched.append(dead)
        return fresh

    async with judging(ScriptJudge("ok"), dying, gpus=(2, 3)) as (judges, client, _):
        judges.relaunch = [None, relaunch]
        remote = await remote_judges({1: client})
        lines: list[str] = []
        pool = JudgePool(remote, [r.where for r in remote], relaunch=[r.restart for r in remote],
                         restarts=Backoff(limit=1, backoff_s=0.0), log=lines.append)
        pool._last = 0  # the next verdict goes to engine 1, the dying one
        scorer = JudgeScorer(JudgeSettings(model="j"), pool)
        assert (await scorer.score(_response(0, "4"))).correct  # asked again of GPU 2's
        for _ in range(200):
            if pool.members[1].state is EngineState.LIVE:
                break
            await asyncio.sleep(0.01)
        assert relaunched == [dying] and judges.engines[1] is fresh and judges.state[1] == "awake"
        assert judges.describe()[1]["restarts"] == 1 and pool.engines[1] is remote[1]
        await asyncio.gather(*(scorer.score(_response(i, "4")) for i in range(1, 5)))
        assert fresh.asked, "the restarted engine serves again"
        assert scorer.metrics()["reward_judge_restarts"] == 1.0
        assert "is back" in lines[-1] and "node 1 GPU 3" in lines[-1]
        with pytest.raises(Exception, match="HTTP 409.*cannot be restarted"):
            await client.call("POST", "/judges/0/restart")  # GPU 2's has no relaunch


async def test_a_remote_engine_found_dead_at_its_sleep_is_restarted_not_fatal() -> None:
    class DiesAtSleep(ScriptJudge):
        async def sleep(self) -> None:
            raise JudgeDied(f"the judge {self.name} died: EngineDeadError")

    fresh = ScriptJudge("fresh")

    async def relaunch(dead: Any) -> ScriptJudge:
        return fresh

    ok = ScriptJudge("ok")
    async with judging(ok, DiesAtSleep("dying"), gpus=(2, 3)) as (judges, client, _):
        judges.relaunch = [None, relaunch]
        remote = await remote_judges({1: client})
        pool = JudgePool(remote, [r.where for r in remote], relaunch=[r.restart for r in remote],
                         restarts=Backoff(limit=1, backoff_s=0.0))
        await pool.sleep()  # the fleet's rest: the dead one is found, the other sleeps
        assert judges.state[0] == "asleep" and ok.slept and pool.members[1].state is EngineState.DOWN
        scorer = JudgeScorer(JudgeSettings(model="j"), pool)
        assert (await scorer.score(_response(0, "4"))).correct
        for _ in range(200):
            if pool.members[1].state is EngineState.LIVE:
                break
            await asyncio.sleep(0.01)
        assert judges.engines[1] is fresh and judges.state[1] == "awake"


def _drop(times: int) -> Any:
    """A host middleware that closes the connection of the first `times` verdict
    requests without an answer, as a stale keep-alive socket fails."""
    dropped: list[str] = []

    @web.middleware
    async def drop(request: web.Request, handler: Any) -> Any:
        if request.path.endswith("/judge") and len(dropped) < times:
            dropped.append(request.path)
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        return await handler(request)

    drop.dropped = dropped  # type: ignore[attr-defined]
    return drop


async def test_a_dropped_connection_is_retried_once_on_a_fresh_one_and_the_verdict_arrives() -> None:
    drop = _drop(1)
    async with judging(ScriptJudge("ok"), middleware=drop) as (judges, client, _):
        scorer, remote = await _one_judge(client)
        scored = await scorer.score(_response(0, "4"))
        assert scored.error is None and scored.correct
        assert drop.dropped == ["/judges/0/judge"] and remote.retried == 1 and judges.judged == [1]


def _stale() -> Any:
    """A host middleware that, once armed, closes without an answer every verdict
    request arriving on a connection opened before: the host dropped its keep-alive
    sockets, and the client's pool still holds them all."""
    ports: set[int] = set()
    dropped: list[int] = []

    @web.middleware
    async def stale(request: web.Request, handler: Any) -> Any:
        assert request.transport is not None
        port = request.transport.get_extra_info("peername")[1]
        if stale.armed and request.path.endswith("/judge") and port in stale.old:  # type: ignore[attr-defined]
            dropped.append(port)
            request.transport.close()
            raise asyncio.CancelledError
        ports.add(port)
        return await handler(request)

    stale.ports, stale.dropped, stale.armed, stale.old = ports, dropped, False, set()  # type: ignore[attr-defined]
    return stale


async def test_the_retry_does_not_meet_the_pools_other_stale_sockets() -> None:
    """Two keep-alive sockets in the client's pool, both closed by the host: the retry
    on the pool would take the second and fail too; on a fresh connection it is served."""
    stale = _stale()
    async with judging(ScriptJudge("ok"), middleware=stale) as (judges, client, _):
        scorer, remote = await _one_judge(client)
        warm = await asyncio.gather(*(scorer.score(_response(i, "4")) for i in range(2)))
        assert all(s.error is None for s in warm) and len(stale.ports) == 2  # two pooled sockets
        stale.old, stale.armed = set(stale.ports), True
        scored = await scorer.score(_response(2, "4"))
        assert scored.error is None and scored.correct, scored.error
        assert len(stale.dropped) == 1 and remote.retried == 1 and judges.judged == [3]


async def test_two_failures_with_a_host_that_answers_its_probe_cost_the_sample_alone() -> None:
    drop = _drop(2)
    async with judging(ScriptJudge("ok"), middleware=drop) as (judges, client, _):
        scorer, _ = await _one_judge(client)
        scored = await scorer.score(_response(0, "4"))
        assert scorer.failures["judge_engine"] == 1 and "though its host answers" in str(scored.error)
        assert (await scorer.score(_response(1, "4"))).correct  # the judge is not dead


async def test_a_lost_host_is_the_judges_death_naming_node_gpu_and_address() -> None:
    async with judging(ScriptJudge("ok")) as (_, client, runner):
        (remote,) = await remote_judges({1: client})
        await runner.cleanup()
        with pytest.raises(JudgeDied) as e:
            await remote.judge(ASKED, "r0")
        assert f"the judge on node 1 GPU 4: its engine host {client.url} is lost" in str(e.value)


async def test_judges_rest_with_the_fleet_and_stop_with_the_run() -> None:
    a, b = ScriptJudge("a"), ScriptJudge("b")
    async with judging(a, b) as (judges, client, _):
        remote = await remote_judges({1: client})
        assert client.users == 2
        pool = JudgePool(remote, [r.where for r in remote])
        assert pool.can_sleep
        await pool.sleep()
        assert a.slept == b.slept == 1 and judges.state == ["asleep", "asleep"]
        # Woken once each for all the verdicts asked (outside their timeouts), on the
        # first verdict after the rest, then never again until the next rest.
        scorer = JudgeScorer(JudgeSettings(model="j"), pool)
        await asyncio.gather(*(scorer.score(_response(i, "4")) for i in range(4)))
        assert a.readied == b.readied == 1 and judges.state == ["awake", "awake"]
        await scorer.score(_response(5, "4"))
        assert a.readied == b.readied == 1
        await pool.aclose()
        assert a.closed and b.closed and judges.state == ["stopped", "stopped"] and client.users == 0
        await remote[0].aclose()  # twice: nothing more happens
        assert client.users == 0


async def test_the_judge_route_refuses_a_bad_body_or_engine_naming_them() -> None:
    async with judging(ScriptJudge("a")) as (_, client, _):
        for path, body, expect in [
            ("/judges/0/judge", {"request": "hi", "request_id": "r"}, "HTTP 400"),
            ("/judges/0/judge", [1, 2], "HTTP 400.*must be a JSON object, got list"),
            ("/judges/0/judge", {"request": {"messages": [["user"]], "fields": []}, "request_id": "r"},
             "HTTP 400.*'messages' and 'fields'"),
            ("/judges/7/judge", {"request": ASKED.to_dict(), "request_id": "r"},
             "no judge engine '7'; it has 1"),
        ]:
            with pytest.raises(Exception, match=expect):
                await client.call("POST", path, json=body)


async def test_a_judge_dying_asleep_is_gone_and_one_refusing_to_sleep_is_refused() -> None:
    async with judging(ScriptJudge("ok"), ScriptJudge("dead", mode="die"), ScriptJudge("awake", mode="refuse")) \
            as (judges, client, _):
        await client.call("POST", "/judges/0/sleep")
        with pytest.raises(Exception, match="HTTP 410.*the judge dead died asleep"):
            await client.call("POST", "/judges/1/sleep")
        with pytest.raises(Exception, match="HTTP 409.*sleep: RuntimeError: sleep mode is off"):
            await client.call("POST", "/judges/2/sleep")
        assert judges.state == ["asleep", "dead", "awake"]


async def test_a_host_without_a_judge_serves_none() -> None:
    layouts = Layouts([Layout(1, ("tp1.0",), [ScriptReplica()], LayoutState.AWAKE)])
    service = HostService(1, layouts, max_live=16, heartbeat_s=0.05, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    client = HostClient(1, f"http://127.0.0.1:{port}", TOKEN)
    try:
        assert await remote_judges({1: client}) == []
        assert (await start_judges("", 1, None, print)).engines == []
    finally:
        await client.close()
        await runner.cleanup()


# -- the launch, placed once by the controller, on the other node -------------------------

ARGV = ["--model.path", str(MODELS / "qwen2.5-14b"), "--rollout.max_tokens", "16384",
        "--reward.judge.model", str(MODELS / "qwen2.5-7b"), "--reward.judge.max_concurrency", "30"]


def _box(nodes: int) -> tuple[Any, Any]:
    cfg = from_argv(ARGV)
    hf = json.loads((MODELS / "qwen2.5-14b" / "config.json").read_text())
    judge_hf = json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text())
    target = Target(nodes=nodes, gpus_per_node=8, gpu_bytes=80 * 10**9, host_bytes=2 * 10**12)
    return cfg, box.resolve_box(cfg, hf, target, judge_hf)


async def test_the_spec_carries_the_controllers_placement_and_the_host_starts_a_judge_per_gpu(monkeypatch) -> None:
    cfg, b = _box(nodes=2)
    launch = box.judge_plan(cfg, b)
    assert launch is not None and launch.device is not None and launch.devices == tuple(range(8))
    settings = launch.settings
    assert launch.device.max_num_seqs == 2  # ceil(30 / 16): every GPU of both nodes serves
    spec = EngineSpec("/m", {}, (1,), 1, (), 0, "", judge=launch.to_json())
    received = EngineSpec.from_json(spec.to_json())  # through the rendezvous store
    assert JudgePlan.from_json(received.judge) == launch
    command = host_command(received, 1, "10.0.0.2", Path("/tmp/ready.json"))
    monkeypatch.setenv("RPK_ENGINE_TOKEN", TOKEN)
    args = host.parse_args(command[3:])
    assert JudgePlan.from_json(args.judge) == launch
    assert "--judge" not in host_command(EngineSpec("/m", {}, (1,), 1, (), 0, ""), 1, "h", Path("/r"))

    calls: list[dict] = []
    signature = inspect.signature(VLLMJudge.launch)

    async def fake_launch(s: JudgeSettings, **kwargs: Any) -> ScriptJudge:
        signature.bind(s, **kwargs)  # what the real launch accepts
        calls.append({"settings": s, **kwargs})
        return ScriptJudge(str(len(calls)))

    monkeypatch.setattr(VLLMJudge, "launch", fake_launch)
    judges = await start_judges(args.judge, 1, "8,9,10,11,12,13,14,15", lambda line: None)
    assert judges.gpus == list(range(8)) and len(judges.engines) == 8
    assert [c["env"] for c in calls] == [{"CUDA_VISIBLE_DEVICES": str(8 + i)} for i in range(8)]
    assert {c["device"] for c in calls} == {launch.device} and calls[0]["settings"] == settings
    assert calls[0]["seed"] == cfg.run.seed and calls[0]["hub_cache"] == cfg.model.hub_cache
    # Node 0 starts the same engines from the same plan, in the controller.
    assert [p.gpu for p in launch.places(None, 0)] == judges.gpus
    assert launch.places(None, 0)[3].name == "node 0 GPU 3"


def test_on_cpu_no_judge_placement_reaches_the_hosts() -> None:
    cfg = from_argv(["--reward.judge.model", str(MODELS / "qwen2.5-7b")])
    plan = box.judge_plan(cfg, box.resolve_box(cfg, {}, None))
    assert plan is not None and plan.device is None and plan.places(None) == []


def test_the_dry_run_lists_the_judge_engines_of_every_node(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = from_argv([*ARGV, "--dist.gpus", "8", "--dist.gpu_mem_gb", "80", "--dist.nodes", "2"])
    d = dry_run(cfg, MODELS / "qwen2.5-14b", cuda=(0, 0))
    engines = d["judges"]
    assert [(e["node"], e["gpu"]) for e in engines] == [(n, g) for n in (0, 1) for g in range(8)]
    assert {e["engine_args"]["max_num_seqs"] for e in engines} == {2}  # ceil(30 / 16)
    assert d["plan"]["judge"]["engine_args"]["max_num_seqs"] == 2
