"""Blocking tools cannot stall rpk: they run on rpk's tool workers (`rpk.agent.workers`),
never on the event loop's default executor, where rpk's own blocking work runs (weight
sync, checkpoints). A timeout counts from a call's start, a hung call costs its call and
frees its worker, abandoned calls are bounded, steps go on while a tool hangs forever,
and a process whose tools hang exits at once on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rpk.agent.engine import AgentEngine
from rpk.agent.env import ToolEnv
from rpk.agent.parse import ToolCall, format_tool_call
from rpk.agent.template import ObservationEncoder
from rpk.agent.tools import ToolRunner, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.config import TinySpec
from rpk.core.records import Prompt
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policy import Sampling, TailPolicy
from rpk.tasks.tiny import build_tokenizer
from tests import blocking_tools
from tests.agent_fakes import TurnEngine, turn_of
from tests.fakes import LengthScorer, RecordingTrainer, mean_centred
from tests.procs import descendants, interrupt, kill_all, wait_gone

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gate() -> Any:
    """The hanging tool's gate, closed for the test and opened after it, so that its
    abandoned threads end with the test."""
    blocking_tools.GATE.clear()
    yield blocking_tools.GATE
    blocking_tools.GATE.set()


def runner(*names: str, timeout_s: float, workers: ToolWorkers) -> ToolRunner:
    return ToolRunner([load_tool(f"tests.blocking_tools:{n}") for n in names], timeout_s,
                      workers=workers)


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_timeout_counts_from_the_calls_start_not_its_wait_for_a_worker() -> None:
    """One worker, two 0.3 s calls, a 0.5 s timeout: the second waits 0.3 s for the
    worker, then runs its 0.3 s in full (0.6 s after it was made, past the timeout had
    the wait counted). The wait is its own figure, not the call's seconds."""
    tools = runner("slow", timeout_s=0.5, workers=ToolWorkers(1))
    first, second = await asyncio.gather(*(tools.run(ToolCall("slow", {"seconds": 0.3}))
                                           for _ in range(2)))
    assert (first.text, second.text) == ("slept", "slept")
    assert not first.failed and not second.failed
    assert first.queued_s < 0.05 and 0.25 < second.queued_s < 0.45
    assert 0.28 < second.seconds < 0.45


async def test_a_hung_call_costs_its_call_frees_its_worker_and_abandoned_calls_are_bounded(gate) -> None:
    """One worker, at most two abandoned calls, a 0.2 s timeout. A hung call times out
    after 0.2 s and the next call gets the worker at once; with two hung calls
    abandoned, a third call fails at once naming them; once they return, calls run."""
    workers = ToolWorkers(1, max_abandoned=2)
    tools = runner("hang", "slow", timeout_s=0.2, workers=workers)
    hung = await tools.run(ToolCall("hang", {"x": 1}))
    assert hung.failed and hung.text == "error: timeout after 0.2 s" and 0.19 < hung.seconds < 0.5
    quick = await tools.run(ToolCall("slow", {"seconds": 0.0}))
    assert (quick.text, quick.failed) == ("slept", False) and quick.queued_s < 0.05
    await tools.run(ToolCall("hang", {"x": 2}))
    assert (workers.abandoned, workers.running) == (2, 2)
    refused = await tools.run(ToolCall("slow", {"seconds": 0.0}))
    assert refused.failed and refused.seconds == 0.0
    assert refused.text.startswith("error: 2 blocking tool calls are still running past their timeout")
    threads = [t for t in threading.enumerate() if t.name.startswith("rpk-tool-hang")]
    assert len(threads) == 2 and all(t.daemon for t in threads)
    gate.set()
    await wait_until(lambda: workers.abandoned == 0 and workers.running == 0)
    assert (await tools.run(ToolCall("slow", {"seconds": 0.0}))).text == "slept"


async def test_an_aborted_call_is_abandoned_not_waited_for(gate) -> None:
    """A trajectory aborted inside a blocking call: the cancellation lands at once,
    and the call counts as abandoned until its thread returns."""
    workers = ToolWorkers(2)
    tools = runner("hang", timeout_s=60.0, workers=workers)
    call = asyncio.ensure_future(tools.run(ToolCall("hang", {"x": 1})))
    await wait_until(lambda: workers.running == 1)
    started = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert time.monotonic() - started < 0.1 and workers.abandoned == 1
    gate.set()
    await wait_until(lambda: workers.abandoned == 0 and workers.running == 0)


