"""The judge tier's cost side (rpk.judge.cache, rpk.judge.limits, rpk.judge.openai): the
verdict cache, the per-minute limits on virtual time, and the OpenAI-compatible endpoint
against a scripted aiohttp server (429s, 5xx, a refused key, top log-prob lists)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from typing import Any

import pytest
from aiohttp import web

from rpk.assembly.settings import judge_tier, uses_tiny_judge
from rpk.config import ConfigError, from_argv
from rpk.core.backoff import Backoff
from rpk.core.records import Prompt, Response
from rpk.judge.cache import CachedJudge, VerdictCache, judge_identity, samples, verdict_key
from rpk.judge.limits import Budget, RateLimiter, RateLimits, TokenBucket
from rpk.judge.openai import EndpointError, EndpointSettings, OpenAIJudge, logprob_reading, word_logprob
from rpk.reward.functions import RewardError
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeScorer, JudgeSettings, Reading, slot
from tests.helpers import served

SETTINGS = JudgeSettings(model="j", max_concurrency=16)
ASKED = JudgeRequest((("user", "x"),), ())


def _response(i: int, text: str, reference: str = "4") -> Response:
    return Response(Prompt(f"q{i}", (1,), "qa", reference), i, (5,), (-0.1,), "stop", 0, text=text)


# -- the verdict cache -----------------------------------------------------------------


class Counting:
    """Answers YES to a response block holding 4; counts what reaches it; `gate` holds
    every verdict until set."""

    def __init__(self, gate: asyncio.Event | None = None, fail: bool = False) -> None:
        self.asked: list[str] = []
        self.gate, self.fail = gate, fail

    async def ready(self) -> None:
        pass

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        self.asked.append(request_id)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the prompt is too long")
        yes = 0.0 if "<response>\n4\n" in request.chat()[-1]["content"] else -5.0
        return Reading(yes_logprob=yes, no_logprob=-5.0 - yes)

    async def aclose(self) -> None:
        pass


def _cached(inner: Any, settings: JudgeSettings = SETTINGS, size: int = 64) -> CachedJudge:
    return CachedJudge(inner, judge_identity(settings, "/models/judge"), size)


async def test_a_repeated_response_is_not_sent_to_the_engine_again_and_its_step_counts_the_hits() -> None:
    inner = Counting()
    scorer = JudgeScorer(SETTINGS, _cached(inner))
    first = await scorer.score(_response(0, "4"))
    again = [await scorer.score(_response(i, "4")) for i in range(1, 4)]
    assert len(inner.asked) == 1 and all(s.reward == first.reward and s.correct for s in again)
    metrics = scorer.metrics()
    assert metrics["reward_judge_cache_hit_rate"] == 0.75 and metrics["reward_judge_cache_lookups"] == 4.0
    assert metrics["reward_judge_judged_total"] == 4.0  # each sample still scored and counted
    await scorer.score(_response(4, "5"))
    step = scorer.metrics()
    assert step["reward_judge_cache_hit_rate"] == 0.0 and step["reward_judge_cache_hits_total"] == 3.0


async def test_a_different_reference_question_template_or_judge_misses() -> None:
    inner = Counting()
    cached = _cached(inner)
    scorer = JudgeScorer(SETTINGS, cached)
    await scorer.score(_response(0, "4"))
    await scorer.score(_response(1, "4", reference="5"))  # another reference
    other_q = Response(Prompt("q9", (1,), "qa", "4", {"question": "2 + 2"}), 0, (5,), (-0.1,), "stop", 0,
                       text="4")
    await scorer.score(other_q)
    templated = dataclasses.replace(
        SETTINGS, template="Q {question}\n<response>\n{response}\n</response>\nRef {reference}")
    await JudgeScorer(templated, cached).score(_response(2, "4"))
    assert len(inner.asked) == 4 and cached.hits == 0
    # The judge's identity: another model, verdict kind or yes word is another key space.
    base = judge_identity(SETTINGS, "/models/judge")
    assert judge_identity(SETTINGS, "/models/other") != base
    assert judge_identity(dataclasses.replace(SETTINGS, verdict="score"), "/models/judge") != base
    assert judge_identity(dataclasses.replace(SETTINGS, yes="Yes"), "/models/judge") != base
    # What only turns a reading into a reward keeps it.
    assert judge_identity(dataclasses.replace(SETTINGS, threshold=0.7, timeout_s=5.0), "/models/judge") == base


async def test_copies_in_flight_wait_for_the_first_and_a_failure_is_not_kept() -> None:
    gate = asyncio.Event()
    inner = Counting(gate)
    scorer = JudgeScorer(SETTINGS, _cached(inner))
    tasks = [asyncio.create_task(scorer.score(_response(i, "4"))) for i in range(4)]
    await asyncio.sleep(0.01)
    assert len(inner.asked) == 1
    gate.set()
    assert all(s.correct for s in await asyncio.gather(*tasks)) and len(inner.asked) == 1
    failing = Counting(fail=True)
    scorer = JudgeScorer(SETTINGS, _cached(failing))
    for i in range(2):
        assert (await scorer.score(_response(i, "4"))).error is not None
    assert len(failing.asked) == 2  # asked again: a failed request is no verdict


async def test_a_timed_out_first_copy_leaves_the_next_to_ask_itself() -> None:
    gate = asyncio.Event()
    inner = Counting(gate)
    cached = _cached(inner)
    slow = JudgeScorer(dataclasses.replace(SETTINGS, timeout_s=0.05), cached)
    waiting = asyncio.create_task(JudgeScorer(SETTINGS, cached).score(_response(1, "4")))
    assert (await slow.score(_response(0, "4"))).error is not None  # the first copy timed out
    await asyncio.sleep(0.01)
    gate.set()
    assert (await waiting).correct and len(inner.asked) == 2


def test_the_key_is_the_request_as_the_engines_tokenise_it_and_sampled_votes_get_no_cache() -> None:
    identity = judge_identity(SETTINGS, "/models/judge")
    data = JudgeRequest((("user", f"is {slot('response')} right?"),), (("response", "4"),))
    spelled = JudgeRequest((("user", "is 4 right?"),), ())  # the same text, but template, not data
    assert data.chat() == spelled.chat()
    assert verdict_key(identity, data) != verdict_key(identity, spelled)
    assert verdict_key(identity, data) != verdict_key(identity, dataclasses.replace(data, generation_prompt=False))
    assert verdict_key(identity, data) == verdict_key(identity, JudgeRequest(data.messages, data.fields))
    # One kept reading would stand for every sampled vote; greedy and log-prob ones repeat.
    assert samples(dataclasses.replace(SETTINGS, verdict="score", votes=3))
    assert not samples(dataclasses.replace(SETTINGS, verdict="score"))
    assert not samples(SETTINGS)


def test_the_cache_keeps_the_most_recently_used() -> None:
    cache = VerdictCache(2)
    a, b, c = Reading(text="a"), Reading(text="b"), Reading(text="c")
    cache.put("a", a)
    cache.put("b", b)
    assert cache.get("a") is a  # now a is the most recent
    cache.put("c", c)
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c and len(cache) == 2
    with pytest.raises(ValueError, match="size 0"):
        VerdictCache(0)


# -- per-minute limits on virtual time ---------------------------------------------------


def _grant_times(limits: RateLimits, arrivals: list[float], tokens: list[float]) -> list[float]:
    """When each request leaves, first come first served, on virtual time."""
    budget, t, out = Budget(limits, 0.0), 0.0, []
    for arrive, n in zip(arrivals, tokens, strict=True):
        t = max(t, arrive)
        t += budget.wait(t, n)
        budget.take(t, n)
        out.append(t)
    return out


def _most_in_a_minute(times: list[float], weights: list[float]) -> float:
    """The most weight inside any half-open 60-second window [s, s + 60)."""
    return max(sum(w for t, w in zip(times, weights, strict=True) if s <= t < s + 60.0) for s in times)


@pytest.mark.parametrize("rpm", [1, 7, 30, 600])
def test_no_minute_exceeds_the_requests_per_minute_and_the_limit_is_reached(rpm: int) -> None:
    n = 4 * rpm + 5
    times = _grant_times(RateLimits(rpm=rpm), [0.0] * n, [1.0] * n)  # a burst far past the limit
    assert _most_in_a_minute(times, [1.0] * n) <= rpm
    assert sum(t < 60.0 for t in times) >= rpm - 1  # and the limit is used, not starved
    assert times == sorted(times)


def test_no_minute_exceeds_the_tokens_per_minute_and_a_huge_request_is_not_refused() -> None:
    tokens = [300.0, 50.0, 2000.0, 10.0] * 30  # one request larger than a whole bucket
    times = _grant_times(RateLimits(tpm=5000), [i * 0.5 for i in range(len(tokens))], tokens)
    assert _most_in_a_minute(times, tokens) <= 5000 + 2000  # at most one request's overdraft
    assert len(times) == len(tokens) and all(math.isfinite(t) for t in times)
    both = _grant_times(RateLimits(rpm=20, tpm=1000), [0.0] * 60, [100.0] * 60)
    assert _most_in_a_minute(both, [1.0] * 60) <= 20 and _most_in_a_minute(both, [100.0] * 60) <= 1000


def test_settling_books_the_real_tokens() -> None:
    bucket = TokenBucket(600.0, now=0.0)  # 60 a burst, 9 a second
    bucket.take(0.0, 10)
    bucket.settle(0.0, 40)  # it was 50 tokens, not 10
    assert bucket.level == pytest.approx(10.0)
    bucket.settle(0.0, -100)  # a refund never overfills
    assert bucket.level == bucket.capacity == 60.0
    assert bucket.wait(0.0, 61) == 0.0  # more than a bucket: waits for a full one only
    with pytest.raises(ValueError, match="must be > 0"):
        RateLimits(rpm=0)


async def test_the_limiter_waits_on_its_clock_first_come_first_served() -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(RateLimits(rpm=60), clock=lambda: now[0], sleep=sleep)  # burst 6, 0.9/s
    order: list[int] = []

    async def ask(i: int) -> None:
        await limiter.acquire(1)
        order.append(i)

    await asyncio.gather(*(ask(i) for i in range(8)))
    assert order == list(range(8)) and len(slept) == 2 and limiter.waited_s == pytest.approx(sum(slept))
    assert now[0] == pytest.approx(2 / 0.9)


# -- the OpenAI-compatible endpoint against a scripted server ---------------------------


def _completion(top: list[tuple[str, float]], text: str = "YES", tokens: int = 40) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "length",
                         "logprobs": {"content": [{"token": text, "logprob": top[0][1] if top else 0.0,
                                                   "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}}],
            "usage": {"prompt_tokens": tokens - 1, "completion_tokens": 1, "total_tokens": tokens}}


class Server:
    """An OpenAI-compatible server whose chat answers follow `script` (a status, or a
    completion body), then the last entry forever; it records each request's body and
    headers."""

    def __init__(self, script: list[Any], models: tuple[str, ...] = ("judge-7b",), key: str | None = None,
                 retry_after: str | None = None) -> None:
        self.script, self.models, self.key, self.retry_after = script, models, key, retry_after
        self.bodies: list[dict] = []
        self.headers: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    def _authorised(self, request: web.Request) -> bool:
        return self.key is None or request.headers.get("Authorization") == f"Bearer {self.key}"

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.Response(status=401, text="bad key")
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def _chat(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.Response(status=401, text="bad key")
        self.bodies.append(await request.json())
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        step = self.script[min(len(self.bodies) - 1, len(self.script) - 1)]
        if isinstance(step, int):
            headers = {"Retry-After": self.retry_after} if step == 429 and self.retry_after else {}
            return web.Response(status=step, text=f"scripted {step}", headers=headers)
        return web.json_response(step)


def _serve(server: Server) -> contextlib.AbstractAsyncContextManager[str]:
    return served(server.app(), "/v1")


def _endpoint(url: str, **kw: Any) -> EndpointSettings:
    return EndpointSettings(url, **{"retry": Backoff(limit=3, backoff_s=0.001), **kw})


async def test_the_logprob_verdict_reads_yes_and_no_from_the_top_list() -> None:
    server = Server([_completion([("YES", -0.2), ("NO", -1.8), (" yes", -4.0)])])
    async with _serve(server) as url:
        judge = await OpenAIJudge.connect(_endpoint(url), SETTINGS)
        assert judge.model == "judge-7b"  # the only model served
        scorer = JudgeScorer(SETTINGS, judge)
        scored = await scorer.score(_response(0, "4"))
        assert scored.reward == pytest.approx(math.exp(-0.2) / (math.exp(-0.2) + math.exp(-1.8)))
        body = server.bodies[0]
        assert (body["model"], body["max_tokens"], body["logprobs"], body["top_logprobs"]) == ("judge-7b", 1, True, 20)
        assert body["messages"][-1]["content"].endswith("Reply YES or NO.")
        assert server.headers[0].get("x-request-id") == "judge-1-q0/0", server.headers[0]
        assert scorer.metrics()["reward_judge_tokens"] == 40.0
        await judge.aclose()


def test_a_word_missing_from_the_top_list_counts_at_most_its_last_and_both_missing_is_no_verdict() -> None:
    top = [{"token": "YES", "logprob": -0.1}, {"token": " YES", "logprob": -3.0}, {"token": "So", "logprob": -6.0}]
    assert word_logprob(top, "YES") == pytest.approx(math.log(math.exp(-0.1) + math.exp(-3.0)))
    assert word_logprob(top, "NO") is None
    reading = logprob_reading(_completion([("YES", -0.1), ("So", -6.0)])["choices"][0], "YES", "NO")
    assert (reading.yes_logprob, reading.no_logprob) == (-0.1, -6.0)
    thinking = logprob_reading(_completion([("<think>", -0.01), ("So", -5.0)], "<think>")["choices"][0], "YES", "NO")
    assert thinking.yes_logprob is None and thinking.no_logprob is None and thinking.text == "<think>"


async def test_a_thinking_judge_with_neither_word_in_its_top_list_is_a_failure_not_a_score() -> None:
    server = Server([_completion([("<think>", -0.01), ("So", -5.0)], "<think>")])
    async with _serve(server) as url:
        scorer = JudgeScorer(SETTINGS, await OpenAIJudge.connect(_endpoint(url), SETTINGS))
        scored = await scorer.score(_response(0, "4"))
        assert scored.error is not None and scored.reward == 0.0 and sum(scorer.failures.values()) == 1
        await scorer.aclose()


async def test_429_and_5xx_are_retried_with_retry_after_honoured_and_a_4xx_is_the_samples_failure() -> None:
    ok = _completion([("YES", -0.1), ("NO", -2.5)])
    server = Server([429, 503, ok], retry_after="0")
    async with _serve(server) as url:
        judge = await OpenAIJudge.connect(_endpoint(url), SETTINGS)
        assert (await judge.judge(ASKED, "r0")).yes_logprob == -0.1
        assert len(server.bodies) == 3 and judge.metrics()["reward_judge_http_retries"] == 2.0
        await judge.aclose()
        server.script, server.bodies = [500], []
        judge = await OpenAIJudge.connect(_endpoint(url, retry=Backoff(limit=2, backoff_s=0.001)), SETTINGS)
        with pytest.raises(EndpointError, match="failed 3 times, the last: HTTP 500: scripted 500"):
            await judge.judge(ASKED, "r1")
        server.script, server.bodies = [400], []
        scorer = JudgeScorer(SETTINGS, judge)
        scored = await scorer.score(_response(0, "4"))
        assert len(server.bodies) == 1 and scorer.failures["judge_engine"] == 1 and "HTTP 400" in str(scored.error)
        await judge.aclose()


async def test_the_endpoints_requests_and_retries_keep_to_rpm_and_the_servers_token_counts_to_tpm() -> None:
    """Verdicts one after another on virtual time through the endpoint's own limiter: the
    server sees when each request arrives (a retried 503 included) and bills 40 tokens a
    verdict, while the client's estimate is 1.25: only the settled `usage` keeps to tpm."""
    now = [0.0]

    async def sleep(s: float) -> None:
        now[0] += s

    ok = _completion([("YES", -0.1), ("NO", -2.5)], tokens=40)
    server = Server([ok, 503, ok])
    arrived: list[float] = []
    chat = server._chat

    async def timed(request: web.Request) -> web.Response:
        arrived.append(now[0])
        return await chat(request)

    server._chat = timed  # type: ignore[method-assign]
    limiter = RateLimiter(RateLimits(rpm=60, tpm=200), clock=lambda: now[0], sleep=sleep)
    async with _serve(server) as url:
        judge = OpenAIJudge(_endpoint(url), SETTINGS, "judge-7b", None, limiter=limiter)
        try:
            for i in range(30):
                assert (await judge.judge(ASKED, f"r{i}")).yes_logprob == -0.1
            metrics = judge.metrics()
        finally:
            await judge.aclose()
    assert len(arrived) == 31 and metrics["reward_judge_http_retries"] == 1.0  # the 503, asked again
    billed = [0.0 if i == 1 else 40.0 for i in range(31)]
    assert _most_in_a_minute(arrived, [1.0] * 31) <= 60
    assert _most_in_a_minute(arrived, billed) <= 200 + 40  # at most one verdict's overdraft
    assert metrics["reward_judge_tokens"] == 1200 and metrics["reward_judge_rate_wait_s"] > 0
    assert arrived[-1] <= 1.25 * 1200 / (200 / 60)  # the limit is used, not starved


