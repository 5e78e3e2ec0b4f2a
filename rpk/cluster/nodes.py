"""Rollout replicas over several nodes: who starts what, and how the controller finds them.

Under `torchrun` over M nodes, local rank 0 of each engine node other than node 0 starts
that node's engine host (`python -m rpk.cluster.host`, a child process it supervises)
before it follows the trainer's commands; the controller (rank 0, on node 0) starts node
0's replicas in-process as on one node. They meet in torch.distributed's store, the
rendezvous every rank already joins:

    rpk/engine/spec        controller -> hosts: model, engine settings, layouts, version,
                           weight path, TLS files, where the run's token is, and the
                           judge's launch where the plan puts a judge on the GPUs
    rpk/engine/node/{n}    host of node n -> controller: {"url", "replicas", "judges"}
                           or {"error"}

torch's store has no authentication, so the bearer token never goes through it: the
launcher sets `RPK_ENGINE_TOKEN` on every node, or the controller writes a fresh token
to a file only its user can read (0600) in `run.out_dir`, which the nodes share as they
share the run directories; each host reads it as it starts, and the controller removes
it once every host is up.

The controller then builds one `Fleet`: for each TP size, one layout whose replicas are
node 0's local ones followed by every other node's `RemoteReplica`s, named
`n{node}.{name}` (`n1.tp2.0`). Every node plans the same layouts over its own devices,
so TP groups never cross a node. Each host's judge engines (`remote_judges`) join the
controller's judge pool beside node 0's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rpk.cluster.remote import HostClient, NodeTransport, RemoteReplica, RemoteSettings, Timeouts
from rpk.cluster.remote_judge import RemoteJudge
from rpk.core.errors import UserError
from rpk.engine.fleet import Fleet, Rest
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.engine.replica import Replica
from rpk.sync.adapter import AdapterTransport
from rpk.sync.backends import Backend, parse, reaches_nodes
from rpk.sync.protocols import WeightTransport
from rpk.sync.transport import CollectiveTransport

SPEC_KEY = "rpk/engine/spec"
TOKEN_ENV = "RPK_ENGINE_TOKEN"
# Set on a node to the address the controller reaches its host at; unset, the address
# this node uses to reach the rendezvous (MASTER_ADDR) is taken, which routes back.
ADDR_ENV = "RPK_ENGINE_ADDR"


def node_key(node: int) -> str:
    return f"rpk/engine/node/{node}"


class NodesError(UserError, ValueError):
    """Engine nodes and rollout settings that do not go together."""


class HostStartError(UserError, RuntimeError):
    """A node's engine host did not come up (its own log, on that node, says why)."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What every engine host needs of the controller's choices."""

    model: str
    engine: Mapping[str, Any]  # VLLMSettings fields but `model`
    tp_sizes: tuple[int, ...]
    tp: int
    devices: tuple[int, ...]  # each node's rollout devices (the same ids on every node)
    version: int
    token_file: str  # the token's file (`write_token`); "": RPK_ENGINE_TOKEN, set on every node
    weight_transfer: Backend = Backend.SPOOL  # the hosts' replicas': gloo, shm (HTTP uploads) or adapter
    verify: bool = False  # run.verify_sync: the workers record digests
    tls_cert: str = ""  # the hosts serve TLS with these files (the same paths on every node)
    tls_key: str = ""
    # `rpk.judge.pool.JudgePlan` as JSON: the judge engines each host starts on
    # its rollout GPUs, placed once by the controller; "": none
    judge: str = ""
    adapter: Mapping[str, Any] | None = None  # a LoRA run's adapter config (`weight_transfer` adapter)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineSpec:
        d = json.loads(text)
        return cls(d["model"], d["engine"], tuple(d["tp_sizes"]), d["tp"], tuple(d["devices"]),
                   d["version"], d["token_file"], parse(d["weight_transfer"]), d["verify"],
                   d["tls_cert"], d["tls_key"], d["judge"], d.get("adapter"))


def write_token(directory: Path, token: str) -> Path:
    """`token` in a new file of `directory` that only this user can read or write."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".rpk-engine-token-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def read_token(spec: EngineSpec, env: Mapping[str, str] = os.environ) -> str:
    """A host's token: from the spec's file, which must be this user's alone, or from
    RPK_ENGINE_TOKEN where the launcher set it."""
    if not spec.token_file:
        if not env.get(TOKEN_ENV):
            raise HostStartError(f"the controller expects {TOKEN_ENV} set by the launcher on every "
                                 "node, and it is unset or empty here")
        return env[TOKEN_ENV]
    path = Path(spec.token_file)
    try:
        info = path.stat()
        token = path.read_text().strip()
    except OSError as e:
        raise HostStartError(f"the run's engine token {path}: {e} (run.out_dir must be shared "
                             "by the nodes, or set RPK_ENGINE_TOKEN on every node)") from e
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
        raise HostStartError(f"the run's engine token {path} is mode {stat.filemode(info.st_mode)}, "
                             f"owner {info.st_uid}: it must be this user's ({os.getuid()}) alone")
    return token


