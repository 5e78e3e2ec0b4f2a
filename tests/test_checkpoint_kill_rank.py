"""A rank SIGKILLed while it writes its DCP shard: rank 0's save fails (it does not hang),
nothing of the checkpoint it was writing is ever picked, the previous one verifies, and
the run resumes from it exactly (here on one rank: DCP reshards). Its own module: the
follower dies, so it cannot share a two-rank harness with other tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpk import checkpoint, manifest
from rpk.gpu.launch import join
from rpk.gpu.layout import ParallelLayout
from rpk.obs.metrics import read_records
from tests.dist_harness import free_port, make, rendezvous
from tests.fault_runs import FAILED_STEP, FAULT_FILE, RANK1_SHARD, config, on_two, run, same
from tests.faults import FAULT_FILE_ENV, Fault
from tests.procs import descendants, wait_gone

ROOT = Path(__file__).resolve().parents[1]


def test_a_rank_killed_writing_its_shard(tmp_path: Path, model_dir: Path) -> None:
    for d in ("run", "whole"):
        (tmp_path / d).mkdir()
    port = free_port()
    follower = subprocess.Popen(
        [sys.executable, "-m", "tests.dist_harness", str(port)], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, FAULT_FILE_ENV: str(FAULT_FILE)},
    )
    rendezvous(port)
    joined = join(ParallelLayout(nproc_per_node=2, rank=0), timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match=r"Connection (closed|reset) by peer"):  # gloo: rank 1 is gone
            asyncio.run(run(config(), tmp_path / "run", model_dir, Fault(RANK1_SHARD, "kill", FAILED_STEP),
                            make=on_two(joined)))
        assert follower.wait(timeout=60) == -9
    finally:
        joined.close()
        children = descendants(follower.pid)
        follower.kill()
        assert not wait_gone(children, 10)
    ckpts = tmp_path / "run" / "checkpoints"
    assert not (ckpts / f"step_{FAILED_STEP:06d}").exists()
    assert manifest.verify(ckpts / "step_000001").ok
    assert checkpoint.resume_point(tmp_path / "run").checkpoint == ckpts / "step_000001"

    # Resumed on one rank, it takes the steps a one-rank run never interrupted takes:
    # the same rewards, the same losses to rounding (a sharded sum's order differs).
    alone = lambda d: make(d, None)  # noqa: E731
    asyncio.run(run(config(), tmp_path / "whole", model_dir, make=alone))
    asyncio.run(run(config(resume=tmp_path / "run"), tmp_path / "run", model_dir, make=alone))
    got = [same(r) for r in read_records(tmp_path / "run" / "metrics.jsonl")]
    want = [same(r) for r in read_records(tmp_path / "whole" / "metrics.jsonl")]
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(got, want):
        for key in ("train_loss", "train_grad_norm"):
            assert a.pop(key) == pytest.approx(b.pop(key), rel=1e-9), (a["step"], key)
        assert a == b
