"""An external judge served by vLLM's own OpenAI-compatible server (`reward.judge.url`):
the test starts `python -m vllm.entrypoints.openai.api_server` on the CPU engine with a
small build of rpk's tiny judge, scores a round of the judged task's responses through
the run's own judge tier (settings, endpoint, cache) and checks each verdict against the
P(YES) the build measures with transformers; then a whole judged `python -m rpk.run`
scored by that server; then checks the rate limit on the real server (no minute past
rpm), and ends the server by its PID, no process of it left. The server is a whole
process of minutes, so the module is the slow tier's."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from aiohttp import web

from rpk.assembly.settings import judge_tier, run_judge_settings
from rpk.config import from_argv
from rpk.judge import tiny as jm
from rpk.judge.cache import CachedJudge
from rpk.judge.openai import OpenAIJudge
from rpk.judge.tier import start_tier
from rpk.judge.tiny_recipe import JUDGE
from rpk.reward.judge import JudgeScorer
from rpk.tasks.tiny import TinySpec, build_tiny_model
from tests.helpers import served
from tests.integration.engines import SMALL_JUDGE as SMALL
from tests.integration.engines import assert_the_models_p_yes, judged_round
from tests.integration.runs import metrics, rpk_run

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="module"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(proc: subprocess.Popen, url: str, limit_s: float = 240.0) -> None:
    import urllib.request

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM's server did not answer {url}/health within {limit_s:.0f}s")


def _verdict_first(tokenizer: Any, spec: TinySpec) -> list[tuple[list[int], list[int]]]:
    """The tiny judge's cases with the verdict word as the first token: an endpoint serves
    logprob verdicts, read from the first token's top 20, where the reasoning judge's
    scratchpad letters would crowd YES and NO out."""
    yes, no = jm.verdict_ids(tokenizer)
    out = []
    for case in jm.training_cases(spec):
        ids = jm.prompt_ids(tokenizer, case)
        out.append((ids + [yes if case.correct else no, tokenizer.eos_token_id], [0] * len(ids) + [1, 1]))
    return out


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Its figures are the unit tests'.
    recipe = dataclasses.replace(JUDGE, examples=_verdict_first, evaluate=None)
    return build_tiny_model(SMALL, tmp_path_factory.mktemp("judge"), lambda _: None, recipe)


@pytest.fixture(scope="module")
def server(judge_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI-compatible server on the tiny judge; its base URL. Ended by PID
    (SIGTERM, then SIGKILL), and no process it started may outlive it."""
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    log = (tmp_path_factory.mktemp("server") / "vllm.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(judge_dir),
         "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--enforce-eager",
         "--dtype", "float32"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    family: list[psutil.Process] = []
    try:
        _wait_healthy(proc, url)
        family = psutil.Process(proc.pid).children(recursive=True)
        yield f"{url}/v1"
    finally:
        family += [p for p in _children(proc.pid) if p.pid not in {q.pid for q in family}]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        _, alive = psutil.wait_procs(family, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"vLLM's server left {[p.cmdline() for p in alive]}"


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


async def test_a_round_is_scored_by_the_external_judge_served_by_vllms_own_server(server, judge_dir):
    # The run's own path from the command line: the judged task, its judge at the URL.
    # min_mass 0: the small build puts little mass on its words; P(YES) is still its own.
    cfg = from_argv(["--data.task", "arith_judged", "--reward.judge.url", server, "--reward.judge.min_mass", "0"])
    settings, tier = run_judge_settings(cfg), judge_tier(cfg.reward.judge)
    assert tier.endpoint is not None and settings.model is None  # the server's only model
    tiny = jm.DEFAULT  # its prompt, read at the first token (an endpoint serves no reason verdict)
    settings = dataclasses.replace(settings, template=tiny.template, system=tiny.system,
                                   max_response_chars=tiny.max_response_chars, response_after=tiny.response_after)
    engine = await start_tier(settings, tier=tier, plan=None, visible=None, node=None, log=lambda _: None)
    assert isinstance(engine, CachedJudge) and isinstance(engine.inner, OpenAIJudge)
    assert engine.inner.model == str(judge_dir)
    scorer = JudgeScorer(settings, engine)
    try:
        responses, cases = judged_round(12)
        scored = await asyncio.gather(*(scorer.score(r) for r in responses))
        again = await asyncio.gather(*(scorer.score(r) for r in responses))  # the same round again
        metrics = scorer.metrics()
    finally:
        await scorer.aclose()
    assert_the_models_p_yes(scored, judge_dir, cases)
    assert [s.reward for s in again] == [s.reward for s in scored]
    assert metrics["reward_judge_cache_hit_rate"] == 0.5 and metrics["reward_judge_tokens"] > 0


async def test_a_judged_run_is_scored_by_the_external_judge_served_by_vllms_own_server(
        server, tmp_path: Path, rpk_cache: Path):
    """`python -m rpk.run --data.task arith_judged --reward.judge.url ...` with the tiny
    judge's prompt: every step's judged rows are scored by the server (the tokens it
    reports), none fails, and the judge is still checked against the rule."""
    tiny = jm.DEFAULT
    proc = await asyncio.to_thread(
        rpk_run, tmp_path, rpk_cache, "--data.task", "arith_judged", "--reward.judge.url", server,
        "--reward.judge.template", tiny.template, "--reward.judge.system", tiny.system,
        "--reward.judge.max_response_chars", str(tiny.max_response_chars),
        "--reward.judge.response_after", tiny.response_after, "--reward.judge.canaries", "0",
        "--reward.judge.min_mass", "0", "--data.val_size", "0", "--run.checkpoint_every", "0", "--run.steps", "2",
        timeout_s=900)
    printed = proc.stdout + proc.stderr
    assert f"served at {server}" in printed
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["reward_failed"] == 0 and r["reward_judge_tokens"] > 0
        assert r["reward_judge_cache_lookups"] >= r["reward_judge_rule_compared"] > 0
    assert recs[-1]["reward_judge_judged_total"] == sum(r["reward_judge_rule_compared"] for r in recs)


async def test_no_minute_on_the_real_server_exceeds_rpm(server, judge_dir):
    """34 verdicts at rpm 30 through a recording proxy in front of the server: the proxy
    sees when each request really arrives, whatever the client believes."""
    arrived: list[float] = []

    async def forward(request: web.Request) -> web.Response:
        arrived.append(time.monotonic())
        async with aiohttp.ClientSession() as session:
            async with session.post(server + "/chat/completions", data=await request.read(),
                                    headers={"Content-Type": "application/json"}) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as session:
            async with session.get(server + "/models") as resp:
                return web.json_response(await resp.json())

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/v1/models", models)
    async with served(app, "/v1") as proxy:
        cfg = from_argv(["--data.task", "arith_judged", "--reward.judge.url", proxy, "--reward.judge.rpm", "30",
                         "--reward.judge.cache", "false", "--reward.judge.timeout_s", "300",
                         "--reward.judge.min_mass", "0"])
        settings, tier = run_judge_settings(cfg), judge_tier(cfg.reward.judge)
        settings = dataclasses.replace(settings, template=jm.DEFAULT.template, system=jm.DEFAULT.system,
                                       max_response_chars=jm.DEFAULT.max_response_chars,
                                       response_after=jm.DEFAULT.response_after)
        engine = await start_tier(settings, tier=tier, plan=None, visible=None, node=None, log=lambda _: None)
        scorer = JudgeScorer(settings, engine)
        try:
            responses, _ = judged_round(34, seed=5)
            scored = await asyncio.gather(*(scorer.score(r) for r in responses))
            waited = scorer.metrics()["reward_judge_rate_wait_s"]
        finally:
            await scorer.aclose()
    assert [s.error for s in scored] == [None] * 34 and len(arrived) == 34
    most = max(sum(1 for t in arrived if s <= t < s + 60.0) for s in arrived)
    assert most <= 30, f"{most} requests reached the server within one minute (rpm 30)"
    assert arrived[-1] - arrived[0] > 60.0 and waited > 0  # the limit bound: 34 > 30
    first_minute = sum(1 for t in arrived if t < arrived[0] + 60.0)
    assert first_minute >= 28, f"only {first_minute} in the first minute: the limit is not used"