def run_token(out_dir: Path, env: Mapping[str, str] = os.environ) -> tuple[str, Path | None]:
    """The controller's token for this run, and the file it wrote it to (None: the
    launcher's RPK_ENGINE_TOKEN, which every node has)."""
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV], None
    token = new_token()
    return token, write_token(out_dir.resolve(), token)


def check_nodes(engine_nodes: Sequence[int], nnodes: int, tp_switch: str, weight_transfer: str) -> tuple[int, ...]:
    """The engine nodes (empty: every node), checked against the rest of the config."""
    nodes = tuple(sorted(set(engine_nodes))) if engine_nodes else tuple(range(nnodes))
    bad = [n for n in nodes if not 0 <= n < nnodes]
    if bad:
        raise NodesError(f"dist.engine_nodes={list(engine_nodes)}: nodes {bad} are not among "
                         f"the run's nodes 0..{nnodes - 1}")
    if any(n != 0 for n in nodes):
        if tp_switch != "sleep":
            raise NodesError(f"rollout.tp_switch={tp_switch!r} with engine nodes {list(nodes)}: "
                             "replicas on other nodes keep their layouts asleep (tp_switch=sleep)")
        if not reaches_nodes(weight_transfer):
            raise NodesError(f"rollout.weight_transfer={weight_transfer!r} with engine nodes "
                             f"{list(nodes)}: weights reach other nodes over gloo or HTTP "
                             "(gloo, cpu_ipc, auto or shm)")
    return nodes


def advertised_address(env: Mapping[str, str] = os.environ) -> str:
    """The address the controller can reach this node at (see ADDR_ENV)."""
    if env.get(ADDR_ENV):
        return env[ADDR_ENV]
    master = env.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(env.get("MASTER_PORT", "29500"))))  # UDP: no packet is sent
        return s.getsockname()[0]


def host_command(spec: EngineSpec, node: int, bind: str, ready_file: Path) -> list[str]:
    """The engine host's command line for node `node` of `spec`."""
    return [
        sys.executable, "-m", "rpk.cluster.host", "--model", spec.model, "--node", str(node),
        "--tp-sizes", ",".join(map(str, spec.tp_sizes)), "--tp", str(spec.tp),
        "--devices", ",".join(map(str, spec.devices)), "--version", str(spec.version),
        "--engine", json.dumps(dict(spec.engine)), "--bind", bind, "--port", "0",
        "--token-env", TOKEN_ENV, "--ready-file", str(ready_file),
        "--weight-transfer", spec.weight_transfer.value, *(["--verify"] if spec.verify else []),
        *(["--adapter", json.dumps(dict(spec.adapter))] if spec.adapter is not None else []),
        *(["--tls-cert", spec.tls_cert, "--tls-key", spec.tls_key] if spec.tls_cert else []),
        *(["--judge", spec.judge] if spec.judge else []),
    ]


