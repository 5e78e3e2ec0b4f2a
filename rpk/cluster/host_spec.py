"""An engine host's speculative-decoding routes: the controller's `SpecTail` reaches a
remote replica's proposer through them, as it reaches a local one through
`collective_rpc` (`rpk.engine.vllm_engine.VLLMEngine.set_drafts`).

    POST /replicas/{name}/spec/round   {"schedule": [[lo, hi, k], ...], "sources": [int],
                                        "prompts": [PromptDrafts wire form]}
    POST /replicas/{name}/spec/add     {"prompts": [PromptDrafts wire form]}
    POST /replicas/{name}/spec/take    -> SpecStats JSON (`SpecStats.to_json`)

A prompt's wire form is `[prompt token ids, [[source, token ids], ...]]`
(`rpk.core.drafts.PromptDrafts.to_wire`); bodies are bounded by the host's JSON limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.engine.replica import Replica
from rpk.http_auth import json_body

Lookup = Callable[[web.Request], tuple[str, Replica]]
_LOOKUP = web.AppKey("spec_lookup", Callable)  # the host's replica lookup by `{name}`


def add_spec_routes(app: web.Application, lookup: Lookup) -> None:
    """The routes, on the replicas `lookup` finds by the request's `{name}`."""
    app[_LOOKUP] = lookup
    app.router.add_post("/replicas/{name}/spec/round", _round)
    app.router.add_post("/replicas/{name}/spec/add", _add)
    app.router.add_post("/replicas/{name}/spec/take", _take)


def prompts_from_json(items: Any) -> list[PromptDrafts]:
    """A list of `PromptDrafts` wire forms; HTTPBadRequest naming the first bad one."""
    if not isinstance(items, list):
        raise web.HTTPBadRequest(text=f"prompts must be a list, got {type(items).__name__}")
    try:
        return [PromptDrafts.from_wire(p) for p in items]
    except (TypeError, ValueError) as e:
        raise web.HTTPBadRequest(text=f"bad prompt drafts: {e}") from None


async def _round(request: web.Request) -> web.Response:
    _, replica = request.app[_LOOKUP](request)
    body = await json_body(request)
    try:
        schedule = [(int(lo), int(hi), int(k)) for lo, hi, k in body["schedule"]]
        sources = [DraftSource(int(s)) for s in body["sources"]]
    except (KeyError, TypeError, ValueError) as e:
        raise web.HTTPBadRequest(text=f"bad speculation round: {e}") from None
    await replica.set_drafts(schedule, sources, prompts_from_json(body.get("prompts", [])))
    return web.json_response({})


async def _add(request: web.Request) -> web.Response:
    _, replica = request.app[_LOOKUP](request)
    await replica.add_drafts(prompts_from_json((await json_body(request)).get("prompts", [])))
    return web.json_response({})


async def _take(request: web.Request) -> web.Response:
    _, replica = request.app[_LOOKUP](request)
    stats: SpecStats = await replica.take_spec_stats()
    return web.json_response(stats.to_json())
