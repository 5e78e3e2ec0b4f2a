"""Every way a run can stop is safe: `python -m rpk.run` killed with SIGKILL mid-step or
mid-checkpoint and resumed gives the same steps as a run never interrupted; SIGINT and
SIGTERM stop it cleanly; nothing it started outlives it. Real processes, the real
engine, a few small steps."""

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

from tests.integration.test_run_e2e import ROOT, SMALL
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = pytest.mark.integration

STEPS = 5  # 4 short rounds fill the long-prompt queue (P0=4, one deferred each), 1 long
LIFECYCLE = [
    *SMALL, "--rollout.max_num_seqs", "32", "--reward.function", "tests.reward_fns:digit_share",
    "--run.steps", str(STEPS), "--data.val_size", "0",
]
# What must match step for step: everything the rollout decided, the reward said and the
# trainer was given. Not what aborted requests produced before their abort landed
# (tokens_generated, requests_aborted): that depends on how fast the abort got there.
SAME = ("step", "round_kind", "queue_size", "prompts", "responses", "reward_mean", "accuracy",
        "response_len_mean", "response_len_p50", "response_len_max", "train_train_tokens")


def command(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "rpk.run", *LIFECYCLE,
            "--model.cache_dir", str(tmp_path.parent / "cache"),
            "--run.out_dir", str(tmp_path / "runs"), *args]


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(tmp_path, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 600) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        kill_all(descendants(proc.pid) | {proc.pid})
    return proc.returncode, err


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, proc: subprocess.Popen[str], timeout_s: float = 300, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{proc.stderr.read()[-4000:] if proc.stderr else ''}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(poll_s)


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


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("whole")
    code, err = finish(start(tmp))
    assert code == 0, err[-4000:]
    run_dir = (tmp / "runs" / "latest").resolve()
    recs = records(run_dir)
    assert [r["round_kind"] for r in recs] == ["short"] * 4 + ["long"]
    return run_dir, recs


@pytest.fixture(scope="module")
def uninterrupted(whole_run: tuple[Path, list[dict]]) -> list[dict]:
    return whole_run[1]


def test_sigkill_mid_step_then_resume_gives_the_same_steps(tmp_path, uninterrupted) -> None:
    proc = start(tmp_path)
    run_dir = tmp_path / "runs" / "latest"
    # A step takes well under a second here: kill the moment step 2 is checkpointed,
    # which is during step 3 (or, rarely, the step after it).
    wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "rpk_state.json").exists(), proc)
    kill9_with_children(proc)
    done = len(records(run_dir))
    assert 2 <= done < STEPS

    code, err = finish(start(tmp_path, "--run.resume", str(tmp_path / "runs" / "latest")))
    assert code == 0, err[-4000:]
    assert "resuming" in err
    assert [p.name for p in (tmp_path / "runs").iterdir() if p.name != "latest"] == [run_dir.resolve().name]
    compare(records(run_dir), uninterrupted)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == list(range(1, STEPS + 1))


def test_sigkill_during_a_checkpoint_write_then_resume(tmp_path, uninterrupted) -> None:
    proc = start(tmp_path)
    ckpts = tmp_path / "runs" / "latest" / "checkpoints"
    wait_for(lambda: any(p.name == ".tmp-step_000003" for p in ckpts.glob(".tmp-*")), proc, poll_s=0.002)
    kill9_with_children(proc)
    assert not (ckpts / "step_000003").exists()

    code, err = finish(start(tmp_path, "--run.resume", str(tmp_path / "runs" / "latest")))
    assert code == 0, err[-4000:]
    assert "removed 1 half-written checkpoint" in err
    assert not list(ckpts.glob(".tmp-*"))
    compare(records((tmp_path / "runs" / "latest").resolve()), uninterrupted)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_cleanly(tmp_path, signum, code) -> None:
    proc = start(tmp_path)
    run_dir = tmp_path / "runs" / "latest"
    wait_for(lambda: (run_dir / "checkpoints" / "step_000001" / "rpk_state.json").exists(), proc)
    children = descendants(proc.pid)
    started = time.monotonic()
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)  # Ctrl-C in a terminal: the whole process group
    else:
        os.kill(proc.pid, signum)
    got, err = finish(proc, timeout_s=60)
    assert got == code, err[-4000:]
    assert time.monotonic() - started < 30
    assert f"interrupted by {signal.Signals(signum).name}" in err
    assert f"--run.resume {run_dir.resolve()}" in err and "step_00000" in err
    assert not wait_gone(children, timeout_s=10)


def test_a_truncated_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
    tmp_path, whole_run
) -> None:
    """A finished run whose last checkpoint lost its weights' tail: the resume names the
    file, falls back to the checkpoint before, and takes the last step again exactly."""
    finished, want = whole_run
    run_dir = tmp_path / "runs" / "copied"
    shutil.copytree(finished, run_dir, symlinks=True)
    last, before = f"step_{STEPS:06d}", f"step_{STEPS - 1:06d}"
    os.truncate(run_dir / "checkpoints" / last / "model.safetensors", 1000)

    code, err = finish(start(tmp_path, "--run.resume", str(run_dir)))
    assert code == 0, err[-4000:]
    said = [line for line in err.splitlines() if "fails its check" in line]
    assert len(said) == 1, err[-4000:]
    assert said[0].startswith(f"rpk: checkpoint {last} fails its check: model.safetensors is 1,000 bytes")
    assert said[0].endswith(f"(truncated); falling back to {before}, the newest checkpoint that verifies")
    assert f"resuming {run_dir} from {before}" in err
    compare(records(run_dir), want)
    proc = subprocess.run([sys.executable, "-m", "rpk.checkpoint", "verify", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("  ok") == STEPS, proc.stdout + proc.stderr
