"""`python -m rpk.cluster.host`: one node's rollout replicas, served to the controller.

On every engine node but the controller's, local rank 0 starts this process
(`rpk.cluster.nodes`); it starts the node's replicas exactly as the controller starts its
own (`launch_fleet`: every layout of the TP sizes on this node's devices, TP groups
inside the node, rpk's stat logger, the worker extension for weights) and serves them
over aiohttp, with the node's judge engines where the run has a judge on the GPUs
(`rpk.cluster.host_judges`). `rpk.cluster.remote.RemoteReplica` (and
`rpk.cluster.remote_judge.RemoteJudge`) is the client; why rpk's own service rather than
vLLM's OpenAI server is in docs/design.md ("Engine hosts").

Wire format (JSON; every route but /health wants `Authorization: Bearer <token>`):

    GET  /health                      {"status", "node", "live"}   (no token: a heartbeat)
    GET  /replicas                    [{"name", "tp", "state", "max_concurrency", "weight_version",
                                        "backend"}]
    POST /replicas/{name}/generate    {"requests": [GenRequest fields]} -> NDJSON stream:
         {"id", "t": token ids, "lp": logprobs, "x": text, "f": finish reason | null}
         per delta, `"stats"` (ReplicaStats fields) on each finished one, {"id", "error"}
         for a request vLLM failed, and {} every `heartbeat_s` while nothing else is sent
    POST /replicas/{name}/abort       {"request_ids": [...]}
    POST /replicas/{name}/sleep | /wake | /shutdown
    PUT  /weights/{update}/{index}    one bucket, safetensors bytes
    POST /weights/{update}/load       {"version", "replicas": [names]}; the files are removed
    DELETE /weights/{update}          drop an update's files
    GET  /judges, POST /judges/{i}/judge | sleep | shutdown
         the node's judge engines, where the spec has a judge (`rpk.cluster.host_judges`)
    POST /replicas/{name}/transfer/init | start | update | finish | shutdown | loaded
         vLLM's weight-transfer calls on the replica: {"init_info"}, {}, {"update_info"},
         {"version"}, {}; `loaded` ({"version"}) after finish drops stale KV and sets the
         replica's version. With gloo the bytes do not pass here: the replica's workers
         receive them in the trainer's group.
    GET  /replicas/{name}/digests     [{HF name: sha256}] per worker, of the last update
    POST /replicas/{name}/spec/round | add | take
         speculative decoding's draft texts and counters (`rpk.cluster.host_spec`)

`--tls-cert/--tls-key` serve all of it over TLS (the controller checks the certificate,
`dist.tls_ca`).

A generate call pauses the replica, adds the batch and resumes it before the stream's
headers go out: when the client has the headers, its requests are in the engine and
started at one scheduler step. The stream ends when every request of the batch has
ended; a client that goes away (disconnect, a write that fails) aborts what is left of
its batch, so no request runs on for nobody.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from rpk.cluster.host_judges import NodeJudges, add_judge_routes, start_judges
from rpk.cluster.host_spec import add_spec_routes
from rpk.core.errors import UserError
from rpk.core.modes import RestLevel
from rpk.core.records import GenDelta, GenRequest
from rpk.engine.layouts import Layouts
from rpk.engine.placement import fleet_plan
from rpk.engine.replica import Replica
from rpk.engine.vllm_fleet import launch_fleet
from rpk.engine.vllm_settings import settings_from_json
from rpk.http_auth import bearer_auth, json_body
from rpk.lifetime import die_with_parent
from rpk.sync.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterDirs, AdapterVersion
from rpk.sync.backends import REMOTE, Backend, parse
from rpk.sync.spool import spool_file

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Deltas waiting between a batch's requests and its HTTP stream: the writer drains it
# as fast as the socket takes them, and a full queue makes the requests' pumps wait
# (vLLM's own per-request collector then merges deltas instead of growing a queue).
_STREAM_QUEUE = 1024
# JSON bodies (a batch of requests, control calls); weight buckets stream to files and
# are bounded by --max-bucket-mb instead.
_MAX_JSON_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class UploadCaps:
    """What the trainer may spool on a node: a bucket's bytes, and per update (a version)
    its buckets and bytes, and the updates spooled and not yet loaded. A client cannot
    fill the node's memory."""

    max_bucket_bytes: int
    max_update_buckets: int = 4096
    max_update_bytes: int = 2**37
    max_pending_updates: int = 2


