"""A run's tiny-model build runs in a child process: it gives the model the in-process
build gives, its errors reach the caller, and cancelling it kills the child at once and
leaves nothing in the cache. Then the probe from issue 33, as a user meets it: SIGTERM or
Ctrl-C while `python -m rpk.run` builds its tiny model exits within seconds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from rpk.config import ArithSpec, TinySpec
from rpk.tasks import tiny, tiny_build
from tests.procs import descendants, interrupt, kill_all, wait_gone

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = TinySpec(
    vocab_size=280, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
    intermediate_size=64, max_position_embeddings=128, sft_steps=3, sft_batch_tokens=256,
    sft_problems=32, task=ArithSpec(max_digits=4),
)
# Long enough that no test sees its end.
ENDLESS = dataclasses.replace(SMALL, sft_steps=10**7)


async def test_the_child_builds_the_model_and_a_second_call_finds_it_cached(tmp_path) -> None:
    logs: list[str] = []
    model_dir = await tiny_build.build(SMALL, tmp_path, logs.append)
    assert model_dir == tiny.model_dir(SMALL, tmp_path)
    assert json.loads((model_dir / "rpk_tiny.json").read_text())["spec"]["sft_steps"] == 3
    assert (model_dir / "model.safetensors").is_file()
    assert any("warm-up step 3/3" in line for line in logs), logs
    assert logs[-1].startswith(f"tiny: built {model_dir} in ")
    assert [p.name for p in tmp_path.iterdir()] == [model_dir.name]
    assert await tiny_build.build(SMALL, tmp_path, logs.append) == model_dir
    assert logs[-1] == f"tiny: cache hit {model_dir}"


async def test_a_failing_build_raises_its_own_error_and_leaves_nothing(tmp_path) -> None:
    too_short = dataclasses.replace(SMALL, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(16\) is shorter"):
        await tiny_build.build(too_short, tmp_path, lambda _: None)
    assert list(tmp_path.iterdir()) == []


async def test_cancelling_the_build_kills_the_child_and_removes_its_files(tmp_path) -> None:
    logs: list[str] = []
    # In one pytest process with the integration tests, session-scoped engines are children
    # too: only the processes this build starts are its own.
    before = descendants(os.getpid())
    task = asyncio.ensure_future(tiny_build.build(ENDLESS, tmp_path, logs.append))
    deadline = time.monotonic() + 120
    while not any("parameters" in line for line in logs):  # the warm-up has begun
        assert not task.done() and time.monotonic() < deadline, logs
        await asyncio.sleep(0.05)
    children = descendants(os.getpid()) - before
    assert children, "the build should run in a child process"
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 5
    assert not wait_gone(children, timeout_s=5)
    assert list(tmp_path.iterdir()) == []


def _lines(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_runs_build_exits_within_seconds(tmp_path, signum, code) -> None:
    cache = tmp_path / "cache"
    spec = [x for name, value in (("sft_steps", 10**7), ("sft_problems", 32), ("hidden_size", 32),
                                  ("num_layers", 2), ("intermediate_size", 64))
            for x in (f"--model.tiny_tool_add.{name}", str(value))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rpk.run", "--data.task", "tool_add", "--model.cache_dir", str(cache),
         "--run.out_dir", str(tmp_path / "runs"), "--run.progress", "false", *spec],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
    )
    err: list[str] = []
    reader = threading.Thread(target=_lines, args=(proc.stderr, err), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("parameters" in line for line in err):
            assert proc.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "".join(err)
            time.sleep(0.05)
        children = descendants(proc.pid)
        assert children, "the build should run in a child process"
        started = time.monotonic()
        interrupt(proc.pid, signum)
        got = proc.wait(timeout=10)
        took = time.monotonic() - started
    finally:
        kill_all(descendants(proc.pid) | {proc.pid})
    reader.join(timeout=5)
    text = "".join(err)
    assert got == code, text
    assert took < 10
    assert "Traceback" not in text
    assert f"rpk: interrupted by {signal.Signals(signum).name} before the first step" in text
    assert not wait_gone(children, timeout_s=5)
    assert list(cache.iterdir()) == [], "a half-built model was left in the cache"