class NodeHost:
    """A follower's engine host process: started from the spec in the store, its address
    published there, stopped with the follower."""

    def __init__(self, proc: subprocess.Popen[bytes], node: int, ready: Path) -> None:
        self.proc = proc
        self.node = node
        self.ready = ready

    @classmethod
    def start(cls, store: Any, node: int, spec_wait: timedelta, start_timeout_s: float) -> NodeHost:
        """Blocking: waits for the controller's spec, then for the host to serve."""
        store.wait([SPEC_KEY], spec_wait)
        spec = EngineSpec.from_json(store.get(SPEC_KEY))
        try:
            token = read_token(spec)
        except HostStartError as e:
            store.set(node_key(node), json.dumps({"error": f"node {node}: {e}"}))
            raise
        ready = Path(tempfile.mkdtemp(prefix="rpk-host-")) / "ready.json"
        proc = subprocess.Popen(host_command(spec, node, advertised_address(), ready),
                                env={**os.environ, TOKEN_ENV: token})
        host = cls(proc, node, ready)
        try:
            info = host._wait_ready(start_timeout_s)
        except HostStartError as e:
            store.set(node_key(node), json.dumps({"error": str(e)}))
            host.stop()
            raise
        store.set(node_key(node), json.dumps(info))
        return host

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if (code := self.proc.poll()) is not None:
                raise HostStartError(f"the engine host of node {self.node} exited with code {code} "
                                     "while starting (its log is on that node's stderr)")
            if time.monotonic() > deadline:
                raise HostStartError(f"the engine host of node {self.node} was not serving "
                                     f"after {timeout_s:.0f}s")
            time.sleep(0.2)
        return json.loads(self.ready.read_text())

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM (the host shuts its replicas down), SIGKILL after `grace_s`."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.ready.parent, ignore_errors=True)
        return self.proc.returncode


def publish_spec(store: Any, spec: EngineSpec) -> None:
    store.set(SPEC_KEY, spec.to_json())


