"""Reward over HTTP: the HTTPScorer against the reference server and against tiny
misbehaving services, each served on a loopback port from a thread of its own (so the
test's event loop holds only the client's tasks)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rpk.assembly import build_scorer, judge_settings
from rpk.config import ConfigError, JudgeConfig, RewardConfig
from rpk.core.backoff import Backoff
from rpk.core.records import Prompt, Response
from rpk.loop.rollout import run_round
from rpk.reward import FunctionScorer, RewardError, resolve_rewards
from rpk.reward.remote import HTTPScorer
from rpk.reward.server import lookup_for, main, make_app
from rpk.tasks import arith
from tests.fakes import ScriptedEngine, make_prompts, mean_centred
from tests.helpers import plan, resp_index, serving
from tests.reward_fns import length_reward


def tiny_app(handler: Callable[[web.Request], Awaitable[web.Response]]) -> web.Application:
    app = web.Application()
    app.router.add_post("/score", handler)
    return app


def all_ones(items: list[Any]) -> web.Response:
    return web.json_response({"results": [{"score": 1.0, "acc": True, "error": None}] * len(items)})


def response(text: str, truth: Any = "7", source: str = "t", uid: str = "u") -> Response:
    prompt = Prompt(uid, (1,), source, truth, {"k": 1})
    return Response(prompt, 0, (5,), (-0.1,), "stop", 0, text=text)


def other_tasks() -> set[asyncio.Task[Any]]:
    return asyncio.all_tasks() - {asyncio.current_task()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arith_responses(n: int) -> list[Response]:
    """Per built-in prompt: the right answer, a wrong one, and no answer at all."""
    out = []
    for i, row in enumerate(arith.make_rows(n, seed=3)):
        truth = row["reward_model"]["ground_truth"]
        prompt = Prompt(f"arith:{i}", (1,), row["data_source"], truth, row["extra_info"])
        for j, text in enumerate(
            (f"A1+a2+0=03\nAnswer: {truth}", f"Answer: {int(truth) + 1}", "I give up")
        ):
            out.append(Response(prompt, j, (1,), (-0.1,), "stop", 0, text=text))
    return out


async def test_remote_scores_equal_in_process_scores_on_the_builtin_task():
    responses = arith_responses(8)
    local = FunctionScorer(resolve_rewards(None, {arith.DATA_SOURCE}), timeout_s=5, max_concurrency=4)
    expected = [await local.score(r) for r in responses]
    with serving(make_app(lookup_for(None), None)) as url:
        remote = HTTPScorer(f"{url}/score", batch_size=10, linger_ms=50)
        async with contextlib.aclosing(remote):
            got = await asyncio.gather(*(remote.score(r) for r in responses))
    assert [(s.reward, s.correct, s.error) for s in got] == [
        (s.reward, s.correct, s.error) for s in expected
    ]
    assert [s.reward for s in got] == [1.0, 0.0, 0.0] * 8
    assert [s.response for s in got] == responses
    assert remote.requests == 3  # 24 responses in batches of 10
    assert remote.metrics()["reward_http_requests_total"] == 3.0


async def test_server_per_item_failures_are_contained_and_counted():
    with serving(make_app(lookup_for("tests.reward_fns:misbehaving"), None, timeout_s=0.2)) as url:
        remote = HTTPScorer(f"{url}/score", linger_ms=20)
        async with contextlib.aclosing(remote):
            got = await asyncio.gather(
                *(remote.score(response(t)) for t in ("ok", "raise", "nan", "slow", "ok"))
            )
        async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
            health = await r.json()
    assert [s.reward for s in got] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert got[1].error is not None and "KeyError" in got[1].error
    assert got[3].error is not None and "timed out after 0.2s" in got[3].error
    assert remote.failures == {"remote": 3}
    assert remote.requests == 1
    assert health["scored"] == 5
    assert health["failures"] == {"raised": 1, "bad_value": 1, "timeout": 1}


async def test_builtin_server_names_an_unknown_data_source_per_item():
    with serving(make_app(lookup_for(None), None)) as url:
        remote = HTTPScorer(f"{url}/score")
        async with contextlib.aclosing(remote):
            bad, good = await asyncio.gather(
                remote.score(response("x", source="nope")),
                remote.score(response("Answer: 7", source=arith.DATA_SOURCE)),
            )
    assert bad.reward == 0.0 and "no built-in reward for data_source 'nope'" in (bad.error or "")
    assert good.reward == 1.0 and good.error is None


async def test_token_is_required_when_configured(monkeypatch):
    with serving(make_app(lookup_for(None), "s3cret")) as url:
        body = {"items": [{"data_source": arith.DATA_SOURCE, "solution_str": "Answer: 7",
                           "ground_truth": "7", "extra_info": None, "uid": "u"}]}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/score", json=body) as r:
                assert r.status == 401
            wrong = {"Authorization": "Bearer guess"}
            async with session.post(f"{url}/score", json=body, headers=wrong) as r:
                assert r.status == 401
            async with session.get(f"{url}/health") as r:
                assert r.status == 200
        no_token = HTTPScorer(f"{url}/score")
        with pytest.raises(RewardError, match="HTTP 401"):
            await no_token.score(response("Answer: 7", source=arith.DATA_SOURCE))
        await no_token.aclose()
        monkeypatch.setenv("RPK_TEST_REWARD_TOKEN", "s3cret")
        cfg = RewardConfig(url=f"{url}/score", token_env="RPK_TEST_REWARD_TOKEN")
        with_token = build_scorer(cfg, judge_settings(JudgeConfig()), [], 64)  # as a run starts it
        try:
            ok = await with_token.score(response("Answer: 7", source=arith.DATA_SOURCE))
        finally:
            await with_token.aclose()
    assert ok.reward == 1.0 and ok.error is None


def test_missing_token_variable_fails_at_start_up_naming_it(monkeypatch, capsys):
    monkeypatch.delenv("RPK_TEST_NO_SUCH_TOKEN", raising=False)
    cfg = RewardConfig(url="http://127.0.0.1:1/score", token_env="RPK_TEST_NO_SUCH_TOKEN")
    with pytest.raises(RewardError, match="RPK_TEST_NO_SUCH_TOKEN"):
        build_scorer(cfg, judge_settings(JudgeConfig()), [], 64)
    assert main(["--token-env", "RPK_TEST_NO_SUCH_TOKEN"]) == 2
    assert "--token-env='RPK_TEST_NO_SUCH_TOKEN'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"url": "127.0.0.1:8000/score"}, "url must start with http"),
        ({"url": "http://h/score", "function": "m:f"}, "set one"),
        ({"token_env": "TOKEN"}, "token_env ('TOKEN') needs url"),
        ({"url": "http://h/score", "batch_size": 0}, "batch_size must be > 0, got 0"),
        ({"url": "http://h/score", "retries": -1}, "retries must be >= 0, got -1"),
    ],
)
def test_remote_config_is_validated(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RewardConfig(**fields)


async def test_5xx_is_retried_with_backoff_until_success():
    calls = 0

    async def flaky(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        if calls <= 2:
            return web.Response(status=503, text="warming up")
        return all_ones((await request.json())["items"])

    with serving(tiny_app(flaky)) as url:
        remote = HTTPScorer(f"{url}/score", retry=Backoff(limit=3, backoff_s=0.01))
        async with contextlib.aclosing(remote):
            scored = await remote.score(response("x"))
    assert scored.reward == 1.0 and scored.error is None
    assert (calls, remote.requests, remote.retried) == (3, 3, 2)
    assert remote.failures == {}


async def test_4xx_is_not_retried_and_persistent_5xx_gives_up():
    async def status(request: web.Request) -> web.Response:
        code = 400 if (await request.json())["items"][0]["solution_str"] == "bad" else 500
        return web.Response(status=code, text="no")

    with serving(tiny_app(status)) as url:
        remote = HTTPScorer(f"{url}/score", retry=Backoff(limit=2, backoff_s=0.01), batch_size=1)
        async with contextlib.aclosing(remote):
            bad = await remote.score(response("bad"))
            assert remote.requests == 1
            down = await remote.score(response("down"))
    assert bad.reward == 0.0 and bad.error == "http_4xx: HTTP 400: no"
    assert down.reward == 0.0 and down.error == "http_5xx: HTTP 500: no (after 2 retries)"
    assert (remote.requests, remote.retried) == (4, 2)
    assert remote.failures == {"http_4xx": 1, "http_5xx": 1}


async def test_timeout_scores_zero_counted_and_not_retried():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return all_ones((await request.json())["items"])

    with serving(tiny_app(slow)) as url:
        remote = HTTPScorer(f"{url}/score", timeout_s=0.2, retry=Backoff(limit=3, backoff_s=0.01))
        async with contextlib.aclosing(remote):
            got = await asyncio.gather(remote.score(response("a")), remote.score(response("b")))
    assert [s.reward for s in got] == [0.0, 0.0]
    assert all(s.error == "timeout: no answer within 0.2s" for s in got)
    assert remote.failures == {"timeout": 2}
    assert (remote.requests, remote.retried) == (1, 0)


async def test_connection_refused_is_retried_then_scores_zero():
    remote = HTTPScorer(f"http://127.0.0.1:{free_port()}/score", retry=Backoff(limit=2, backoff_s=0.01))
    async with contextlib.aclosing(remote):
        scored = await remote.score(response("x"))
    assert scored.reward == 0.0 and scored.correct is False
    assert scored.error is not None and scored.error.startswith("connection: ClientConnector")
    assert remote.failures == {"connection": 1}
    assert (remote.requests, remote.retried) == (3, 2)
    metrics = remote.metrics()
    assert metrics["reward_failed_connection_total"] == 1.0
    assert metrics["reward_failed_timeout_total"] == 0.0


@pytest.mark.parametrize(
    "answer, why",
    [
        ({"results": []}, "0 results for 1 items"),
        ({"scores": [1.0]}, "no 'results' list"),
        ({"results": [{"score": "1"}]}, "score '1', not a finite number"),
        ({"results": [{"score": 1.0, "acc": "yes"}]}, "acc 'yes'"),
    ],
)
async def test_malformed_answer_fails_the_batch(answer, why):
    async def broken(request: web.Request) -> web.Response:
        return web.json_response(answer)

    with serving(tiny_app(broken)) as url:
        remote = HTTPScorer(f"{url}/score")
        async with contextlib.aclosing(remote):
            scored = await remote.score(response("x"))
    assert scored.reward == 0.0 and why in (scored.error or "")
    assert remote.failures == {"malformed": 1}


async def test_concurrent_calls_are_batched_by_size_and_linger():
    sizes: list[int] = []

    async def recording(request: web.Request) -> web.Response:
        items = (await request.json())["items"]
        sizes.append(len(items))
        results = [{"score": float(i["solution_str"]), "acc": None, "error": None} for i in items]
        return web.json_response({"results": results})

    with serving(tiny_app(recording)) as url:
        remote = HTTPScorer(f"{url}/score", batch_size=4, linger_ms=100)
        async with contextlib.aclosing(remote):
            got = await asyncio.gather(*(remote.score(response(str(i))) for i in range(10)))
            alone = await remote.score(response("3"))
    assert [s.reward for s in got] == [float(i) for i in range(10)]
    assert [s.correct for s in got] == [i > 0 for i in range(10)]
    assert sorted(sizes) == [1, 2, 4, 4]
    assert alone.reward == 3.0


async def test_cancelled_calls_leave_no_tasks_and_spare_their_batch_mates():
    arrived = threading.Event()
    release = threading.Event()
    seen: list[str] = []

    async def held(request: web.Request) -> web.Response:
        items = (await request.json())["items"]
        seen.extend(i["solution_str"] for i in items)
        arrived.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return all_ones(items)

    with serving(tiny_app(held)) as url:
        remote = HTTPScorer(f"{url}/score", linger_ms=10_000, batch_size=2)
        try:
            # Still lingering: cancelling drops the item, no request is ever made.
            waiting = asyncio.create_task(remote.score(response("a")))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert other_tasks() == set() and remote.requests == 0

            # In flight: one of two callers leaves, the other still gets its score.
            leaving = asyncio.create_task(remote.score(response("b")))
            staying = asyncio.create_task(remote.score(response("c")))
            while not arrived.is_set():
                await asyncio.sleep(0.01)
            leaving.cancel()
            await asyncio.sleep(0.05)
            release.set()
            assert (await staying).reward == 1.0
            assert leaving.cancelled()

            # In flight, every caller leaves: the request itself is cancelled.
            release.clear()
            arrived.clear()
            both = [asyncio.create_task(remote.score(response(t))) for t in ("d", "e")]
            while not arrived.is_set():
                await asyncio.sleep(0.01)
            for task in both:
                task.cancel()
            await asyncio.gather(*both, return_exceptions=True)
            await asyncio.sleep(0)
            assert other_tasks() == set()
        finally:
            release.set()
            await remote.aclose()
    assert seen == ["b", "c", "d", "e"]
    assert remote.failures == {}


async def test_aclose_cancels_waiting_callers_and_closes_the_session():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return all_ones((await request.json())["items"])

    with serving(tiny_app(slow)) as url:
        remote = HTTPScorer(f"{url}/score", linger_ms=1)
        task = asyncio.create_task(remote.score(response("x")))
        await asyncio.sleep(0.1)
        await remote.aclose()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert other_tasks() == set()
        with pytest.raises(RuntimeError, match="closed"):
            await remote.score(response("x"))


async def test_a_round_gets_the_same_rewards_over_http_as_in_process():
    def engine() -> ScriptedEngine:
        return ScriptedEngine(lambda r: 4 + 3 * resp_index(r.request_id))

    round_plan = plan(make_prompts(3), 4, 4, 3)
    local = FunctionScorer({"test": length_reward}, timeout_s=5, max_concurrency=4)
    expected = await run_round(round_plan, engine(), local, mean_centred, version=1)
    with serving(make_app(lambda ds: length_reward, None)) as url:
        remote = HTTPScorer(f"{url}/score", linger_ms=5)
        async with contextlib.aclosing(remote):
            got = await run_round(round_plan, engine(), remote, mean_centred, version=1)

    def rewards(result):
        return sorted(
            (g.prompt.uid, m.response.index, m.reward, m.correct, a)
            for g in result.groups
            for m, a in zip(g.members, g.advantages)
        )

    assert rewards(got) == rewards(expected)
    assert {m.reward for g in got.groups for m in g.members} == {0.4, 0.7, 1.0, 1.3}
    assert remote.failures == {} and remote.requests < 12


async def test_shaping_applies_on_top_of_a_remote_scorer():
    """with_shaping wraps any scorer: the overlong penalty reaches remote scores too."""
    from rpk.core.records import Prompt, Response, Scored
    from rpk.reward import RewardError, RewardSettings, with_shaping

    class Always1:
        async def score(self, response):
            return Scored(response, 1.0, True)

        async def aclose(self):
            return None

        def metrics(self):
            return {}

    cfg = RewardSettings(overlong_buffer=4)
    scorer = with_shaping(cfg, Always1(), max_tokens=8)
    prompt = Prompt("p", (1,), "x", "1")
    short = await scorer.score(Response(prompt, 0, (1,) * 4, (0.0,) * 4, "stop", 0))
    long = await scorer.score(Response(prompt, 1, (1,) * 6, (0.0,) * 6, "stop", 0))
    assert short.reward == 1.0
    assert long.reward == 0.5 and long.correct  # -(6 - 4) / 4, the verdict kept
    with pytest.raises(RewardError, match="overlong_buffer=4"):
        with_shaping(cfg, Always1(), max_tokens=4)
