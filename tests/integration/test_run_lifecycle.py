"""Every way a run can stop is safe: `python -m rpk.run` killed with SIGKILL mid-step or
mid-checkpoint and resumed gives the same steps as a run never interrupted (the
session's `reference_run`); SIGTERM stops it cleanly; nothing it started outlives it; a
resume from a damaged checkpoint falls back to the one before. Real processes, the real
engine, a few small steps: the slow tier. SIGINT's path through rpk.run is tested in
process (test_run_errors.py), and Ctrl-C to a real run's process group in
test_agent_signal.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.runs import ROOT, STEPS, Reference, finish, metrics, start, wait_for
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# What must match step for step: everything the rollout decided, the reward said and the
# trainer was given. Not what aborted requests produced before their abort landed
# (tokens_generated, requests_aborted): that depends on how fast the abort got there.
SAME = ("step", "round_kind", "queue_size", "prompts", "responses", "reward_mean", "accuracy",
        "response_len_mean", "response_len_p50", "response_len_max", "train_train_tokens")


def kill9_with_children(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the run's main process alone; its children must follow by themselves."""
    children = descendants(proc.pid)
    assert children, "the run should have started its engine and reward workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    survivors = wait_gone(children, timeout_s=15)
    kill_all(survivors)
    assert not survivors, f"children outlived a SIGKILLed run: {sorted(survivors)}"


def compare(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        diff = {k: (a.get(k), b.get(k)) for k in SAME if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: (resumed, uninterrupted) differ: {diff}"


def checkpointed(run_dir: Path) -> int:
    """The newest step whose checkpoint is complete (0 when none is)."""
    done = [int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/rpk_state.json")]
    return max(done, default=0)


def resume(tmp_path: Path, rpk_cache: Path) -> subprocess.Popen[str]:
    return start(tmp_path, rpk_cache, "--run.resume", str(tmp_path / "runs" / "latest"))


def test_sigterm_then_sigkill_mid_step_then_mid_checkpoint_then_resume_gives_the_same_steps(
    tmp_path, rpk_cache, reference_run: Reference
) -> None:
    """One run stopped three ways, each resumed from where the last left it (four
    processes where three runs of their own would start six): SIGTERM stops it cleanly
    with the resume line; SIGKILL mid-step and SIGKILL mid-checkpoint leave nothing
    running; the last resume removes the half-written checkpoint and the run's steps
    are the uninterrupted reference's, step for step."""
    run_dir = tmp_path / "runs" / "latest"

    proc = start(tmp_path, rpk_cache)
    wait_for(lambda: checkpointed(run_dir) >= 1, proc)
    children = descendants(proc.pid)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    got, err = finish(proc, timeout_s=60)
    assert got == 143, err[-4000:]
    assert time.monotonic() - started < 30
    assert "interrupted by SIGTERM" in err
    assert f"--run.resume {run_dir.resolve()}" in err and "step_00000" in err
    assert not wait_gone(children, timeout_s=10)

    # A step takes well under a second here: kill the moment the resumed run has
    # checkpointed a step of its own, which is during the step after it.
    stopped_at = checkpointed(run_dir)
    proc = resume(tmp_path, rpk_cache)
    wait_for(lambda: checkpointed(run_dir) > stopped_at, proc)
    kill9_with_children(proc)
    killed_at = checkpointed(run_dir)
    assert stopped_at < killed_at < STEPS

    proc = resume(tmp_path, rpk_cache)
    half = run_dir / "checkpoints" / f".tmp-step_{killed_at + 1:06d}"
    wait_for(half.exists, proc, poll_s=0.002)
    kill9_with_children(proc)
    assert not (run_dir / "checkpoints" / f"step_{killed_at + 1:06d}").exists()

    code, err = finish(resume(tmp_path, rpk_cache))
    assert code == 0, err[-4000:]
    assert "resuming" in err and "removed 1 half-written checkpoint" in err
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.name != "latest"] == [run_dir.resolve().name]
    compare(metrics(run_dir.resolve()), reference_run.records)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == list(range(1, STEPS + 1))


def test_a_truncated_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
    tmp_path, rpk_cache, reference_run: Reference
) -> None:
    """A finished run whose last checkpoint lost its weights' tail: the resume names the
    file, falls back to the checkpoint before, loads it into vLLM and the trainer, and
    takes the last step again exactly, in the same run directory; validated again at its
    end, and on the plain asyncio loop (the reference ran on uvloop)."""
    run_dir = tmp_path / "runs" / "copied"
    shutil.copytree(reference_run.run_dir, run_dir, symlinks=True)
    last, before = f"step_{STEPS:06d}", f"step_{STEPS - 1:06d}"
    os.truncate(run_dir / "checkpoints" / last / "model.safetensors", 1000)

    code, err = finish(start(tmp_path, rpk_cache, "--run.resume", str(run_dir), "--data.val_size", "8",
                             "--run.uvloop", "false"))
    assert code == 0, err[-4000:]
    said = [line for line in err.splitlines() if "fails its check" in line]
    assert len(said) == 1, err[-4000:]
    assert said[0].startswith(f"rpk: checkpoint {last} fails its check: model.safetensors is 1,000 bytes")
    assert said[0].endswith(f"(truncated); falling back to {before}, the newest checkpoint that verifies")
    assert f"resuming {run_dir} from {before}" in err and "event loop asyncio" in err
    compare(metrics(run_dir), reference_run.records)
    assert metrics(run_dir)[-1]["tokens_generated"] > 0
    # Validated before the first step (the reference) and at the resumed run's end.
    assert [(e["step"], e["version"]) for e in metrics(run_dir, "eval")] == [(0, 0), (STEPS, STEPS)]
    assert "val_acc_greedy_end" in err
    state, want = (json.loads((d / "checkpoints" / last / "rpk_state.json").read_text())
                   for d in (run_dir, reference_run.run_dir))
    assert state["step"] == STEPS and state["policy"]["cursor"] == want["policy"]["cursor"]
    assert state["fingerprint"]["rollout.policy"] == "tail"
    assert json.loads((run_dir / "checkpoints" / last / "config.json").read_text())["dtype"] == "float32"
    proc = subprocess.run([sys.executable, "-m", "rpk.checkpoint", "verify", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("  ok") == STEPS, proc.stdout + proc.stderr
