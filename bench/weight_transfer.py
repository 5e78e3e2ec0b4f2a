"""Seconds per full weight sync, trainer to rollout workers, by path, on one machine.

    .venv/bin/python -m bench.weight_transfer --out bench/results/weight_transfer.json

Two shapes: rpk's tiny model and a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers,
14/2 heads, intermediate 4864, vocab 151936, tied; random float32 weights built here,
1.98 GB). Each path ends when every receiver process holds every tensor in its own
memory, which is where a vLLM worker's `load_weights` takes over. For cpu_ipc that copy
is the load's own (vLLM's weight loaders copy out of the mapping into the model); the
others' loads copy once more, left out here, as is the CPU GEMM re-pack after it:

- memcpy: one copy of the same bytes into memory already touched, in one process, on
  torch's threads (2 here): the bound a path that moves the bytes once cannot beat, and
  what "x memcpy" divides by; memcpy-1: the same on one thread, the one each receiver
  here runs torch on;
- shm: rpk's spool (`rpk.sync.spool.spooled`: one safetensors file per bucket in
  /dev/shm), read back by the receiver as `RpkWorkerExtension.rpk_reload_weights` does;
- cpu_ipc: rpk's `cpu_ipc` as a run uses it: the trainer's weights live in shared
  memory (`rpk.sync.cpu_ipc.share_weights`), each bucket's handles
  (`Staging.put`) go to the receiver, which copies the tensors out of its mapping
  (`Mappings`, kept open) into its own preallocated tensors, as vLLM's weight loaders
  do: one copy;
- cpu_ipc-staged: the same with weights that are not in shared memory (a sharded
  trainer's gathers): each bucket copied into a staging file first, two copies;
- gloo (1 receiver): rpk's gloo path (`rpk.sync.gloo.broadcast`) to one receiver
  over TCP on 127.0.0.1, which is also what an engine host on a second node gets;
- gloo (2 receivers): one group, the trainer and two receivers (two replicas);
- http: the spool, then each file PUT over aiohttp to a receiver that writes it to its
  own spool (as `rpk.cluster.host` does) and reads it back: the upload fallback to
  engine hosts on other nodes.
- node-gloo, node-http: a second node on 127.0.0.1 reached through rpk's own code end
  to end (`bench/node_transfer.py`): the engine host's API and a run's transport over
  nodes, gloo or the HTTP fallback.

`--engine shm,gloo,cpu_ipc` also times `Fleet.update_weights` into one real vLLM replica
per backend (a model directory of the shape, built here), vLLM's load and re-pack
included: what a run's `sync` is.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BUCKET_BYTES,
    SHAPES,
    abuckets,
    bucket_list,
    model_dir,
    nbytes,
    qwen2_weights,
    read_files,
    shared,
    tiny_dir,
    write_json,
)
from bench.node_transfer import measure_node

PATHS = ("memcpy", "memcpy-1", "cpu_ipc", "cpu_ipc-staged", "shm", "gloo-1", "gloo-2", "http",
         "node-gloo", "node-http")

# -- receivers (child processes) -------------------------------------------------------


def _receiver(path: str, conn: Any, setup: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    meta: list[tuple[str, list[int], str]] = setup["meta"]  # name, shape, dtype
    if path.startswith("gloo"):
        from rpk.sync.gloo import broadcast, open_group

        group = open_group("127.0.0.1", setup["port"], setup["rank"], setup["world"])
        conn.send("ready")
        while conn.recv() == "go":
            got = [torch.empty(s, dtype=getattr(torch, d)) for _, s, d in meta]
            broadcast(group, got)
            conn.send("done")
    elif path.startswith("cpu_ipc"):
        from rpk.sync.worker.cpu_ipc import Mappings

        maps = Mappings()
        params = {name: torch.zeros(s, dtype=getattr(torch, d)) for name, s, d in meta}
        conn.send("ready")
        while (msg := conn.recv()) != "stop":
            if msg == "end":
                conn.send("done")
                continue
            for name, dtype, shape, handle in msg:  # one bucket's update info
                params[name].copy_(maps.view(handle, getattr(torch, dtype), shape))
    elif path == "shm":
        conn.send("ready")
        while (msg := conn.recv()) != "stop":
            read_files(msg)
            conn.send("done")
    elif path == "http":
        spool = tempfile.mkdtemp(prefix="rpk-bench-http-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        asyncio.run(_http_receiver(conn, spool))
        os.rmdir(spool)


async def _http_receiver(conn: Any, spool: str) -> None:
    from aiohttp import web

    files: dict[int, str] = {}

    async def put(request: web.Request) -> web.Response:
        i = int(request.match_info["i"])
        files[i] = os.path.join(spool, f"{i}.safetensors")
        f = await asyncio.to_thread(open, files[i], "wb")
        try:
            async for chunk in request.content.iter_chunked(1 << 20):
                await asyncio.to_thread(f.write, chunk)
        finally:
            await asyncio.to_thread(f.close)
        return web.json_response({})

    async def load(request: web.Request) -> web.Response:
        await asyncio.to_thread(read_files, [files[i] for i in sorted(files)])
        for p in files.values():
            os.unlink(p)
        files.clear()
        return web.json_response({})

    app = web.Application(client_max_size=2**40)
    app.router.add_put("/w/{i}", put)
    app.router.add_post("/load", load)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    conn.send(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    await asyncio.to_thread(conn.recv)  # "stop"
    await runner.cleanup()


# -- the trainer's side ----------------------------------------------------------------


def _start(path: str, n: int, setup: Callable[[int], dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for i in range(n):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_receiver, args=(path, there, setup(i)), daemon=True)
        p.start()
        procs.append(p)
        conns.append(here)
    return procs, conns


def _stop(procs: list[Any], conns: list[Any]) -> None:
    for c in conns:
        c.send("stop")
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()


def _timed(reps: int, once: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return times


def measure(path: str, weights: dict[str, torch.Tensor], reps: int) -> list[float]:
    buckets = bucket_list(weights)
    meta = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights.items()]

    if path in ("memcpy", "memcpy-1"):
        dst = {n: torch.zeros_like(t) for n, t in weights.items()}
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if path == "memcpy-1" else threads)
        try:
            return _timed(reps, lambda: [dst[n].copy_(t) for n, t in weights.items()])
        finally:
            torch.set_num_threads(threads)

    if path.startswith("node-"):  # a second node on 127.0.0.1, through rpk's host API
        return measure_node(path, buckets, reps)

    if path.startswith("gloo"):
        from rpk.sync.gloo import broadcast, close_group, open_group
        from rpk.sync.lanes import free_port

        n, port = int(path[-1]), free_port()
        procs, conns = _start(path, n, lambda i: {"meta": meta, "port": port, "rank": i + 1, "world": n + 1})
        group = open_group("127.0.0.1", port, 0, n + 1)
        for c in conns:
            assert c.recv() == "ready"

        def gloo_once() -> None:
            for c in conns:
                c.send("go")
            for b in buckets:
                broadcast(group, [t for _, t in b])
            for c in conns:
                assert c.recv() == "done"

        try:
            return _timed(reps, gloo_once)
        finally:
            _stop(procs, conns)
            close_group(group)

    if path.startswith("cpu_ipc"):
        from rpk.sync.cpu_ipc import Staging

        staging = Staging()
        procs, conns = _start(path, 1, lambda i: {"meta": meta})
        assert conns[0].recv() == "ready"

        def ipc_once() -> None:
            for i, b in enumerate(buckets):
                handles = staging.put(i, [t for _, t in b])
                # The bucket's update info: the receiver loads it while the next is put.
                conns[0].send([(name, str(t.dtype).removeprefix("torch."), list(t.shape), h)
                               for (name, t), h in zip(b, handles)])
            conns[0].send("end")
            assert conns[0].recv() == "done"

        try:
            return _timed(reps, ipc_once)
        finally:
            _stop(procs, conns)
            staging.close()

    if path == "shm":
        from rpk.sync.spool import spooled

        procs, conns = _start(path, 1, lambda i: {"meta": meta})
        assert conns[0].recv() == "ready"

        async def shm_once() -> None:
            async with spooled(abuckets(buckets)) as paths:
                conns[0].send([str(p) for p in paths])
                await asyncio.to_thread(conns[0].recv)

        try:
            return _timed(reps, lambda: asyncio.run(shm_once()))
        finally:
            _stop(procs, conns)

    if path == "http":
        import aiohttp

        from rpk.sync.spool import spooled

        procs, conns = _start(path, 1, lambda i: {"meta": meta})
        port = conns[0].recv()

        async def http_once() -> None:
            async with spooled(abuckets(buckets)) as paths, aiohttp.ClientSession() as s:
                for i, p in enumerate(paths):
                    with p.open("rb") as f:
                        async with s.put(f"http://127.0.0.1:{port}/w/{i}", data=f,
                                         headers={"Content-Length": str(p.stat().st_size)}) as r:
                            r.raise_for_status()
                async with s.post(f"http://127.0.0.1:{port}/load") as r:
                    r.raise_for_status()

        try:
            return _timed(reps, lambda: asyncio.run(http_once()))
        finally:
            _stop(procs, conns)
    raise ValueError(f"unknown path {path!r}")


# -- into real vLLM replicas ------------------------------------------------------------


async def measure_engine(backend: str, directory: Path, weights: dict[str, torch.Tensor],
                         reps: int) -> list[float]:
    """Seconds of `Fleet.update_weights` into one TP-1 vLLM replica (with vLLM's load and
    the CPU re-pack), the trainer's buckets already in memory."""
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.sync.backends import Backend

    settings = VLLMSettings(model=directory, max_model_len=256, max_num_seqs=8,
                            kv_cache_memory_bytes=16 * 2**20)
    fleet = await launch_fleet(settings, fleet_plan((), (), 1, False), platform="cpu", backend=Backend(backend))
    buckets = bucket_list(weights)
    try:
        times = []
        for version in range(1, reps + 1):
            t0 = time.perf_counter()
            await fleet.update_weights(abuckets(buckets), version)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        await fleet.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    ap.add_argument("--reps", type=int, default=4,
                    help="syncs per path: the first, and the median of the others")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--engine", default="",
                    help="also sync into a real vLLM replica over these rpk backends "
                         "(comma-separated: shm, gloo, cpu_ipc)")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="--engine: a model directory whose tokenizer and config to use "
                         "(default: a tiny model built in model.cache_dir)")
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        weights = qwen2_weights(shape)
        size = nbytes(weights)
        print(f"{shape}: {len(weights)} tensors, {size / 1e9:.3f} GB", flush=True)
        paths, engines = args.paths.split(","), [e for e in args.engine.split(",") if e]
        # cpu_ipc syncs from the trainer's weights in shared memory, as in a run.
        holder, in_shm = shared(weights) if "cpu_ipc" in paths + engines else (None, weights)
        for path in paths:
            rows.append(_row(shape, path, size, measure(path, in_shm if path == "cpu_ipc" else weights, args.reps)))
        if engines:
            source = args.tokenizer_from or tiny_dir()
            with tempfile.TemporaryDirectory() as tmp:
                directory = model_dir(shape, source, Path(tmp) / shape)
                for backend in engines:
                    sent = in_shm if backend == "cpu_ipc" else weights
                    times = asyncio.run(measure_engine(backend, directory, sent, args.reps))
                    rows.append(_row(shape, f"engine:{backend}", size, times))
        for row in rows:
            if row["shape"] == shape:
                bound = next((r["median_s"] for r in rows if r["shape"] == shape and r["path"] == "memcpy"), None)
                row["x_memcpy"] = row["median_s"] / bound if bound else None
        del weights, in_shm, holder
    write_json(args.out, {"bucket_bytes": BUCKET_BYTES, "rows": rows})
    return 0


def _row(shape: str, path: str, size: int, times: list[float]) -> dict[str, Any]:
    """The first sync apart (it allocates what later ones reuse: staging pages, a
    group's connections), the median of the others."""
    steady = statistics.median(times[1:] or times)
    print(f"  {path:16s} first {times[0]:8.4f} s  then {steady:8.4f} s  "
          f"{size / steady / 1e9:6.2f} GB/s", flush=True)
    return {"shape": shape, "path": path, "bytes": size, "seconds": times, "first_s": times[0],
            "median_s": steady, "gb_per_s": size / steady / 1e9}


if __name__ == "__main__":
    sys.exit(main())