async def test_the_key_comes_from_the_environment_and_a_refused_key_stops_the_run(monkeypatch) -> None:
    server = Server([_completion([("YES", -0.1), ("NO", -2.5)])], key="sk-right")
    async with _serve(server) as url:
        monkeypatch.delenv("JUDGE_KEY", raising=False)
        with pytest.raises(RewardError, match="reward.judge.api_key_env='JUDGE_KEY'.*unset"):
            await OpenAIJudge.connect(_endpoint(url, api_key_env="JUDGE_KEY"), SETTINGS)
        monkeypatch.setenv("JUDGE_KEY", "sk-wrong")
        with pytest.raises(RewardError, match=r"HTTP 401: the key in \$JUDGE_KEY was refused"):
            await OpenAIJudge.connect(_endpoint(url, api_key_env="JUDGE_KEY"), SETTINGS)
        monkeypatch.setenv("JUDGE_KEY", "sk-right")
        judge = await OpenAIJudge.connect(_endpoint(url, api_key_env="JUDGE_KEY"), SETTINGS)
        assert (await judge.judge(ASKED, "r0")).yes_logprob == -0.1
        server.key = "sk-rotated"
        with pytest.raises(JudgeDied, match=r"refused the key in \$JUDGE_KEY: HTTP 401"):
            await JudgeScorer(SETTINGS, judge).score(_response(0, "4"))
        await judge.aclose()


