"""bench/gpu_check runs on a machine without CUDA: every row skips, exit code 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it runs for real")


@no_cuda
def test_gpu_check_skips_cleanly_without_cuda(capsys) -> None:
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu_check: torch") and "no CUDA" in lines[0]
    rows = [l.split()[:2] for l in lines[2:]]
    assert rows == [[n, "skip"] for n in ("logprob_kernel", "fsdp_step", "offload", "snapshot")]


@no_cuda
def test_the_script_runs_it() -> None:
    out = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "skip" in out.stdout
