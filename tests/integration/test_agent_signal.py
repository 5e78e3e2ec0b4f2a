"""One Ctrl-C ends a real `python -m rpk.run` within 10 s while every trajectory of its
first step waits on a blocking tool that never returns (`tests.hung_env`): the tool's
threads are rpk's daemon workers, not the default executor's, which the interpreter
would join at exit. Real processes, the real engine, the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.runs import ROOT, SMALL
from tests.procs import descendants, kill_all, wait_gone

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_one_sigint_ends_a_run_whose_tools_hang(tmp_path, rpk_cache) -> None:
    mark = tmp_path / "tool-called"
    cmd = [sys.executable, "-m", "rpk.run", *SMALL, "--data.val_size", "0",
           "--agent.env", "tests.hung_env:HungToolEnv", "--agent.tool_timeout_s", "3600",
           "--model.cache_dir", str(rpk_cache), "--run.out_dir", str(tmp_path / "runs")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "RPK_HUNG_MARK": str(mark)})
    try:
        deadline = time.monotonic() + 600
        while not mark.exists():
            assert proc.poll() is None, proc.stderr.read()[-4000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no tool was called"
            time.sleep(0.1)
        time.sleep(1.0)  # every trajectory's first turn ends and its call starts
        children = descendants(proc.pid)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole process group
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        left = descendants(proc.pid) | {proc.pid}
        kill_all(left)
        proc.wait(timeout=10)
    assert code == 130, err[-4000:]
    assert took < 10, f"{took:.1f} s to exit"
    assert "interrupted by SIGINT" in err
    assert not wait_gone(children | {proc.pid}, timeout_s=10)