async def test_the_model_must_be_served_and_a_score_verdict_reads_text() -> None:
    server = Server([{"choices": [{"message": {"content": "Reasoning... Score: 7"}, "finish_reason": "stop"}]}],
                    models=("a", "b"))
    async with _serve(server) as url:
        with pytest.raises(RewardError, match=r"serves \['a', 'b'\]: name one with reward.judge.model"):
            await OpenAIJudge.connect(_endpoint(url), SETTINGS)
        with pytest.raises(RewardError, match="reward.judge.model='c' is not served"):
            await OpenAIJudge.connect(_endpoint(url, model="c"), SETTINGS)
        graded = dataclasses.replace(SETTINGS, verdict="score", max_tokens=64)
        judge = await OpenAIJudge.connect(_endpoint(url + "/chat/completions", model="b"), graded)
        scored = await JudgeScorer(graded, judge).score(_response(0, "4"))
        assert scored.reward == pytest.approx(0.7) and server.bodies[0]["max_tokens"] == 64
        assert "logprobs" not in server.bodies[0]
        await judge.aclose()


async def test_score_votes_are_sampled_requests_of_their_own_and_a_cut_answer_is_no_vote() -> None:
    def said(text: str, finish: str) -> dict:
        return {"choices": [{"message": {"content": text}, "finish_reason": finish}]}

    server = Server([said("Score: 8", "stop"), said("Score: 2", "length"), said("Score: 6", "stop")])
    async with _serve(server) as url:
        voted = dataclasses.replace(SETTINGS, verdict="score", votes=3, temperature=0.7)
        judge = await OpenAIJudge.connect(_endpoint(url), voted)
        scorer = JudgeScorer(voted, judge)
        scored = await scorer.score(_response(0, "4"))
        assert scored.reward == pytest.approx(0.7)  # the cut vote dropped: (0.8 + 0.6) / 2
        assert [b["temperature"] for b in server.bodies] == [0.7] * 3
        assert sorted(h["x-request-id"] for h in server.headers) == [f"judge-1-q0/0#{v}" for v in range(3)]
        assert scorer.metrics()["reward_judge_votes_dropped_total"] == 1.0
        assert "chat_template_kwargs" not in server.bodies[0]  # unset: not sent at all
        await judge.aclose()
        unthinking = dataclasses.replace(voted, votes=1, chat_template_kwargs=("enable_thinking=false",))
        judge = await OpenAIJudge.connect(_endpoint(url), unthinking)
        await JudgeScorer(unthinking, judge).score(_response(1, "4"))
        assert server.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
        assert server.bodies[-1]["temperature"] == 0.0  # one vote: greedy
        await judge.aclose()


