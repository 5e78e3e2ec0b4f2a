"""Replicas on other nodes, reached over aiohttp: the client side of `rpk.cluster.host`.

`RemoteReplica` is a `Replica` like a local `VLLMEngine`, so the fleet, its router and
layouts do not tell them apart. Each `add` is one HTTP stream that carries the deltas of
the batch's requests as they come (the host multiplexes them, one JSON line each); a
reader task per batch hands each delta to its request's bounded queue. The host pauses
its replica around the add, so `paused()` here holds nothing open across the network:
a controller that dies cannot leave a replica paused.

Statistics ride on the stream: each finished request's line carries what the host's
stat logger counted since the line before, so `take_stats` needs no call (the `Replica`
protocol reads it synchronously); what a round's last lines have not yet brought is
counted in the next round.

Weights reach a remote replica through vLLM's weight-transfer protocol, like a local
one: `RemoteReplica.llm` is the part of `AsyncLLM` that `rpk.sync.lanes` and
`rpk.sync.verify` call (init, start, update, finish, the digests), each one HTTP call
to the host, which makes it on its replica. With gloo, the bytes then go straight from
the trainer to the host's workers in one group with every other replica's; the HTTP
calls only carry the control. `NodeTransport` is the fallback: the buckets spooled once
(the local replicas load those files), and each host receives the same files over
HTTP, one upload per node however many replicas it serves.

A host serving TLS (`--tls-cert/--tls-key`) is reached at https://, its certificate
checked against the controller's `dist.tls_ca` (`client_ssl`).

Every failure to reach a host, a stream it drops or stops heartbeating on, and an error
it answers with raise `HostError`, naming the node and its address. `HostClient.health`
is the bounded-time heartbeat a supervisor can poll.

The judge engines a host serves are `rpk.cluster.remote_judge`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.errors import NodeFailure, UserError
from rpk.core.modes import RestLevel
from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.sync.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterVersion
from rpk.sync.backends import Backend
from rpk.sync.spool import spooled

# Deltas one request may have waiting for its consumer; a full queue stalls its batch's
# reader, and so (through TCP) the host's writer: memory stays bounded end to end.
_REQUEST_QUEUE = 256
_BODY_EXCERPT = 300


class HostError(NodeFailure):
    """A node's engine host cannot be reached, failed a call, or dropped a stream."""

    def __init__(self, node: int, url: str, what: str) -> None:
        super().__init__(node, f"engine host {url}: {what}")
        self.url = url


