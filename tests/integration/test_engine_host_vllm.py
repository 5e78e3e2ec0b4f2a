"""`python -m rpk.cluster.host` on the real vLLM engine (the tiny model), driven through
`RemoteReplica`: streamed token ids and log-probs, an abort mid-stream, a weight update
over HTTP that changes greedy output, and SIGTERM stopping the host and its engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rpk.cluster.nodes import EngineSpec, host_command
from rpk.cluster.remote import HostClient, NodeTransport, RemoteReplica
from rpk.core.records import FinishReason, GenRequest
from tests.integration.runs import ROOT
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = pytest.mark.integration

TOKEN = "integration-token"


@pytest.fixture
def host(tiny_model_dir: Path, tmp_path: Path):
    spec = EngineSpec(str(tiny_model_dir), {"max_num_seqs": 8, "kv_cache_memory_bytes": 64 * 2**20},
                      (1,), 1, (), 0, "")
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(host_command(spec, 1, "127.0.0.1", ready), cwd=ROOT,
                            env={**os.environ, "RPK_ENGINE_TOKEN": TOKEN}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, f"the host exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the host did not start"
            time.sleep(0.2)
        yield proc, json.loads(ready.read_text())
    finally:
        kill_all(descendants(proc.pid) | {proc.pid})
        proc.wait(timeout=30)


async def greedy(replica: RemoteReplica, rid: str) -> tuple[int, ...]:
    streams = await replica.add([GenRequest(rid, (1, 2, 3), max_tokens=8, temperature=0.0)])
    return tuple([t async for d in streams[rid] for t in d.token_ids])


async def test_a_real_engine_behind_its_host(host, tiny_model_dir: Path) -> None:
    proc, info = host
    client = HostClient(1, info["url"], TOKEN)
    (described,) = await client.replicas()
    replica = RemoteReplica(client, described["name"], described["max_concurrency"], 0)
    try:
        await _exercise(replica, tiny_model_dir)
    finally:
        await replica.shutdown()
    children = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    survivors = wait_gone(children, timeout_s=15)
    kill_all(survivors)
    assert not survivors


async def _exercise(replica: RemoteReplica, tiny_model_dir: Path) -> None:
    streams = await replica.add([GenRequest("s", (1, 2, 3), max_tokens=6, progress=True, seed=1)])
    deltas = [d async for d in streams["s"]]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [x for d in deltas for x in d.logprobs]
    assert len(tokens) == len(logprobs) > 0 and all(x <= 0 for x in logprobs)
    assert deltas[-1].finished and deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert replica.take_stats().tokens_generated >= len(tokens)

    long = await replica.add([GenRequest("long", (1, 2), max_tokens=2000, progress=True, ignore_eos=True)])
    first = await anext(long["long"])
    await replica.abort("long")
    rest = [d async for d in long["long"]]
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) < 2000

    before = await greedy(replica, "g0")
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights["model.norm.weight"] = -weights["model.norm.weight"]  # argmax becomes argmin

    async def buckets():
        names = list(weights)
        yield [(n, weights[n]) for n in names[: len(names) // 2]]
        yield [(n, weights[n]) for n in names[len(names) // 2 :]]

    await NodeTransport().push(buckets(), [replica], version=1)
    assert replica.weight_version == 1
    assert await greedy(replica, "g1") != before