@pytest.mark.parametrize("verdict", ["classify", "reason"])
def test_the_endpoint_refuses_the_verdicts_it_cannot_read(verdict: str) -> None:
    with pytest.raises(RewardError, match=f"serves logprob and score verdicts, not '{verdict}'"):
        OpenAIJudge(_endpoint("http://127.0.0.1:9/v1"), dataclasses.replace(SETTINGS, verdict=verdict), "a", None)


async def test_an_unreachable_endpoint_is_named_at_start() -> None:
    with pytest.raises(RewardError, match="reward.judge.url http://127.0.0.1:9/v1/models cannot be reached"):
        await OpenAIJudge.connect(_endpoint("http://127.0.0.1:9/v1"), SETTINGS)


# -- the settings, from the command line -----------------------------------------------


def test_the_tier_settings_come_from_reward_judge_and_bad_values_are_refused() -> None:
    tier = judge_tier(from_argv(["--reward.judge.restarts", "5", "--reward.judge.cache_size", "10"]).reward.judge)
    assert (tier.restarts.limit, tier.cache_size, tier.endpoint) == (5, 10, None)
    assert judge_tier(from_argv(["--reward.judge.cache", "false"]).reward.judge).cache_size == 0
    cfg = from_argv(["--data.task", "arith_judged", "--reward.judge.url", "http://h:8000/v1",
                     "--reward.judge.model", "judge-7b", "--reward.judge.api_key_env", "K",
                     "--reward.judge.rpm", "60", "--reward.judge.tpm", "9000"])
    endpoint = judge_tier(cfg.reward.judge).endpoint
    assert endpoint is not None and (endpoint.base, endpoint.model, endpoint.api_key_env) == (
        "http://h:8000/v1", "judge-7b", "K")
    assert endpoint.limits == RateLimits(60.0, 9000.0)
    assert not uses_tiny_judge(cfg)  # an external judge: nothing to build
    for argv, field in [(["--reward.judge.url", "h:8000"], "reward.judge.url"),
                        (["--reward.judge.url", "http://h/v1", "--reward.judge.verdict", "classify"],
                         "reward.judge.url"),
                        (["--reward.judge.url", "http://h/v1", "--reward.judge.verdict", "reason"],
                         "reward.judge.url"),
                        (["--reward.judge.rpm", "0"], "reward.judge.rpm"),
                        (["--reward.judge.top_logprobs", "21"], "reward.judge.top_logprobs"),
                        (["--reward.judge.restarts", "-1"], "reward.judge.restarts")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            from_argv(argv)