async def test_slow_blocking_tools_leave_the_default_executor_to_rpk() -> None:
    """The weight sync (and every other blocking step of rpk's: checkpoints, reward
    calls) runs on the event loop's default executor. With more slow blocking tool
    calls in flight than that executor has threads, a sync-sized piece of work there
    takes what it takes without them: the tools hold threads of their own."""
    executor_threads = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    calls = executor_threads + 2
    workers = ToolWorkers(calls)
    tools = runner("slow", timeout_s=5.0, workers=workers)

    async def sync_time() -> float:
        started = time.monotonic()
        for _ in range(4):  # four buckets, each handed to a thread as rpk.engine does
            await asyncio.to_thread(sum, range(10_000))
        return time.monotonic() - started

    alone = await sync_time()
    running = [asyncio.ensure_future(tools.run(ToolCall("slow", {"seconds": 1.5})))
               for _ in range(calls)]
    await asyncio.sleep(0.2)  # every call has its thread by now
    beside_tools = await sync_time()
    assert beside_tools < alone + 0.2, (alone, beside_tools)
    assert workers.running == calls
    results = await asyncio.gather(*running)
    assert all(r.text == "slept" for r in results)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(TinySpec())


async def test_a_tool_that_hangs_forever_leaves_the_run_stepping(tokenizer, gate) -> None:
    """Every trajectory's first turn calls a blocking tool that never returns (until the
    test ends), with a 0.2 s timeout and two workers: each step ends, each hung call is
    the timeout's observation or, once two are abandoned, the error saying so."""
    ps = [Prompt(f"p{i}", (7, i), "test", str(i)) for i in range(8)]
    call = format_tool_call(ToolCall("hang", {"x": 1}))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    inner = TurnEngine(lambda req: call if turn_of(req) == 1 else "done", encode)
    tools = runner("hang", timeout_s=0.2, workers=ToolWorkers(2))
    engine = AgentEngine(inner, lambda: ToolEnv(tools), ObservationEncoder(tokenizer),
                         {p.uid: p for p in ps}, max_turns=4)
    policy = TailPolicy(ps, Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=600),
                        shuffle=False)
    trainer = AsyncTrainer(RecordingTrainer())
    try:
        for step in range(1, 4):
            started = time.monotonic()
            outcome = await asyncio.wait_for(
                run_step(step, policy, engine, LengthScorer(10**6), trainer, mean_centred,
                         version=0),
                timeout=10.0,
            )
            assert time.monotonic() - started < 5.0
            members = [m for g in outcome.round.groups for m in g.members]
            assert len(members) == 4
            for m in members:
                assert m.response.turns.tools.failures == 1
                assert ("error: timeout after 0.2 s" in m.response.text
                        or "blocking tool calls are still running" in m.response.text)
    finally:
        await trainer.aclose()
    assert not inner.running and not engine._live


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_exits_within_seconds_while_blocking_tools_hang(signum, code) -> None:
    """`tests.hung_tool_probe` holds four calls of a tool that sleeps an hour, on rpk's
    own signal handling and event loop; one signal ends it within 10 s, with the exit
    code rpk.run gives, and nothing of it survives."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hung_tool_probe"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "calling", \
            proc.stderr.read() if proc.stderr else ""
        started = time.monotonic()
        interrupt(proc.pid, signum)
        code_got = proc.wait(timeout=10)
        assert time.monotonic() - started < 10
        assert code_got == code, proc.stderr.read() if proc.stderr else ""
    finally:
        left = descendants(proc.pid) | {proc.pid}
        kill_all(left)
        proc.wait(timeout=5)
    assert not wait_gone(left, timeout_s=5)


def test_a_process_with_a_hung_default_executor_thread_would_not_exit() -> None:
    """The control for the test above: what the probe guards against is real. A thread
    of concurrent.futures' pool (asyncio's default executor) is joined at interpreter
    exit, so a process whose pool thread hangs outlives its main function."""
    script = ("import concurrent.futures, time\n"
              "concurrent.futures.ThreadPoolExecutor(1).submit(time.sleep, 3600)\n"
              "print('calling', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "calling"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
    finally:
        kill_all({proc.pid})
        proc.wait(timeout=5)
    assert not wait_gone({proc.pid}, timeout_s=5)
