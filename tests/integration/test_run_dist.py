"""`python -m rpk.run --dist.nproc 2` on this CPU: two ranks over gloo (rank 0 with the
real vLLM engine), a checkpoint that resumes on one rank, a rank killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.integration.runs import finish, metrics, start, wait_for
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the ranks below the launcher (from their environment)."""
    ranks = {}
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        values = dict(e.split(b"=", 1) for e in env if b"=" in e)
        if b"RANK" in values and b"RPK_ENGINE_OWNER" not in values and b"LOCAL_RANK" in values:
            ranks[int(values[b"RANK"])] = pid
    return ranks


def test_two_ranks_train_end_to_end_and_resume_on_one(tmp_path, rpk_cache) -> None:
    code, err = finish(start(tmp_path, rpk_cache, "--dist.nproc", "2", "--run.steps", "3"))
    assert code == 0, err[-4000:]
    assert "2 process(es) = 1 node(s) x 2; trainer mesh 2 (FSDP)" in err
    run_dir = (tmp_path / "runs" / "latest").resolve()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3] and [r["version"] for r in recs] == [1, 2, 3]
    assert all(r["train_train_tokens"] > 0 and r["sync_bytes"] > 0 for r in recs)
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "step_000003" / "trainer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its shard

    # The two-rank checkpoint resumes on one process: DCP reshards.
    code, err = finish(start(tmp_path, rpk_cache, "--run.resume", str(run_dir), "--run.steps", "4"))
    assert code == 0, err[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]


def test_a_killed_rank_stops_the_run_and_names_it(tmp_path, rpk_cache) -> None:
    proc = start(tmp_path, rpk_cache, "--dist.nproc", "2", "--run.steps", "50")
    run_dir = tmp_path / "runs" / "latest"
    wait_for(lambda: (run_dir / "checkpoints" / "step_000001" / "rpk_state.json").exists(), proc)
    everything = descendants(proc.pid)
    ranks = rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    started = time.monotonic()
    code, err = finish(proc, timeout_s=120)
    assert code != 0
    assert time.monotonic() - started < 60
    assert "rpk: rank 1 failed: killed by SIGKILL" in err or "rank 1" in err.splitlines()[-1]
    survivors = wait_gone(everything, timeout_s=15)
    kill_all(survivors)
    assert not survivors
    # The last complete checkpoint is intact and resumable.
    state = json.loads((run_dir / "checkpoints" / "step_000001" / "rpk_state.json").read_text())
    assert state["step"] == 1
