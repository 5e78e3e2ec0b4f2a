"""The judge engines of one node's engine host, and their routes.

When the controller's engine spec carries a judge (`rpk.judge.pool.JudgePlan`:
the placement it worked out once from the memory plan), the host starts one judge engine
on each of its node's rollout GPUs exactly as the controller starts node 0's, before its
replicas (two vLLM engines must not start side by side), and serves them beside the
replicas. `rpk.cluster.remote_judge.RemoteJudge` is the client.

Wire format (JSON, behind the host's bearer token like every other route):

    GET  /judges                      [{"index", "gpu", "state", "can_sleep", "restarts"}]
    POST /judges/{i}/judge            {"request": JudgeRequest.to_dict(), "request_id"}
                                      -> a `Reading` ({"text", "finished", "yes_logprob", ...})
         409: the engine refused this request (the sample's failure);
         410: the engine is dead (every later verdict would fail too)
    POST /judges/{i}/ready            the engine awake (a wake after a rest)
    POST /judges/{i}/sleep            vLLM's sleep at level 1, with the replicas' rest
    POST /judges/{i}/restart          a dead engine started again where it ran (the
                                      controller's pool asks; the answer once it is up)
    POST /judges/{i}/shutdown

A judge wakes when the controller's scorer first needs it after a rest (`ready`, outside
the verdict's timeout), after the replicas' KV cache is back, as on node 0
(`rpk.judge.rest`). A client that goes away mid-verdict (the controller's timeout)
cancels the handler, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from aiohttp import web

from rpk.http_auth import json_body
from rpk.judge.pool import JudgePlan, JudgePool, Relaunch
from rpk.judge.rest import SleepingJudge
from rpk.reward.judge import JudgeDied, JudgeRequest


class NodeJudges:
    """The judge engines of one node by index, with their GPUs and states (awake, asleep,
    stopped, dead), and how each starts again (`relaunch`; None: it cannot)."""

    def __init__(self, node: int, engines: Sequence[SleepingJudge], gpus: Sequence[int],
                 relaunch: Sequence[Relaunch | None] | None = None) -> None:
        if len(engines) != len(gpus):
            raise ValueError(f"node {node}: {len(engines)} judge engines for GPUs {list(gpus)}")
        self.node = node
        self.engines = list(engines)
        self.gpus = list(gpus)
        self.relaunch = list(relaunch) if relaunch is not None else [None] * len(engines)
        self.state = ["awake"] * len(engines)
        self.judged = [0] * len(engines)
        self.restarts = [0] * len(engines)
        self.starting = asyncio.Lock()  # two vLLM engines must not start side by side

    def index(self, request: web.Request) -> int:
        text = request.match_info["index"]
        i = int(text) if text.isdigit() else -1
        if not 0 <= i < len(self.engines):
            raise web.HTTPNotFound(text=f"node {self.node} has no judge engine {text!r}; it has "
                                        f"{len(self.engines)}")
        return i

    def engine(self, request: web.Request) -> tuple[int, SleepingJudge]:
        i = self.index(request)
        if self.state[i] in ("stopped", "dead"):
            raise web.HTTPGone(text=f"{self.where(i)} is {self.state[i]}")
        return i, self.engines[i]

    def where(self, i: int) -> str:
        return f"node {self.node} judge engine {i} (GPU {self.gpus[i]})"

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": i, "gpu": g, "state": s, "can_sleep": e.can_sleep, "restarts": r}
                for i, (e, g, s, r) in enumerate(zip(self.engines, self.gpus, self.state, self.restarts, strict=True))]

    async def aclose(self) -> None:
        """Stops every engine still running, newest first, even past one that fails to
        stop; raises the first failure."""
        first: BaseException | None = None
        for i in reversed(range(len(self.engines))):
            if self.state[i] == "stopped":
                continue
            self.state[i] = "stopped"
            try:
                await self.engines[i].aclose()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


JUDGES = web.AppKey("judges", NodeJudges)


def _asked(body: dict[str, Any]) -> tuple[JudgeRequest, str]:
    rid = body.get("request_id")
    try:
        if not isinstance(rid, str) or not isinstance(body.get("request"), dict):
            raise ValueError("'request' must be an object and 'request_id' a string")
        return JudgeRequest.from_dict(body["request"]), rid
    except ValueError as e:
        raise web.HTTPBadRequest(text=f"{e}; got {str(body)[:160]}") from None


@contextlib.contextmanager
def _answering(judges: NodeJudges, i: int, what: str, refused: type[Exception]) -> Iterator[None]:
    """An engine call's failure as the route's answer: a dead engine is gone for good (410,
    and marked dead: every later call would fail too); a `refused` one is this call's
    alone (409)."""
    try:
        yield
    except JudgeDied as e:
        judges.state[i] = "dead"
        raise web.HTTPGone(text=f"{judges.where(i)}: {e}") from None
    except refused as e:
        raise web.HTTPConflict(text=f"{judges.where(i)}: {what}{type(e).__name__}: {e}") from None


async def _judge(request: web.Request) -> web.Response:
    judges = request.app[JUDGES]
    i, engine = judges.engine(request)
    asked, rid = _asked(await json_body(request, optional=True))
    # Any other failure is the engine refusing this request: the sample's failure alone.
    with _answering(judges, i, "", Exception):
        reading = await engine.judge(asked, rid)
    judges.state[i] = "awake"
    judges.judged[i] += 1
    return web.json_response(dataclasses.asdict(reading))


def _state_route(
    call: Callable[[SleepingJudge], Awaitable[None]], what: str, refused: type[Exception], after: str,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A route that moves engine {index} to state `after` through `call` (wake, sleep)."""

    async def route(request: web.Request) -> web.Response:
        judges = request.app[JUDGES]
        i, engine = judges.engine(request)
        with _answering(judges, i, what, refused):
            await call(engine)
        judges.state[i] = after
        return web.json_response({"index": i, "state": after})

    return route


