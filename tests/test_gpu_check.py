"""bench/gpu_check: without CUDA every row skips (exit code 0); its dry mode runs every
check's code path on CPU over gloo, as the suite's stand-in for a lent GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check, gpu_judge, gpu_vllm

ROOT = Path(__file__).resolve().parents[1]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it runs for real")


@no_cuda
def test_gpu_check_skips_cleanly_without_cuda(capsys) -> None:
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpu_check: torch") and "no CUDA" in lines[0]
    rows = [line.split()[:2] for line in lines[2:]]
    assert rows == [[n, "skip"] for n in gpu_check.CHECKS] + [["mps", "info"]]


def test_mps_is_reported_on_or_off_and_never_fails(tmp_path: Path) -> None:
    name, result, _, detail = gpu_check.mps_row(tmp_path, None)
    assert (name, result) == ("mps", "info")
    assert detail.startswith("off: no control pipe") and "nvidia-cuda-mps-control -d" in detail
    assert "no nvidia-smi" in detail
    os.mkfifo(tmp_path / "control")
    # An nvidia-smi that prints a compute mode per GPU: the modes are listed once.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'Default\\nDefault\\n'\n")
    smi.chmod(0o755)
    _, result, _, detail = gpu_check.mps_row(tmp_path, str(smi))
    assert result == "info" and detail.startswith("on: a control pipe") and "compute mode Default" in detail
    assert "mps-control -d" not in detail


@pytest.mark.slow  # the script starts `python -m bench.gpu_check` (a minute on 2 cores)
def test_the_dry_mode_runs_every_check_through_the_script(tmp_path: Path) -> None:
    out = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run on CPU" in out.stdout
    rows = {r["check"]: r for r in __import__("json").loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == [*gpu_check.CHECKS, "mps"]
    # The checks of vLLM's CUDA build on a GPU say why they skip; every other runs.
    assert all(r["result"] == "ok" for n, r in rows.items() if n not in ("mps", *gpu_vllm.CHECKS)), rows
    assert all(rows[n]["result"] == "skip" and "vLLM's CUDA build" in rows[n]["detail"] for n in gpu_vllm.CHECKS)
    assert rows["mps"]["result"] == "info"
    assert "offload prefetch, groups of 2 streaming 1" in rows["judge_args"]["detail"]
    assert "summed over the group" in rows["finish_step"]["detail"]
    assert "next step identical" in rows["handoff"]["detail"]
    assert "2/4 layers streamed" in rows["judge_offload"]["detail"]


def test_the_judge_pipeline_gives_the_resident_output_and_fails_on_a_wrong_one() -> None:
    result = gpu_judge.measure(gpu_judge.TOY, (8, 24), 2, 1, torch.device("cpu"), reps=1)
    assert [r["tokens"] for r in result["rows"]] == [8, 24] and all(r["streamed_diff"] == 0 for r in result["rows"])
    assert gpu_judge.verdict(result, timed_for_real=False) is None
    slow = {**result, "rows": [{**result["rows"][0], "speedup": 0.8, "pipelined_ms": 5.0, "unpipelined_ms": 4.0}]}
    assert "slower than unpipelined" in gpu_judge.verdict(slow, timed_for_real=True)
    off = {**result, "rows": [{**result["rows"][0], "speedup": 1.2, "model_err_unpipelined": 0.05,
                               "model_err_pipelined": -0.3}]}
    assert "misses by -30%" in gpu_judge.verdict(off, timed_for_real=True)
    wrong = {**result, "rows": [{**result["rows"][0], "streamed_diff": 0.5}]}
    assert "moved the output by 5.0e-01" in gpu_judge.verdict(wrong, timed_for_real=False)
    overflowed = {**result, "rows": [{**result["rows"][0], "streamed_diff": float("nan")}]}
    assert "moved the output by nan" in gpu_judge.verdict(overflowed, timed_for_real=False)


def test_mps_is_on_only_with_the_daemons_control_pipe(tmp_path: Path, monkeypatch) -> None:
    from rpk.gpu.device import mps_on

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_on()
    (tmp_path / "control").write_text("")  # a file, not the daemon's pipe
    assert not mps_on()
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert mps_on() and mps_on(tmp_path)
