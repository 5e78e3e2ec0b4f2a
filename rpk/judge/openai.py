"""Any OpenAI-compatible server as the judge (`reward.judge.url`): a hosted API, or a
vLLM, SGLang or TGI server someone else runs.

One chat completion per vote, as rpk's own engines take one request per vote, its
messages the request's (`JudgeRequest.chat`: the data filled into the template as text):
- `logprob`: `max_tokens: 1, logprobs: true, top_logprobs: N`. The yes and no words are
  read from the first token's top list (every listed spelling of a word that is the
  word once stripped of spaces counts, their probabilities summed). A word missing from
  the list has at most the list's last log-prob and counts as that; both missing means
  the judge put its mass on other tokens, and no verdict is read (the sample fails, it
  is not scored).
- `score`: text up to `max_tokens` (greedy for one vote; votes sample at
  `temperature`), parsed as rpk's own engines' is; an answer cut at `max_tokens` is no
  score.

The endpoint is shared and metered, so the client keeps to it: `max_concurrency`
requests in flight (the scorer's cap), requests and tokens per minute (`RateLimiter`,
an estimate before each request settled with the server's `usage` after), and retries
with backoff on 429, 5xx and lost connections (a 429's `Retry-After` is honoured), all
within the verdict's `timeout_s`. The API key comes from the environment variable
`reward.judge.api_key_env` names, never from the config. A refused key (401/403) stops
the run (every later request would be refused too); any other failed request costs its
sample alone.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from rpk.core.backoff import Backoff
from rpk.judge.limits import RateLimiter, RateLimits
from rpk.reward.functions import RewardError
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeSettings, template_kwargs
from rpk.reward.remote import read_token
from rpk.reward.verdict import Reading, Reads

_BODY_EXCERPT = 300
# Tokens per character of a prompt, for the estimate a request takes from the tokens
# per minute before the server says how many it was (English text runs ~4 characters a token).
_CHARS_PER_TOKEN = 4


class EndpointError(RuntimeError):
    """The endpoint failed one verdict's request (after its retries): the sample's failure."""


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    """The external judge: its base URL (`http://host:8000/v1`), the model it serves
    (None: the only one it lists), the environment variable holding its API key,
    its per-minute limits, and how a request that failed for now is tried again."""

    url: str
    model: str | None = None
    api_key_env: str | None = None
    limits: RateLimits = RateLimits()
    retry: Backoff = Backoff(limit=3, backoff_s=1.0, max_backoff_s=30.0)
    top_logprobs: int = 20
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.judge.url must be http(s)://..., got {self.url!r}")
        if not 1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 1..20, got {self.top_logprobs}")

    @property
    def base(self) -> str:
        """The URL up to `/v1`, whichever of its routes the user gave."""
        url = self.url.rstrip("/")
        for tail in ("/chat/completions", "/completions", "/models"):
            url = url.removesuffix(tail)
        return url


def word_logprob(top: Sequence[Mapping[str, Any]], word: str) -> float | None:
    """The log-prob of `word` among a token's top list: every listed token that is the
    word once stripped of spaces, summed; None when none is."""
    found = [float(t["logprob"]) for t in top if str(t.get("token", "")).strip() == word]
    if not found:
        return None
    top_lp = max(found)
    return top_lp + math.log(sum(math.exp(lp - top_lp) for lp in found))


def logprob_reading(choice: Mapping[str, Any], yes: str, no: str) -> Reading:
    """The reading of a one-token chat completion with `top_logprobs` (see the module
    docstring for a word missing from the list)."""
    content = (choice.get("logprobs") or {}).get("content") or []
    text = str((choice.get("message") or {}).get("content") or "")
    if not content:
        return Reading(text=text)
    top = content[0].get("top_logprobs") or []
    yes_lp, no_lp = word_logprob(top, yes), word_logprob(top, no)
    if yes_lp is None and no_lp is None:
        return Reading(text=text)
    floor = min(float(t["logprob"]) for t in top)
    return Reading(text=text, yes_logprob=floor if yes_lp is None else yes_lp,
                   no_logprob=floor if no_lp is None else no_lp)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """A 429's `Retry-After` in seconds (its date form is not honoured)."""
    try:
        value = float(headers.get("Retry-After", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


# What an endpoint's chat completion can be read for: the first token's top log-probs,
# or the text (a reason verdict's second request continues the judge's own thought, which
# a chat API cannot; a reward model is no chat model).
_SERVED = frozenset({Reads.FIRST_TOKEN, Reads.TEXT})


class OpenAIJudge:
    """`rpk.reward.judge.JudgeEngine` over an OpenAI-compatible chat completions endpoint
    (see the module docstring). Start it with `connect`, which checks the endpoint and
    its model once."""

    can_sleep = False  # someone else's server: nothing here rests it

    def __init__(self, endpoint: EndpointSettings, judge: JudgeSettings, model: str, key: str | None,
                 limiter: RateLimiter | None = None) -> None:
        if judge.kind.reads not in _SERVED:
            raise RewardError(f"reward.judge.url serves logprob and score verdicts, not {judge.verdict.value!r}")
        self.endpoint = endpoint
        self.judge_settings = judge
        self.model = model
        self.limiter = limiter or RateLimiter(endpoint.limits)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._session: aiohttp.ClientSession | None = None
        self.retried = 0
        self.tokens = 0
        self._reported = (0, 0, 0.0)

    @classmethod
    async def connect(cls, endpoint: EndpointSettings, judge: JudgeSettings) -> OpenAIJudge:
        """The judge over `endpoint`, its key read and its model checked against the
        models it lists (RewardError naming the setting when either is wrong)."""
        key = read_token(endpoint.api_key_env, "reward.judge.api_key_env")
        probe = cls(endpoint, judge, endpoint.model or "", key)
        try:
            listed = await probe._models()
        except BaseException:
            await probe.aclose()
            raise
        model = endpoint.model
        if model is None:
            if len(listed) != 1:
                await probe.aclose()
                raise RewardError(f"reward.judge.url {endpoint.url} serves {listed}: name one with "
                                  "reward.judge.model")
            model = listed[0]
        elif model not in listed:
            await probe.aclose()
            raise RewardError(f"reward.judge.model={model!r} is not served at {endpoint.url} (it serves {listed})")
        probe.model = model
        return probe

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No connection cap of its own: the scorer's max_concurrency is the cap.
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _timeout(self) -> aiohttp.ClientTimeout:
        # No total: the scorer's timeout_s bounds a verdict, retries and waits included.
        return aiohttp.ClientTimeout(total=None, sock_connect=self.endpoint.connect_timeout_s)

    async def _models(self) -> list[str]:
        url = f"{self.endpoint.base}/models"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status in (401, 403):
                    raise RewardError(f"reward.judge.url {url}: HTTP {resp.status}: the key in "
                                      f"${self.endpoint.api_key_env} was refused")
                if resp.status >= 300:
                    raise RewardError(f"reward.judge.url {url}: HTTP {resp.status}: "
                                      f"{(await resp.text())[:_BODY_EXCERPT]}")
                body = await resp.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise RewardError(f"reward.judge.url {url} cannot be reached: {type(e).__name__}: {e}") from None
        return [str(m["id"]) for m in body.get("data", [])]

    def request_body(self, request: JudgeRequest) -> dict[str, Any]:
        settings = self.judge_settings
        sampling = settings.kind.sampling(settings)
        assert sampling is not None  # both kinds served generate
        body: dict[str, Any] = {"model": self.model, "messages": request.chat(),
                                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature}
        if settings.kind.reads is Reads.FIRST_TOKEN:
            body.update(logprobs=True, top_logprobs=self.endpoint.top_logprobs)
        if settings.chat_template_kwargs:
            # vLLM's and SGLang's servers take them; a hosted API that does not refuses the
            # request, which is why they are only sent when set.
            body["chat_template_kwargs"] = template_kwargs(settings.chat_template_kwargs)
        return body

    def estimate(self, body: Mapping[str, Any]) -> float:
        """The tokens a request will cost, before the server says."""
        chars = sum(len(m["content"]) for m in body["messages"])
        return chars / _CHARS_PER_TOKEN + float(body["max_tokens"])

    async def ready(self) -> None:
        """Someone else's server is always up (a failed request says otherwise)."""

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        body = self.request_body(request)
        estimate = self.estimate(body)
        answer = await self._post(body, estimate, request_id)
        usage = answer.get("usage") or {}
        used = float(usage.get("total_tokens", estimate))
        self.limiter.settle(estimate, used)
        self.tokens += int(used)
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"the judge at {self.endpoint.url} answered no choice: "
                                f"{str(answer)[:_BODY_EXCERPT]}") from None
        if self.judge_settings.kind.reads is Reads.FIRST_TOKEN:
            return logprob_reading(choice, self.judge_settings.yes, self.judge_settings.no)
        return Reading(text=str((choice.get("message") or {}).get("content") or ""),
                       finished=choice.get("finish_reason") == "stop")

    async def _post(self, body: Mapping[str, Any], estimate: float, request_id: str) -> dict[str, Any]:
        url = f"{self.endpoint.base}/chat/completions"
        headers = {"X-Request-Id": request_id}
        attempt = 0
        while True:
            await self.limiter.acquire(estimate)
            wait: float | None = None
            try:
                async with self.session.post(url, json=body, headers=headers, timeout=self._timeout()) as resp:
                    if resp.status < 300:
                        return await resp.json()
                    text = (await resp.text())[:_BODY_EXCERPT]
                    if resp.status in (401, 403):
                        raise JudgeDied(f"the judge at {url} refused the key in "
                                        f"${self.endpoint.api_key_env}: HTTP {resp.status}: {text}")
                    if resp.status != 429 and resp.status < 500:
                        raise EndpointError(f"the judge at {url}: HTTP {resp.status}: {text}")
                    why = f"HTTP {resp.status}: {text}"
                    wait = retry_after(resp.headers) if resp.status == 429 else None
            except (aiohttp.ClientError, TimeoutError) as e:
                why = f"{type(e).__name__}: {e}"
            if attempt >= self.endpoint.retry.limit:
                raise EndpointError(f"the judge at {url} failed {attempt + 1} times, the last: {why}")
            attempt += 1
            self.retried += 1
            if wait is None:
                wait = self.endpoint.retry.jittered(attempt)
            await asyncio.sleep(min(wait, self.endpoint.retry.max_backoff_s))

    def metrics(self) -> dict[str, float]:
        """The step's retries, tokens and seconds spent waiting for the rate limits."""
        retried, tokens, waited = self.retried, self.tokens, self.limiter.waited_s
        before, self._reported = self._reported, (retried, tokens, waited)
        return {
            "reward_judge_http_retries": float(retried - before[0]),
            "reward_judge_tokens": float(tokens - before[1]),
            "reward_judge_rate_wait_s": waited - before[2],
        }

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