async def _restart(request: web.Request) -> web.Response:
    judges = request.app[JUDGES]
    i = judges.index(request)
    relaunch = judges.relaunch[i]
    if judges.state[i] == "stopped" or relaunch is None:
        raise web.HTTPConflict(text=f"{judges.where(i)} is {judges.state[i]} and cannot be restarted")
    judges.state[i] = "dead"  # whatever it was: no verdict reaches it while it starts
    async with judges.starting:
        try:
            judges.engines[i] = await relaunch(judges.engines[i])
        except Exception as e:
            raise web.HTTPServiceUnavailable(text=f"{judges.where(i)}: its restart failed: "
                                                  f"{type(e).__name__}: {e}") from None
    judges.state[i] = "awake"
    judges.restarts[i] += 1
    return web.json_response({"index": i, "state": "awake", "restarts": judges.restarts[i]})


async def _shutdown(request: web.Request) -> web.Response:
    judges = request.app[JUDGES]
    i, engine = judges.engine(request)
    judges.state[i] = "stopped"
    await engine.aclose()
    return web.json_response({"index": i, "state": "stopped"})


async def _list(request: web.Request) -> web.Response:
    return web.json_response(request.app[JUDGES].describe())


def add_judge_routes(app: web.Application, judges: NodeJudges) -> None:
    app[JUDGES] = judges
    app.router.add_get("/judges", _list)
    app.router.add_post("/judges/{index}/judge", _judge)
    app.router.add_post("/judges/{index}/ready", _state_route(lambda e: e.ready(), "wake: ", Exception, "awake"))
    # Only a refusal to sleep (sleep mode off) is the call's alone; anything else is a bug.
    app.router.add_post("/judges/{index}/sleep", _state_route(lambda e: e.sleep(), "sleep: ", RuntimeError, "asleep"))
    app.router.add_post("/judges/{index}/restart", _restart)
    app.router.add_post("/judges/{index}/shutdown", _shutdown)


async def start_judges(launch: str, node: int, visible: str | None, log: Callable[[str], None]) -> NodeJudges:
    """This node's judge engines from the spec's `launch` (JSON; "": none), pinned through
    `visible` (the node's CUDA_VISIBLE_DEVICES)."""
    if not launch:
        return NodeJudges(node, [], [])
    spec = JudgePlan.from_json(launch)
    if spec.device is None:
        raise ValueError(f"node {node}: the engine spec's judge has no place on the GPUs")
    pool = await spec.start(visible, node)
    assert isinstance(pool, JudgePool)  # an engine per place
    log(f"judge {spec.settings.model}: an engine on each of GPUs {list(spec.devices)}")
    return NodeJudges(node, pool.engines, spec.devices, [m.relaunch for m in pool.members])
