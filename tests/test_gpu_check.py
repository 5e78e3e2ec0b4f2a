"""bench/gpu_check: without CUDA every row skips (exit code 0); its dry mode runs every
check's code path on CPU over gloo, as the suite's stand-in for a lent GPU."""

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
    assert rows == [[n, "skip"] for n in gpu_check.CHECKS]


def test_the_dry_mode_runs_every_check_through_the_script(tmp_path: Path) -> None:
    out = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run on CPU" in out.stdout
    rows = {r["check"]: r for r in __import__("json").loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == list(gpu_check.CHECKS)
    assert all(r["result"] == "ok" for r in rows.values()), rows
    assert "summed over the group" in rows["finish_step"]["detail"]
    assert "next step identical" in rows["handoff"]["detail"]
