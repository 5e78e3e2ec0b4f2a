"""`python -m rpk.run` turns the user's mistakes into one clear line and exit code 2,
before any engine starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rpk.run", "--run.out_dir", str(tmp_path / "runs"),
         "--run.progress", "false", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def test_missing_model_dir(tmp_path):
    proc = run(tmp_path, "--model.path", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert f"model.path={str(tmp_path / 'nope')!r}: no HF model (config.json) there" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run(tmp_path, "--run.resume", str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert "no complete checkpoint there" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_past_the_last_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "rpk_state.json").write_text(json.dumps({"step": 5, "policy": {}}))
    proc = run(tmp_path, "--run.resume", str(ckpt), "--run.steps", "5")
    assert proc.returncode == 2
    assert "is already at step 5; raise run.steps to continue" in proc.stderr