class HostService:
    """The replicas of one node by name, and what the routes do with them."""

    def __init__(
        self, node: int, layouts: Layouts, *, max_live: int, heartbeat_s: float, caps: UploadCaps,
    ) -> None:
        self.node = node
        self.layouts = layouts
        self.replicas: dict[str, Replica] = {}
        self.tp_of: dict[str, int] = {}
        self.state: dict[str, str] = {}  # awake / asleep / stopped, per replica
        for layout in layouts.all:
            for name, replica in zip(layout.names, layout.replicas):
                self.replicas[name] = replica
                self.tp_of[name] = layout.tp
                self.state[name] = layout.state.value
        self.max_live = max_live
        self.heartbeat_s = heartbeat_s
        self.caps = caps
        self.live = 0  # requests added and not yet ended, over every replica
        self.served: dict[str, int] = dict.fromkeys(self.replicas, 0)
        self._updates: dict[str, dict[int, Path]] = {}
        self._bytes: dict[str, int] = {}  # declared bytes spooled, per update
        self.sync_started: dict[str, float] = {}  # per replica, its transfer's `start`
        self._adapters: AdapterDirs | None = None

    @property
    def adapters(self) -> AdapterDirs:
        """This node's LoRA adapter directories (made at the first adapter)."""
        if self._adapters is None:
            self._adapters = AdapterDirs()
        return self._adapters

    def replica(self, request: web.Request) -> tuple[str, Replica]:
        name = request.match_info["name"]
        if name not in self.replicas:
            raise web.HTTPNotFound(text=f"node {self.node} has no replica {name!r}; it has {sorted(self.replicas)}")
        return name, self.replicas[name]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "tp": self.tp_of[n], "state": self.state[n],
             "max_concurrency": r.max_concurrency, "weight_version": r.weight_version,
             "backend": str(getattr(getattr(r, "settings", None), "backend", Backend.SPOOL)),
             "speculates": bool(getattr(r, "speculates", False))}
            for n, r in self.replicas.items()
        ]

    def spool(self, update: str, index: int, nbytes: int) -> Path:
        """A fresh file for bucket `index` of `update` (in /dev/shm when it has room)."""
        if update not in self._updates and len(self._updates) >= self.caps.max_pending_updates:
            raise web.HTTPTooManyRequests(
                text=f"node {self.node}: {len(self._updates)} updates already spooled and not "
                     f"loaded ({sorted(self._updates)}); the cap is {self.caps.max_pending_updates}")
        files = self._updates.setdefault(update, {})
        if index in files:
            raise web.HTTPConflict(text=f"node {self.node}: bucket {index} of update {update} sent twice")
        if len(files) >= self.caps.max_update_buckets:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.caps.max_update_buckets, actual_size=len(files) + 1,
                text=f"node {self.node}: update {update} has {len(files)} buckets; the cap is "
                     f"{self.caps.max_update_buckets}")
        held = self._bytes.get(update, 0)
        if held + nbytes > self.caps.max_update_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.caps.max_update_bytes, actual_size=held + nbytes,
                text=f"node {self.node}: update {update} would hold {held + nbytes} bytes; the cap "
                     f"is {self.caps.max_update_bytes}")
        files[index] = spool_file(nbytes)
        self._bytes[update] = held + nbytes
        return files[index]

    def take_update(self, update: str) -> list[Path]:
        """An update's files in bucket order, no longer the service's to remove."""
        files = self._updates.pop(update, {})
        self._bytes.pop(update, None)
        return [files[i] for i in sorted(files)]

    def discard_updates(self) -> None:
        for update in list(self._updates):
            for path in self.take_update(update):
                path.unlink(missing_ok=True)


SERVICE = web.AppKey("service", HostService)


