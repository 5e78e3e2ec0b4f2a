"""`python -m rpk.reward.server`: serve rpk reward functions over HTTP.

Speaks the wire format of rpk.reward.remote (POST /score) so a run can keep its reward
on another machine (`--reward.url http://HOST:8000/score`). Items are scored by the
same reward stack an in-process run with `reward.backend=thread` uses, so the two give
the same rewards: sync functions run in a worker thread, the built-in code checker on
one sandbox (`SandboxSettings`' defaults), and one item's failure comes back as
{"score": 0, "error": ...} without touching its batch-mates. GET /health answers
without a token (it reveals only counts), for load balancers and start-up scripts.

Binds 127.0.0.1 unless told otherwise: reward functions run user code on user data,
and a service on a public address wants a token (--token-env).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from rpk.core.records import FinishReason, Prompt, Response
from rpk.http_auth import bearer_auth
from rpk.reward.code import CodeScorer
from rpk.reward.functions import FunctionScorer, Reward, RewardError, load_function, resolve_rewards
from rpk.reward.remote import read_token
from rpk.reward.stack import BySource, SandboxScorer, by_source

Lookup = Callable[[str], Reward]  # data_source -> its reward; RewardError if none

# A batch of long responses (32 x a few 10k-character texts) passes; a runaway client does not.
_MAX_BODY_BYTES = 64 * 1024 * 1024


def lookup_for(spec: str | None) -> Lookup:
    """`module:function` serves every data source; None serves rpk's built-ins."""
    if spec is not None:
        fn = load_function(spec)
        return lambda data_source: fn
    return lambda data_source: resolve_rewards(None, [data_source])[data_source]


class _Service:
    def __init__(self, functions: Lookup, timeout_s: float, max_concurrency: int) -> None:
        self._functions = functions
        self._timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        # Scorers want their data sources up front; the service meets them as they
        # arrive, so it keeps one router per data source, all behind one limit, and
        # one sandbox for every code data source.
        self._scorers: dict[str, BySource] = {}
        self._sandbox = CodeScorer()  # runs nothing until code arrives
        self._slots = asyncio.Semaphore(max_concurrency)
        self.scored = 0
        self.unknown = 0

    def failures(self) -> Counter[str]:
        total: Counter[str] = Counter(unknown_data_source=self.unknown)
        for router in self._scorers.values():
            for scorer in router.scorers:
                assert isinstance(scorer, FunctionScorer)
                total.update(scorer.failures)
        return +total

    def _router(self, data_source: str, reward: Reward) -> BySource:
        return by_source(
            {data_source: reward},
            lambda functions: FunctionScorer(functions, self._timeout_s, self._max_concurrency),
            lambda sources: SandboxScorer(
                self._sandbox, sources, self._timeout_s, self._max_concurrency
            ),
        )

    async def score_item(self, item: dict[str, Any]) -> dict[str, Any]:
        data_source = item["data_source"]
        scorer = self._scorers.get(data_source)
        if scorer is None:
            try:
                reward = self._functions(data_source)
            except RewardError as e:
                self.unknown += 1
                return {"score": 0.0, "acc": None, "error": str(e)}
            scorer = self._scorers[data_source] = self._router(data_source, reward)
        # A reward function sees only these four fields; the token-level parts of the
        # Response are not sent over the wire and stay empty.
        prompt = Prompt(
            item.get("uid") or "", (), data_source, item["ground_truth"], item["extra_info"] or {}
        )
        response = Response(prompt, 0, (), (), FinishReason.STOP, 0, text=item["solution_str"])
        async with self._slots:
            scored = await scorer.score(response)
        self.scored += 1
        if scored.error is not None:
            return {"score": 0.0, "acc": None, "error": scored.error}
        return {"score": scored.reward, "acc": scored.correct, "error": None}


SERVICE = web.AppKey("service", _Service)


_REQUIRED = {"data_source": str, "solution_str": str}
_OPTIONAL = {"extra_info": dict, "uid": str}


def _check_items(body: Any) -> list[dict[str, Any]]:
    """The items of a request body; HTTPBadRequest naming the first bad field."""
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise web.HTTPBadRequest(text="request body must be a JSON object with an 'items' list")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise web.HTTPBadRequest(text=f"item {i} is {type(item).__name__}, not an object")
        if "ground_truth" not in item:
            raise web.HTTPBadRequest(text=f"item {i} has no ground_truth")
        for name, kind in (*_REQUIRED.items(), *_OPTIONAL.items()):
            value = item.get(name)
            if not isinstance(value, kind) and not (name in _OPTIONAL and value is None):
                raise web.HTTPBadRequest(
                    text=f"item {i}: {name} must be {kind.__name__}, got {value!r:.80}"
                )
    return items


async def _score(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"request body is not JSON: {e}") from None
    service = request.app[SERVICE]
    results = await asyncio.gather(*(service.score_item(item) for item in _check_items(body)))
    return web.json_response({"results": results})


async def _health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response(
        {"status": "ok", "scored": service.scored, "failures": dict(service.failures())}
    )


def make_app(
    functions: Lookup,
    token: str | None,
    *,
    timeout_s: float = 30.0,
    max_concurrency: int = 8,
) -> web.Application:
    """The reward service: POST /score, GET /health; a token makes /score require
    `Authorization: Bearer <token>`."""
    app = web.Application(
        middlewares=[bearer_auth(token)] if token else [], client_max_size=_MAX_BODY_BYTES
    )
    app[SERVICE] = _Service(functions, timeout_s, max_concurrency)
    app.router.add_post("/score", _score)
    app.router.add_get("/health", _health)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m rpk.reward.server",
        description="Serve rpk reward functions over HTTP (POST /score, GET /health).",
    )
    ap.add_argument(
        "--function",
        help="module:function with veRL's compute_score signature, for every data source; "
        "unset serves rpk's built-in rewards",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    ap.add_argument("--token-env", help="environment variable holding the bearer token")
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="an item that takes longer scores 0 (default %(default)s)")
    ap.add_argument("--max-concurrency", type=int, default=8,
                    help="items scored at once (default %(default)s)")
    args = ap.parse_args(argv)
    if args.timeout_s <= 0 or args.max_concurrency <= 0:
        ap.error(f"--timeout-s ({args.timeout_s}) and --max-concurrency "
                 f"({args.max_concurrency}) must be > 0")
    try:
        functions = lookup_for(args.function)
        token = read_token(args.token_env, setting="--token-env")
    except RewardError as e:
        print(f"rpk.reward.server: {e}", file=sys.stderr)
        return 2
    app = make_app(functions, token, timeout_s=args.timeout_s, max_concurrency=args.max_concurrency)
    web.run_app(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
