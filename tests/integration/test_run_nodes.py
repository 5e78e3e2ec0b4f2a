"""Two simulated nodes: two `torchrun` agents on 127.0.0.1 (c10d rendezvous), one rank
each, every node with one rollout replica: node 0's in the controller, node 1's in the
engine host its rank starts. `rpk.run` trains a few steps end to end over both, and
nothing it started outlives it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from tests.integration.runs import LIFECYCLE, ROOT, command, metrics
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


def agent(
    tmp_path: Path, cache: Path, port: int, index: int, steps: int = STEPS, static: bool = False,
    extra: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """Agent `index` of two. c10d numbers the nodes in the order they join; `static`
    makes agent i node i, its rendezvous store on node 0 (the controller's)."""
    rdzv = (["--node-rank", str(index), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            if static else ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                            "--rdzv-id", f"rpk-nodes-{port}"])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        *rdzv, "--monitor-interval", "0.5",
        "-m", "rpk.run", "--", *LIFECYCLE, "--run.steps", str(steps),
        "--model.cache_dir", str(cache), "--run.out_dir", str(tmp_path / "runs"),
        *extra,
    ]
    with (tmp_path / f"agent{index}.log").open("w") as out:
        return subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        )


@pytest.mark.parametrize("extra, path", [
    (("--rollout.weight_transfer", "gloo", "--run.verify_sync", "true"), "gloo"),
    (("--rollout.weight_transfer", "shm"), "HTTP uploads (the fallback)"),
    (("--model.lora_rank", "8", "--run.verify_sync", "true"), "LoRA adapters over HTTP"),
], ids=["gloo-verified", "http", "lora-verified"])
def test_two_nodes_roll_out_on_both_and_train_end_to_end(tmp_path, rpk_cache, extra, path) -> None:
    """With gloo every sync reaches node 1's workers in the trainer's group, and
    run.verify_sync checks their digests; the HTTP fallback uploads the buckets."""
    port = free_port()
    # Which agent becomes node 0 is the rendezvous's choice (c10d ignores --node-rank).
    agents = [agent(tmp_path, rpk_cache, port, index, extra=extra) for index in (0, 1)]
    everything: set[int] = set()
    deadline = time.monotonic() + 600  # ~70 s on an idle 2-core machine; minutes when it is shared
    try:
        # Every process the agents start (ranks, the engine host, vLLM's engine cores),
        # seen while they run, so that the check below finds any that outlive them.
        while any(p.poll() is None for p in agents) and time.monotonic() < deadline:
            for proc in agents:
                everything |= descendants(proc.pid)
            time.sleep(0.5)
    finally:
        for proc in agents:
            kill_all(descendants(proc.pid) | {proc.pid})
            proc.wait(timeout=30)
    log = "\n".join((tmp_path / f"agent{n}.log").read_text() for n in (0, 1))
    assert [p.returncode for p in agents] == [0, 0], log[-6000:]
    assert "2 process(es) = 2 node(s) x 1" in log
    assert re.search(r"engine host of node 1 at http://127\.0\.0\.1:\d+: 1 replica\(s\)", log), log[-6000:]
    assert f"weights to the other nodes' replicas: {path}" in log, log[-6000:]
    assert not list((tmp_path / "runs").glob(".rpk-engine-token-*"))  # removed once read
    served = re.search(r"rpk engine host, node 1: served tp1\.0: (\d+) requests", log)
    assert served, log[-6000:]
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["version"] for r in recs] == list(range(1, STEPS + 1))
    # Node 1 served some of every step's requests, node 0 the rest (the router puts a
    # round's first prompt on node 0's replica).
    launched = sum(r["requests_launched"] for r in recs)
    assert 0 < int(served.group(1)) < launched
    survivors = wait_gone(everything, timeout_s=15)
    kill_all(survivors)
    assert not survivors, f"processes outlived the run: {sorted(survivors)}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_node_killed_mid_run_stops_the_run_naming_it_and_one_node_resumes(tmp_path, rpk_cache) -> None:
    """Node 1 (its agent, rank, engine host and vLLM) is killed with SIGKILL once step 1's
    checkpoint is in place: node 0 stops within a bounded time with one line naming node 1,
    nothing survives, and `--run.resume` finishes the run on one node. Static
    rendezvous: the store lives on node 0, as with separate machines and the
    rendezvous endpoint on node 0 (with c10d on one machine, either agent may hold it,
    and an agent that loses the store stops its ranks itself)."""
    steps = 4
    port = free_port()
    agents = [agent(tmp_path, rpk_cache, port, index, steps, static=True) for index in (0, 1)]
    run_dir = tmp_path / "runs" / "latest"
    everything: set[int] = set()
    deadline = time.monotonic() + 600
    try:
        # The final checkpoint directory, not the step's record: the record is written
        # before the checkpoint is saved, and killing node 1 in between leaves nothing
        # to resume from.
        while not (run_dir / "checkpoints" / "step_000001").is_dir():
            assert time.monotonic() < deadline and all(p.poll() is None for p in agents), "no step"
            for proc in agents:
                everything |= descendants(proc.pid)
            time.sleep(0.2)
        survivor, node1 = agents
        assert any("rpk.cluster.host" in _cmdline(c) for c in descendants(node1.pid))
        kill_all(descendants(node1.pid) | {node1.pid})
        killed_at = time.monotonic()
        node1.wait(timeout=30)
        while survivor.poll() is None and time.monotonic() - killed_at < 240:
            everything |= descendants(survivor.pid)
            time.sleep(0.2)
        stopped_s = time.monotonic() - killed_at
    finally:
        for proc in agents:
            kill_all(descendants(proc.pid) | {proc.pid})
            proc.wait(timeout=30)
    log = (tmp_path / "agent0.log").read_text()
    assert survivor.returncode not in (0, None), log[-6000:]
    lost = [line for line in log.splitlines() if line.startswith("rpk: node 1 failed:")]
    assert len(lost) == 1 and "--run.resume" in lost[0], log[-6000:]
    print(f"node 0 stopped {stopped_s:.1f}s after node 1 was killed: {lost[0]}")
    survivors = wait_gone(everything, timeout_s=15)
    kill_all(survivors)
    assert not survivors, f"processes outlived the run: {sorted(survivors)}"

    done = len(metrics(run_dir.resolve()))
    resumed = subprocess.run(
        command(tmp_path, rpk_cache, "--run.steps", str(steps), "--run.resume", str(run_dir)),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    recs = metrics(run_dir.resolve())
    assert [r["step"] for r in recs] == list(range(1, steps + 1)) and done >= 1
