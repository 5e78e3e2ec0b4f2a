"""Whole `python -m rpk.run` processes for the slow tier: the small configs, starting a
run (every one with the session's tiny-model cache, `rpk_cache`), waiting for it, and
reading what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.procs import descendants, kill_all

ROOT = Path(__file__).resolve().parents[2]


def overrides(section: str, **values: object) -> list[str]:
    """`--section.key value` for each of `values`: a config section's dotted overrides."""
    return [arg for key, value in values.items() for arg in (f"--{section}.{key}", str(value))]


# Small enough to run in well under a minute per run on 2 cores. Head size 32: vLLM's CPU
# attention supports head sizes 32, 64, 80 and up, not 16.
SMALL = [
    *overrides("model.tiny", hidden_size=64, num_heads=2, num_layers=2, intermediate_size=128,
               sft_steps=30, sft_problems=2000),
    "--data.builtin_size", "64",
    "--rollout.prompts_per_step", "4", "--rollout.responses_per_prompt", "4",
    "--rollout.max_tokens", "96", "--rollout.max_num_seqs", "16", "--rollout.kv_cache_mb", "128",
    "--run.progress", "false", "--run.checkpoint_every", "1",
    "--data.val_size", "8", "--run.eval_k", "2",
]

STEPS = 5  # 4 short rounds fill the long-prompt queue (P0=4, one deferred each), 1 long
# A run that must train whatever the model (digit_share rewards vary in every group),
# with every request of a round in flight at once.
LIFECYCLE = [
    *SMALL, "--rollout.max_num_seqs", "32", "--reward.function", "tests.reward_fns:digit_share",
    "--run.steps", str(STEPS), "--data.val_size", "0",
]


@dataclass(frozen=True, slots=True)
class Reference:
    """The session's reference run (`reference_run`, tests/integration/conftest.py)."""

    run_dir: Path
    records: list[dict]  # its train records, step by step
    stderr: str


def command(out: Path, cache: Path, *args: str, base: list[str] = LIFECYCLE) -> list[str]:
    """`python -m rpk.run` on `base` and `args`, writing under `out`/runs."""
    return [sys.executable, "-m", "rpk.run", *base, "--model.cache_dir", str(cache),
            "--run.out_dir", str(out / "runs"), *args]


def start(out: Path, cache: Path, *args: str, base: list[str] = LIFECYCLE) -> subprocess.Popen[str]:
    """The run, in a session of its own (a signal to its group is a terminal's Ctrl-C)."""
    return subprocess.Popen(
        command(out, cache, *args, base=base), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 600) -> tuple[int, str]:
    """Its exit code and stderr, and nothing it started left running."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        kill_all(descendants(proc.pid) | {proc.pid})
    return proc.returncode, err


def rpk_run(out: Path, cache: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """A small run (`SMALL`) to its end; it must succeed."""
    proc = start(out, cache, *args, base=SMALL)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        kill_all(descendants(proc.pid) | {proc.pid})
    assert proc.returncode == 0, f"rpk.run failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def metrics(run_dir: Path, phase: str = "train") -> list[dict]:
    """The run's metrics records of one phase (train or eval); none before the first."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r.get("phase", "train") == phase]


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[str], timeout_s: float = 300,
             poll_s: float = 0.05) -> None:
    """Until `predicate()`, failing if the run ends first or it takes `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended early:\n{proc.stderr.read()[-4000:] if proc.stderr else ''}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(poll_s)