class RemoteGenerationError(RuntimeError):
    """The host's vLLM ended one request with an error; its batch-mates go on."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 10.0
    call_s: float = 60.0  # abort, sleep, wake, health, the replica list
    weights_s: float = 1800.0  # one bucket's upload, or the load of an update
    # A generate stream silent this long is dead: hosts send a heartbeat line every
    # few seconds (`--heartbeat-s`), also while no request has output yet.
    stream_idle_s: float = 30.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in dataclasses.asdict(self).items() if not v > 0}
        if bad:
            raise ValueError(f"timeouts must be > 0, got {bad}")


class HostClient:
    """One node's host: its address, token and HTTP session (made on first use, in the
    event loop that uses it)."""

    def __init__(
        self, node: int, url: str, token: str, timeouts: Timeouts = Timeouts(),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.node = node
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._headers = {"Authorization": f"Bearer {token}"}
        self._tls = tls  # None: the default checks (https against the system's CAs)
        self._session: aiohttp.ClientSession | None = None
        self.users = 0  # replicas using this client; the last to shut down closes it

    def error(self, what: str) -> HostError:
        return HostError(self.node, self.url, what)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._tls) if self._tls is not None else None
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector)
        return self._session

    @contextlib.asynccontextmanager
    async def fresh_session(self) -> AsyncIterator[aiohttp.ClientSession]:
        """A session of its own on a new connection, closed after one use: a retry must
        not meet the pooled socket that just failed, or its stale siblings."""
        connector = aiohttp.TCPConnector(ssl=self._tls if self._tls is not None else True, force_close=True)
        async with aiohttp.ClientSession(headers=self._headers, connector=connector) as session:
            yield session

    def _timeout(self, total: float | None, sock_read: float | None = None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.timeouts.connect_s, sock_read=sock_read)

    async def call(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """One request; its JSON answer. HostError on anything but a 2xx answer."""
        timeout = self._timeout(timeout_s or self.timeouts.call_s)
        try:
            async with self.session.request(method, self.url + path, timeout=timeout, **kwargs) as resp:
                if resp.status >= 300:
                    raise self.error(f"{method} {path}: HTTP {resp.status}: {(await resp.text())[:_BODY_EXCERPT]}")
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self.error(f"{method} {path}: {type(e).__name__}: {e or 'timed out'}") from e

    async def stop_and_release(self, path: str) -> None:
        """POST `path` (an engine's shutdown; a host already gone is not an error here,
        its engines went with it), then give up one user's hold: the last closes."""
        try:
            with contextlib.suppress(HostError):
                await self.call("POST", path)
        finally:
            self.users -= 1
            if self.users <= 0:
                await self.close()

    async def health(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The host's heartbeat ({"status", "node", "live"}) within `timeout_s`."""
        return await self.call("GET", "/health", timeout_s=timeout_s)

    async def replicas(self) -> list[dict[str, Any]]:
        return await self.call("GET", "/replicas")

    async def open_stream(self, path: str, body: Any) -> aiohttp.ClientResponse:
        """A streamed POST; the response once its headers are in."""
        timeout = self._timeout(None, sock_read=self.timeouts.stream_idle_s)
        try:
            resp = await self.session.post(self.url + path, json=body, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise self.error(f"POST {path}: {type(e).__name__}: {e or 'timed out'}") from e
        if resp.status >= 300:
            text = (await resp.text())[:_BODY_EXCERPT]
            resp.release()
            raise self.error(f"POST {path}: HTTP {resp.status}: {text}")
        return resp

    async def upload(self, path: str, file: Path) -> None:
        size = (await asyncio.to_thread(file.stat)).st_size
        with file.open("rb") as f:  # aiohttp reads it in its executor, chunk by chunk
            await self.call("PUT", path, data=f, timeout_s=self.timeouts.weights_s,
                            headers={"Content-Length": str(size)})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class TLSError(UserError, ValueError):
    """A TLS file the controller cannot use."""


def client_ssl(ca_file: str = "") -> ssl.SSLContext:
    """The controller's TLS context for engine hosts: their certificates checked against
    `ca_file` (a CA bundle, or a self-signed host certificate itself), else the system's
    CAs, and the host name or IP address they are reached at checked against them."""
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as e:
        raise TLSError(f"dist.tls_ca={ca_file!r}: cannot load it: {e}") from e


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """What the weight path reads of a replica's settings."""

    tensor_parallel_size: int
    backend: Backend  # the weight path the host started it with
    devices: tuple[int, ...] = ()  # no GPU of the trainer's: never a CUDA IPC lane


class RemoteLLM:
    """The calls of vLLM's `AsyncLLM` that a weight sync makes, on a replica of a host:
    the same arguments, one authenticated HTTP call each (they last as long as the
    transfer, so they get the weights' timeout)."""

    def __init__(self, client: HostClient, name: str) -> None:
        self._client = client
        self._name = name

    async def _op(self, op: str, body: dict[str, Any] | None = None) -> Any:
        return await self._client.call("POST", f"/replicas/{self._name}/transfer/{op}", json=body or {},
                                       timeout_s=self._client.timeouts.weights_s)

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._op("init", {"init_info": request.init_info})

    async def start_weight_update(self) -> None:
        await self._op("start")

    async def update_weights(self, request: Any) -> None:
        await self._op("update", {"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._op("finish", {"version": weight_version})

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._op("shutdown")

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Only `rpk_weight_digests` (one dict per worker) crosses to a host."""
        if method != "rpk_weight_digests" or args:
            raise ValueError(f"a remote replica answers only rpk_weight_digests(), not {method}{args}")
        return await self._client.call("GET", f"/replicas/{self._name}/digests",
                                       timeout_s=self._client.timeouts.weights_s)


@dataclass(eq=False, slots=True)
class _Batch:
    """One add's stream: each request's queue until its consumer is done with it."""

    queues: dict[str, asyncio.Queue[GenDelta | BaseException]]
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        for queue in self.queues.values():
            if queue.full():  # the request is lost anyway: room for the error
                queue.get_nowait()
            queue.put_nowait(error)


class RemoteReplica:
    """A replica that a node's engine host serves (see the module docstring)."""

    def __init__(
        self, client: HostClient, name: str, max_concurrency: int, weight_version: int | None,
        settings: RemoteSettings = RemoteSettings(1, None),
    ) -> None:
        self.client = client
        client.users += 1
        self.name = name
        self._max_concurrency = max_concurrency
        self.weight_version = weight_version
        self.adapter: AdapterVersion | None = None  # a LoRA run's, installed on the host
        self.base_dropped = False  # a level-2 sleep dropped the weights its host loaded at start
        self.settings = settings
        self.speculates = False  # the host's replica runs speculative decoding
        self.llm = RemoteLLM(client, name)
        self._live: set[str] = set()
        self._readers: set[asyncio.Task[None]] = set()
        self._stats = ReplicaStats()
        self._batches = 0
        self._shut = False

    def __repr__(self) -> str:
        return f"RemoteReplica(node {self.client.node} {self.name} at {self.client.url})"

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Nothing to hold: the host pauses the replica around each `add` itself."""
        yield

    async def add(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        ids = [r.request_id for r in requests]
        taken = set(ids) & self._live
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"request ids already running or repeated: {sorted(taken) or ids}")
        body = {"requests": [dataclasses.asdict(r) for r in requests]}
        resp = await self.client.open_stream(f"/replicas/{self.name}/generate", body)
        batch = _Batch({rid: asyncio.Queue(_REQUEST_QUEUE) for rid in ids})
        self._live.update(ids)
        self._batches += 1
        reader = asyncio.create_task(
            self._read(batch, resp), name=f"remote-n{self.client.node}-{self.name}-batch{self._batches}"
        )
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return {rid: self._stream(batch, rid) for rid in ids}

    async def _read(self, batch: _Batch, resp: aiohttp.ClientResponse) -> None:
        ended: set[str] = set()
        try:
            async with resp:
                async for raw in resp.content:
                    line = json.loads(raw)
                    if not line:
                        continue  # heartbeat
                    if "stats" in line:
                        self._count(line["stats"])
                    rid = line["id"]
                    item = _from_line(line)
                    if isinstance(item, BaseException) or item.finished:
                        ended.add(rid)
                    queue = batch.queues.get(rid)
                    if queue is not None:
                        await queue.put(item)
            if missing := set(batch.queues) - ended:
                batch.fail(self.client.error(f"the stream of {self.name} ended with {len(missing)} "
                                             "request(s) unfinished"))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            what = "went silent" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            batch.fail(self.client.error(f"generate stream of {self.name} {what}"))

    def _count(self, fields: dict[str, Any]) -> None:
        s, got = self._stats, ReplicaStats(**fields)
        self._stats = ReplicaStats(s.preemptions + got.preemptions, max(s.kv_usage_max, got.kv_usage_max),
                                   s.tokens_generated + got.tokens_generated)

    def _stream(self, batch: _Batch, rid: str) -> AsyncIterator[GenDelta]:
        return _RequestStream(self, batch, rid)

    def _ended(self, batch: _Batch, rid: str) -> None:
        batch.queues.pop(rid, None)
        self._live.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Like `VLLMEngine.abort`: unknown or ended ids are ignored."""
        if request_id in self._live:
            await self._abort_ids([request_id])

    async def _abort_ids(self, ids: list[str]) -> None:
        await self.client.call("POST", f"/replicas/{self.name}/abort", json={"request_ids": ids})

    async def sleep(self, level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
        body = {} if level.drops_weights else {"level": int(level)}
        await self.client.call("POST", f"/replicas/{self.name}/sleep", json=body)
        if level.drops_weights:
            self.weight_version = None
            self.base_dropped = True

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        body = {"tags": list(tags)} if tags is not None else {}
        await self.client.call("POST", f"/replicas/{self.name}/wake", json=body)

    def take_stats(self) -> ReplicaStats:
        stats, self._stats = self._stats, ReplicaStats()
        return stats

    async def set_drafts(self, schedule: Sequence[tuple[int, int, int]], sources: Sequence[DraftSource],
                         prompts: Sequence[PromptDrafts]) -> None:
        """The host's replica gets them as a local one does (`rpk.cluster.host_spec`)."""
        body = {"schedule": [list(b) for b in schedule], "sources": [int(s) for s in sources],
                "prompts": [p.to_wire() for p in prompts]}
        await self.client.call("POST", f"/replicas/{self.name}/spec/round", json=body)

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        if prompts:
            await self.client.call("POST", f"/replicas/{self.name}/spec/add",
                                   json={"prompts": [p.to_wire() for p in prompts]})

    async def take_spec_stats(self) -> SpecStats:
        return SpecStats.from_json(await self.client.call("POST", f"/replicas/{self.name}/spec/take"))

    async def weights_loaded(self, version: int, started: float) -> None:
        """After `finish_weight_update`: the host drops the replica's stale KV and
        records the version; so does this side."""
        await self.client.call("POST", f"/replicas/{self.name}/transfer/loaded", json={"version": version})
        self.weight_version = version

    async def load_adapter(self, adapter: AdapterVersion, version: int) -> None:
        """A LoRA adapter version: its files (on this node, `adapter.path`) uploaded to
        the host, which installs them under the same name and id."""
        update = secrets.token_hex(8)
        try:
            for i, file in enumerate((WEIGHTS_FILE, CONFIG_FILE)):
                await self.client.upload(f"/weights/{update}/{i}", Path(adapter.path) / file)
            await self.client.call(
                "POST", f"/weights/{update}/adapter", timeout_s=self.client.timeouts.weights_s,
                json={"version": version, "replicas": [self.name], "name": adapter.name, "lora_id": adapter.lora_id},
            )
        except HostError:
            with contextlib.suppress(HostError):
                await self.client.call("DELETE", f"/weights/{update}")
            raise
        self.adapter, self.weight_version = adapter, version

    async def shutdown(self) -> None:
        """Stop the replica on its host; a host already gone is not an error here (its
        replicas went with it). The node's client closes with its last replica."""
        if self._shut:
            return
        self._shut = True
        for task in list(self._readers):
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self.client.stop_and_release(f"/replicas/{self.name}/shutdown")


class _RequestStream:
    """One request's deltas. Not an async generator: closing one that was never iterated
    must still abort its request (a generator's `finally` would not run)."""

    def __init__(self, replica: RemoteReplica, batch: _Batch, rid: str) -> None:
        self._replica, self._batch, self._rid = replica, batch, rid
        self._done = False

    def __aiter__(self) -> _RequestStream:
        return self

    async def __anext__(self) -> GenDelta:
        if self._done:
            raise StopAsyncIteration
        queue = self._batch.queues[self._rid]
        try:
            item = await queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self._done = True
        self._replica._ended(self._batch, self._rid)

    async def aclose(self) -> None:
        """The consumer left early: the request must not run on."""
        if self._done:
            return
        self._end()
        if self._batch.error is None:
            await asyncio.shield(self._replica._abort_ids([self._rid]))


def _from_line(line: dict[str, Any]) -> GenDelta | BaseException:
    if "error" in line:
        return RemoteGenerationError(f"request {line['id']}: {line['error']}")
    finish = line["f"]
    return GenDelta(line["id"], tuple(line["t"]), tuple(line["lp"]), line.get("x", ""),
                    finished=finish is not None, finish_reason=FinishReason(finish) if finish else None,
                    accepted=int(line.get("a", 0)))


class NodeTransport:
    """The weight path of a fleet over several nodes (see the module docstring)."""

    async def push(self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Any], version: int) -> None:
        local = [r for r in replicas if not isinstance(r, RemoteReplica)]
        by_host: dict[HostClient, list[RemoteReplica]] = {}
        for r in replicas:
            if isinstance(r, RemoteReplica):
                by_host.setdefault(r.client, []).append(r)
        async with spooled(buckets) as paths:
            await asyncio.gather(
                *(r.load_weight_files(paths, version) for r in local),
                *(_push_to_host(client, group, paths, version) for client, group in by_host.items()),
            )

    async def close(self) -> None:
        """Nothing stays open: each sync's files go when it ends."""


async def _push_to_host(client: HostClient, replicas: Sequence[RemoteReplica], paths: Sequence[Path],
                        version: int) -> None:
    update = secrets.token_hex(8)
    try:
        for i, path in enumerate(paths):
            await client.upload(f"/weights/{update}/{i}", path)
        await client.call("POST", f"/weights/{update}/load", timeout_s=client.timeouts.weights_s,
                          json={"version": version, "replicas": [r.name for r in replicas]})
    except HostError:
        with contextlib.suppress(HostError):
            await client.call("DELETE", f"/weights/{update}")
        raise
    for r in replicas:
        r.weight_version = version