def request_from_json(item: Any) -> GenRequest:
    """A GenRequest from its wire form; HTTPBadRequest naming the first bad field."""
    if not isinstance(item, dict):
        raise web.HTTPBadRequest(text=f"a request is {type(item).__name__}, not an object")
    try:
        request = GenRequest(**{**item, "prompt_token_ids": tuple(item["prompt_token_ids"])})
    except (KeyError, TypeError) as e:
        raise web.HTTPBadRequest(text=f"bad request {str(item)[:120]}: {e}") from None
    if not isinstance(request.request_id, str) or not isinstance(request.max_tokens, int):
        raise web.HTTPBadRequest(text=f"bad request {str(item)[:120]}: request_id must be a "
                                      "string and max_tokens an integer")
    return request


def delta_line(delta: GenDelta) -> dict[str, Any]:
    line = {"id": delta.request_id, "t": delta.token_ids, "lp": delta.logprobs, "x": delta.text,
            "f": delta.finish_reason.value if delta.finish_reason is not None else None}
    if delta.accepted:
        line["a"] = delta.accepted
    return line


async def _generate(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    name, replica = service.replica(request)
    items = (await json_body(request)).get("requests")
    if not isinstance(items, list) or not items:
        raise web.HTTPBadRequest(text="'requests' must be a non-empty list")
    batch = [request_from_json(item) for item in items]
    if service.live + len(batch) > service.max_live:
        raise web.HTTPServiceUnavailable(
            text=f"node {service.node}: {service.live} requests live + {len(batch)} would "
                 f"exceed its bound of {service.max_live}")
    try:
        async with replica.paused():
            streams = await replica.add(batch)
    except (ValueError, RuntimeError) as e:
        raise web.HTTPConflict(text=f"node {service.node} replica {name}: {e}") from None
    service.live += len(batch)
    service.served[name] += len(batch)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    try:
        await response.prepare(request)
        await _stream_batch(service, replica, streams, response)
    except BaseException as e:
        # Streams not pumped yet (the client left before the headers) abort here; a
        # client gone mid-stream is no error of the host's: its requests are aborted.
        for stream in streams.values():
            await asyncio.shield(stream.aclose())  # type: ignore[attr-defined]
        if not isinstance(e, ConnectionResetError):
            raise
    finally:
        service.live -= len(batch)
    return response


async def _stream_batch(
    service: HostService, replica: Replica, streams: Mapping[str, AsyncIterator[GenDelta]],
    response: web.StreamResponse,
) -> None:
    """Pump every request's deltas into one queue and write them out as lines; leaving
    early (the client gone) closes the streams, which aborts their requests."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(_STREAM_QUEUE)

    async def pump(rid: str, stream: AsyncIterator[GenDelta]) -> None:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            try:
                async for delta in stream:
                    line = delta_line(delta)
                    if delta.finished:
                        line["stats"] = dataclasses.asdict(replica.take_stats())
                    await queue.put(line)
            except Exception as e:  # vLLM failed this request: its batch-mates go on
                await queue.put({"id": rid, "error": f"{type(e).__name__}: {e}"})
        await queue.put(None)

    left = len(streams)
    async with asyncio.TaskGroup() as tg:
        pumps = [tg.create_task(pump(rid, s), name=f"host-pump-{rid}") for rid, s in streams.items()]
        try:
            while left:
                try:
                    line = await asyncio.wait_for(queue.get(), service.heartbeat_s)
                except TimeoutError:
                    line = {}
                if line is None:
                    left -= 1
                    continue
                await response.write(json.dumps(line).encode() + b"\n")
        except BaseException:
            for task in pumps:
                task.cancel()
            raise
    await response.write_eof()


async def _abort(request: web.Request) -> web.Response:
    _, replica = request.app[SERVICE].replica(request)
    ids = (await json_body(request)).get("request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise web.HTTPBadRequest(text="'request_ids' must be a list of strings")
    for rid in ids:
        await replica.abort(rid)
    return web.json_response({"aborted": len(ids)})


async def _lifecycle(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    name, replica = service.replica(request)
    action = request.match_info["action"]
    # sleep's level and wake's tags, where the caller gave them.
    args = await json_body(request, optional=True)
    if "level" in args:
        args["level"] = RestLevel(args["level"])
    try:
        await {"sleep": replica.sleep, "wake": replica.wake, "shutdown": replica.shutdown}[action](**args)
    except RuntimeError as e:
        raise web.HTTPConflict(text=f"node {service.node} replica {name}: {action}: {e}") from None
    service.state[name] = {"sleep": "asleep", "wake": "awake", "shutdown": "stopped"}[action]
    return web.json_response({"name": name, "weight_version": replica.weight_version})


async def _put_bucket(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    update, index = request.match_info["update"], int(request.match_info["index"])
    if not _NAME.match(update):
        raise web.HTTPBadRequest(text=f"bad update id {update!r}")
    size = request.content_length
    if size is None or size > service.caps.max_bucket_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=service.caps.max_bucket_bytes, actual_size=size or -1)
    path = service.spool(update, index, size)
    with path.open("wb") as f:
        async for chunk in request.content.iter_chunked(1 << 20):
            await asyncio.to_thread(f.write, chunk)
    return web.json_response({"bytes": path.stat().st_size})


async def _load(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    body = await json_body(request)
    version, names = body.get("version"), body.get("replicas")
    if not isinstance(version, int) or not isinstance(names, list) or not names:
        raise web.HTTPBadRequest(text="'version' must be an integer and 'replicas' a non-empty list")
    unknown = [n for n in names if n not in service.replicas]
    if unknown:
        raise web.HTTPNotFound(text=f"node {service.node} has no replicas {unknown}")
    paths = service.take_update(request.match_info["update"])
    if not paths:
        raise web.HTTPNotFound(text=f"node {service.node}: no buckets for update {request.match_info['update']!r}")
    try:
        await asyncio.gather(*(service.replicas[n].load_weight_files(paths, version)  # type: ignore[attr-defined]
                               for n in names))
    except RuntimeError as e:
        raise web.HTTPConflict(text=f"node {service.node}: weight load: {e}") from None
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return web.json_response({"version": version, "replicas": names})


async def _load_adapter(request: web.Request) -> web.Response:
    """A LoRA run's adapter version (`rpk.sync.adapter`): the update's two files (the
    weights, then `adapter_config.json`) become this node's adapter directory, installed
    on the named replicas under the controller's adapter name and id."""
    service = request.app[SERVICE]
    body = await json_body(request)
    version, names, name, lora_id = (body.get(k) for k in ("version", "replicas", "name", "lora_id"))
    if not (isinstance(version, int) and isinstance(lora_id, int) and isinstance(name, str)
            and isinstance(names, list) and names):
        raise web.HTTPBadRequest(text="'version' and 'lora_id' must be integers, 'name' a string and "
                                      "'replicas' a non-empty list")
    unknown = [n for n in names if n not in service.replicas]
    if unknown:
        raise web.HTTPNotFound(text=f"node {service.node} has no replicas {unknown}")
    paths = service.take_update(request.match_info["update"])
    if len(paths) != 2:
        for path in paths:
            path.unlink(missing_ok=True)
        raise web.HTTPBadRequest(text=f"node {service.node}: an adapter is 2 files (weights, config), got {len(paths)}")
    target = service.adapters.path(version)
    target.mkdir(parents=True, exist_ok=True)
    for path, file in zip(paths, (WEIGHTS_FILE, CONFIG_FILE)):
        path.replace(target / file)
    replicas = [service.replicas[n] for n in names]
    installed = AdapterVersion(name, lora_id, str(target))
    try:
        await asyncio.gather(*(r.load_adapter(installed, version) for r in replicas))  # type: ignore[attr-defined]
    except RuntimeError as e:
        raise web.HTTPConflict(text=f"node {service.node}: adapter load: {e}") from None
    service.adapters.serving(replicas, target)
    return web.json_response({"version": version, "replicas": names})


async def _drop_update(request: web.Request) -> web.Response:
    for path in request.app[SERVICE].take_update(request.match_info["update"]):
        path.unlink(missing_ok=True)
    return web.json_response({})


async def _transfer(request: web.Request) -> web.Response:
    """One call of vLLM's weight-transfer protocol on a replica (the module docstring)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    service = request.app[SERVICE]
    name, replica = service.replica(request)
    op = request.match_info["op"]
    body = await json_body(request, optional=True)
    llm: Any = replica.llm  # type: ignore[attr-defined]
    try:
        if op == "init":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=body["init_info"]))
        elif op == "start":
            service.sync_started[name] = time.perf_counter()
            await llm.start_weight_update()
        elif op == "update":
            await llm.update_weights(WeightTransferUpdateRequest(update_info=body["update_info"]))
        elif op == "finish":
            await llm.finish_weight_update(body.get("version"))
        elif op == "shutdown":
            await llm.shutdown_weight_transfer_engine()
        else:  # loaded
            started = service.sync_started.pop(name, time.perf_counter())
            await replica.weights_loaded(int(body["version"]), started)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as e:
        raise web.HTTPBadRequest(text=f"node {service.node} replica {name}: transfer {op}: "
                                      f"bad body: {type(e).__name__}: {e}") from None
    except Exception as e:  # vLLM's failure, on this replica: the controller names it
        raise web.HTTPConflict(text=f"node {service.node} replica {name}: transfer {op}: "
                                    f"{type(e).__name__}: {e}") from None
    return web.json_response({"name": name, "weight_version": replica.weight_version})


async def _digests(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    name, replica = service.replica(request)
    try:
        workers = await replica.llm.collective_rpc("rpk_weight_digests")  # type: ignore[attr-defined]
    except Exception as e:
        raise web.HTTPConflict(text=f"node {service.node} replica {name}: digests: "
                                    f"{type(e).__name__}: {e}") from None
    return web.json_response(workers)


async def _replicas(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].describe())


async def _health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response({"status": "ok", "node": service.node, "live": service.live})


def make_app(service: HostService, token: str, judges: NodeJudges | None = None) -> web.Application:
    if not token:
        raise ValueError("an engine host needs a token: it serves weights and generation")
    app = web.Application(middlewares=[bearer_auth(token)], client_max_size=_MAX_JSON_BYTES)
    app[SERVICE] = service
    app.router.add_get("/health", _health)
    app.router.add_get("/replicas", _replicas)
    app.router.add_post("/replicas/{name}/generate", _generate)
    app.router.add_post("/replicas/{name}/abort", _abort)
    app.router.add_post(r"/replicas/{name}/{action:sleep|wake|shutdown}", _lifecycle)
    app.router.add_put(r"/weights/{update}/{index:\d+}", _put_bucket)
    app.router.add_post("/weights/{update}/load", _load)
    app.router.add_post("/weights/{update}/adapter", _load_adapter)
    app.router.add_delete("/weights/{update}", _drop_update)
    app.router.add_post(r"/replicas/{name}/transfer/{op:init|start|update|finish|shutdown|loaded}", _transfer)
    app.router.add_get("/replicas/{name}/digests", _digests)
    add_judge_routes(app, judges or NodeJudges(service.node, [], []))
    add_spec_routes(app, service.replica)
    return app


def server_ssl(cert: Path, key: Path) -> ssl.SSLContext:
    """The host's TLS context from its certificate (chain) and private key (PEM)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"--tls-cert {cert} / --tls-key {key}: cannot load them: {e}") from e
    return context


async def serve(
    app: web.Application, bind: str, port: int, tls: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Start serving (over TLS with `tls`); the runner (to clean up) and the port bound
    (0 picks a free one)."""
    # Handlers that are cancelled when their client goes away: a generate stream whose
    # controller vanished aborts its batch at once instead of at the next heartbeat.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, bind, port, ssl_context=tls)
    await site.start()
    return runner, int(runner.addresses[0][1])


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rpk.cluster.host",
                                 description="Serve one node's rollout replicas to rpk's controller.")
    ap.add_argument("--model", required=True, help="HF model directory (the same on every node)")
    ap.add_argument("--node", type=int, default=0, help="this node's index (for messages)")
    ap.add_argument("--tp-sizes", type=_csv_ints, default=(1,), help="layouts built, e.g. 1,2")
    ap.add_argument("--tp", type=int, default=1, help="the layout awake first")
    ap.add_argument("--devices", type=_csv_ints, default=(), help="this node's rollout devices, e.g. 0,1")
    ap.add_argument("--version", type=int, default=0, help="weight version the model directory holds")
    ap.add_argument("--engine", default="{}", help="VLLMSettings fields as JSON (model excluded)")
    ap.add_argument("--judge", default="", help="the judge's JudgePlan as JSON: an engine per device")
    ap.add_argument("--bind", default="127.0.0.1", help="address to listen on (default %(default)s)")
    ap.add_argument("--port", type=int, default=0, help="port; 0 = a free one (default)")
    ap.add_argument("--token-env", default="RPK_ENGINE_TOKEN", help="variable holding the bearer token")
    ap.add_argument("--ready-file", type=Path, help="written (JSON: url, node, replicas) once serving")
    ap.add_argument("--heartbeat-s", type=float, default=5.0, help="idle streams get a line this often")
    # A bucket holds at least one whole tensor, which can outgrow rollout.weight_bucket_mb
    # (a large vocabulary's embedding): the default only stops a runaway client.
    ap.add_argument("--max-bucket-mb", type=int, default=16384, help="largest weight bucket accepted")
    ap.add_argument("--weight-transfer", default=Backend.SPOOL.value, choices=[b.value for b in REMOTE],
                    help="the replicas' weight path: gloo (the trainer's group), shm (the HTTP "
                         "upload fallback only), or adapter (a LoRA run's adapters, uploaded)")
    ap.add_argument("--adapter", default="", help="a LoRA run's adapter_config.json content, as JSON")
    ap.add_argument("--verify", action="store_true",
                    help="the workers record digests of the weights they receive (run.verify_sync)")
    ap.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate (PEM)")
    ap.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    args = ap.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        ap.error(f"--tls-cert ({args.tls_cert}) and --tls-key ({args.tls_key}) go together")
    if args.heartbeat_s <= 0 or args.max_bucket_mb <= 0 or args.node < 0:
        ap.error(f"--heartbeat-s ({args.heartbeat_s}), --max-bucket-mb ({args.max_bucket_mb}) must "
                 f"be > 0 and --node ({args.node}) >= 0")
    if not os.environ.get(args.token_env):
        ap.error(f"--token-env={args.token_env}: the variable is unset or empty")
    return args


async def _main(args: argparse.Namespace) -> None:
    import torch

    settings = settings_from_json(args.model, json.loads(args.engine))
    plan = fleet_plan(args.devices, args.tp_sizes, args.tp, len(args.tp_sizes) > 1)
    platform = "cuda" if torch.cuda.is_available() else "cpu"
    def log(line: str) -> None:
        print(f"rpk engine host, node {args.node}: {line}", file=sys.stderr, flush=True)

    tls = server_ssl(args.tls_cert, args.tls_key) if args.tls_cert is not None else None
    # Before the replicas, as on node 0: two vLLM engines must not start side by side.
    judges = await start_judges(args.judge, args.node, os.environ.get("CUDA_VISIBLE_DEVICES"), log)
    try:
        fleet = await launch_fleet(settings, plan, platform=platform, version=args.version, log=log,
                                   backend=parse(args.weight_transfer), verify=args.verify,
                                   adapter=json.loads(args.adapter) if args.adapter else None)
    except BaseException:
        await judges.aclose()
        raise
    max_live = 4 * sum(r.max_concurrency for layout in fleet.layouts.all for r in layout.replicas)
    service = HostService(args.node, fleet.layouts, max_live=max_live, heartbeat_s=args.heartbeat_s,
                          caps=UploadCaps(max_bucket_bytes=args.max_bucket_mb * 2**20))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner, port = await serve(make_app(service, os.environ[args.token_env], judges), args.bind, args.port, tls)
    try:
        if args.ready_file is not None:
            scheme = "https" if tls is not None else "http"
            ready = {"url": f"{scheme}://{args.bind}:{port}", "node": args.node, "replicas": service.describe(),
                     "judges": judges.describe()}
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(ready))
            tmp.replace(args.ready_file)
        log(f"serving {sorted(service.replicas)} on {args.bind}:{port}")
        await stop.wait()
    finally:
        await runner.cleanup()
        service.discard_updates()
        log("served " + ", ".join(f"{n}: {k} requests" for n, k in service.served.items()))
        try:
            await fleet.shutdown()
        finally:
            await judges.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        asyncio.run(_main(args))
    except UserError as e:  # a bad model directory or settings: one line, not a traceback
        print(f"rpk engine host, node {args.node}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