async def wait_host(store: Any, node: int, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
    """Node `node`'s published address and replicas. Polls (each check a short store
    call in a thread) rather than one long blocking wait, so that cancelling it leaves
    no thread waiting on the store."""
    key = node_key(node)
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(store.check, [key]):
        if time.monotonic() > deadline:
            raise HostStartError(f"no engine host of node {node} within {timeout_s:.0f}s "
                                 "(dist.engine_start_timeout_s)")
        await asyncio.sleep(poll_s)
    info = json.loads(await asyncio.to_thread(store.get, key))
    if "error" in info:
        raise HostStartError(info["error"])
    return info


def default_store() -> Any:
    """The key-value store of the run's process group (torchrun's rendezvous store)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def merge_layouts(local: Layouts | None, remote: Mapping[int, tuple[HostClient, Sequence[dict[str, Any]]]],
                  make: Callable[[HostClient, dict[str, Any]], Replica]) -> Layouts:
    """One layout per TP size over node 0's local replicas and every remote node's, in
    node order; the awake one is the layout awake everywhere."""
    names: dict[int, list[str]] = {}
    replicas: dict[int, list[Replica]] = {}
    states: dict[int, set[str]] = {}
    if local is not None:
        for layout in local.all:
            names[layout.tp] = [f"n0.{n}" for n in layout.names]
            replicas[layout.tp] = list(layout.replicas)
            states[layout.tp] = {layout.state.value}
    for node in sorted(remote):
        client, described = remote[node]
        for info in described:
            tp = int(info["tp"])
            names.setdefault(tp, []).append(f"n{node}.{info['name']}")
            replicas.setdefault(tp, []).append(make(client, info))
            states.setdefault(tp, set()).add(info["state"])
    mixed = {tp: s for tp, s in states.items() if len(s) > 1}
    if mixed:
        raise HostStartError(f"nodes disagree on which layout is awake: {mixed}")
    return Layouts([Layout(tp, tuple(names[tp]), replicas[tp], LayoutState(states[tp].pop()))
                    for tp in sorted(names)])


def remote_replica(client: HostClient, info: dict[str, Any]) -> RemoteReplica:
    settings = RemoteSettings(int(info["tp"]), parse(info.get("backend", Backend.SPOOL)))
    replica = RemoteReplica(client, info["name"], int(info["max_concurrency"]), info["weight_version"], settings)
    replica.speculates = bool(info.get("speculates", False))
    return replica


# How each backend of the other nodes' replicas is said in the run's log.
REMOTE_PATHS = {Backend.GLOO: "gloo", Backend.SPOOL: "HTTP uploads (the fallback)",
                Backend.ADAPTER: "LoRA adapters over HTTP"}


def node_transport(remote: Backend, address: str, adapter: Mapping[str, Any] | None = None) -> WeightTransport:
    """The weight path of a fleet over nodes: with `gloo`, one transport of vLLM's
    protocol whose groups hold the trainer (at `address`, which every node reaches) and
    every worker of every replica on every node (node 0's `cpu_ipc` replicas take their
    own lane beside it); a LoRA run's adapters (`adapter`: their config), each version
    uploaded to every host (`RemoteReplica.load_adapter`); else the HTTP uploads."""
    if remote is Backend.GLOO:
        return CollectiveTransport(address=address)
    if remote is Backend.ADAPTER:
        if adapter is None:
            raise ValueError("the other nodes' adapter path needs the LoRA adapter's config")
        return AdapterTransport(adapter)
    return NodeTransport()


async def launch_nodes(
    spec: EngineSpec, token: str, nodes: Sequence[int], store: Any, *,
    start_local: Callable[[], Any], timeout_s: float, log: Callable[[str], None],
    timeouts: Timeouts = Timeouts(), transport: WeightTransport | None = None,
    tls: Any = None, rest: Rest | None = None,
) -> Fleet:
    """The controller's side: publish `spec`, start node 0's replicas (`start_local`, a
    coroutine function giving a Fleet, when node 0 is an engine node) while the other
    nodes' hosts start, then one Fleet over all of them, its weights sent by `transport`
    (default: the HTTP uploads). `token` is the hosts' bearer token; `tls`: the SSL
    context their certificates are checked with (`client_ssl`); `rest`: how the fleet
    shares its devices with the trainer."""
    publish_spec(store, spec)
    remote_nodes = [n for n in nodes if n != 0]
    waits = [asyncio.create_task(wait_host(store, n, timeout_s), name=f"wait-host-{n}")
             for n in remote_nodes]
    local: Fleet | None = None
    clients: list[HostClient] = []
    try:
        if 0 in nodes:
            local = await start_local()
        infos = await asyncio.gather(*waits)
        remote: dict[int, tuple[HostClient, Sequence[dict[str, Any]]]] = {}
        for node, info in zip(remote_nodes, infos):
            client = HostClient(node, info["url"], token, timeouts, tls)
            clients.append(client)
            remote[node] = (client, await client.replicas())
            log(f"engine host of node {node} at {info['url']}: {len(remote[node][1])} replica(s)")
        layouts = merge_layouts(local.layouts if local is not None else None, remote, remote_replica)
        return Fleet(layouts, transport or NodeTransport(), version=spec.version, rest=rest)
    except BaseException:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        if local is not None:
            await local.shutdown()
        for client in clients:
            await client.close()
        raise


def remote_hosts(fleet: Fleet) -> dict[int, HostClient]:
    """The engine host of every remote node in `fleet` (every layout's replicas), by node:
    what a supervisor polls with `HostClient.health`."""
    return {r.client.node: r.client for layout in fleet.layouts.all for r in layout.replicas
            if isinstance(r, RemoteReplica)}


async def remote_judges(hosts: Mapping[int, HostClient]) -> list[RemoteJudge]:
    """The judge engines every host serves, in node order (none where the run's judge
    is not on the GPUs)."""
    judges = []
    for node in sorted(hosts):
        client = hosts[node]
        for info in await client.call("GET", "/judges"):
            judges.append(RemoteJudge(client, int(info["index"]), int(info["gpu"]), bool(info["can_sleep"])))
    return judges


def new_token() -> str:
    return secrets.token_urlsafe(32)
