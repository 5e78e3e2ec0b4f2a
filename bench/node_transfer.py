"""`bench/weight_transfer.py`'s rows across nodes: a second node on 127.0.0.1, reached
through rpk's own code end to end.

The second node is a process serving `rpk.cluster.host`'s API (`HostService`,
`make_app`) over one replica whose worker is this process (no vLLM: it holds every
tensor in its own memory, where vLLM's `load_weights` would take over, as the other
rows do). The trainer's side is what a run over nodes uses: a `Fleet` over the host's
`RemoteReplica`, its weights sent by `rpk.cluster.nodes.node_transport`:

- node-gloo: vLLM's weight-transfer calls over the host's API, the bytes broadcast
  over gloo from the trainer straight into the host's worker;
- node-http: the fallback: the buckets spooled, uploaded to the host over HTTP,
  spooled there and read back by its worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.common import read_files
from rpk.sync.backends import Backend

TOKEN = "bench-node-token"


class _Worker:
    """The host's one replica: the surfaces of `VLLMEngine` the host's weight routes use,
    receiving into tensors of its own."""

    max_concurrency = 8

    def __init__(self, backend: str) -> None:
        from types import SimpleNamespace

        self.settings = SimpleNamespace(tensor_parallel_size=1, backend=Backend(backend))
        self.weight_version: int | None = 0
        self.llm = self
        self.held: dict[str, torch.Tensor] = {}
        self._group: Any = None

    # vLLM's weight-transfer calls (node-gloo)
    async def init_weight_transfer_engine(self, request: Any) -> None:
        from rpk.sync.gloo import close_group, open_group

        close_group(self._group)
        i = request.init_info
        self._group = await asyncio.to_thread(
            open_group, i["master_address"], i["master_port"], i["rank_offset"], i["world_size"])

    async def start_weight_update(self) -> None:
        self.held = {}

    async def update_weights(self, request: Any) -> None:
        from rpk.sync.gloo import broadcast

        u = request.update_info
        got = [torch.empty(s, dtype=getattr(torch, d)) for s, d in zip(u["shapes"], u["dtype_names"])]
        await asyncio.to_thread(broadcast, self._group, got)
        self.held.update(zip(u["names"], got))

    async def finish_weight_update(self, version: str | None = None) -> None:
        pass

    async def shutdown_weight_transfer_engine(self) -> None:
        from rpk.sync.gloo import close_group

        close_group(self._group)
        self._group = None

    async def weights_loaded(self, version: int, started: float) -> None:
        self.weight_version = version

    # the HTTP fallback's load (node-http)
    async def load_weight_files(self, paths: Sequence[Any], version: int) -> None:
        self.held = await asyncio.to_thread(read_files, [str(p) for p in paths])
        self.weight_version = version

    async def shutdown(self) -> None:
        await self.shutdown_weight_transfer_engine()

    # The host's lifecycle route looks up sleep and wake beside shutdown; a bench
    # replica never sleeps.
    async def sleep(self, level: int = 2) -> None:
        raise RuntimeError("a bench replica does not sleep")

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        raise RuntimeError("a bench replica does not sleep")


def _host(backend: str, conn: Any) -> None:
    torch.set_num_threads(1)
    asyncio.run(_serve(backend, conn))


async def _serve(backend: str, conn: Any) -> None:
    from rpk.cluster.host import HostService, UploadCaps, make_app, serve
    from rpk.engine.layouts import Layout, Layouts, LayoutState

    layouts = Layouts([Layout(1, ("tp1.0",), [_Worker(backend)], LayoutState.AWAKE)])  # type: ignore[list-item]
    service = HostService(1, layouts, max_live=8, heartbeat_s=5, caps=UploadCaps(max_bucket_bytes=2**34))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    conn.send(port)
    await asyncio.to_thread(conn.recv)  # "stop"
    await runner.cleanup()
    service.discard_updates()


def measure_node(path: str, buckets: list[list[tuple[str, torch.Tensor]]], reps: int) -> list[float]:
    """Seconds of each of `reps` full syncs to the second node, over `path`."""
    backend = {"node-gloo": "gloo", "node-http": "shm"}[path]
    here, there = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_host, args=(backend, there), daemon=True)
    proc.start()
    try:
        return asyncio.run(_syncs(backend, here.recv(), buckets, reps))
    finally:
        here.send("stop")
        proc.join(60)
        if proc.is_alive():
            proc.kill()


async def _syncs(backend: str, port: int, buckets: list[list[tuple[str, torch.Tensor]]],
                 reps: int) -> list[float]:
    from rpk.cluster.nodes import node_transport, remote_replica
    from rpk.cluster.remote import HostClient
    from rpk.engine.fleet import Fleet
    from rpk.engine.layouts import Layout, Layouts, LayoutState

    client = HostClient(1, f"http://127.0.0.1:{port}", TOKEN)
    (info,) = await client.replicas()
    fleet = Fleet(Layouts([Layout(1, ("n1.tp1.0",), [remote_replica(client, info)], LayoutState.AWAKE)]),
                  node_transport(backend, "127.0.0.1"), version=0)

    async def stream():
        for b in buckets:
            yield b

    times = []
    try:
        for version in range(1, reps + 1):
            t0 = time.perf_counter()
            await fleet.update_weights(stream(), version)
            times.append(time.perf_counter() - t0)
    finally:
        await fleet.shutdown()
    return times
