"""The process-pool scorer: hard timeouts, crashes and floods cost one sample each,
cancellation kills the call, the pool follows the backlog; math-verify in a worker.

Worker start costs ~0.3 s on 2 cores, so most tests share one module-scoped pool and
check counter deltas."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import pytest_asyncio

from rpk.core.records import Prompt, Response
from rpk.reward import PoolSettings, ProcessScorer, RewardError, RewardPoolError
from rpk.reward import math as math_reward
from tests import reward_fns
from tests.reward_fns import MISBEHAVING

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 1.0


def response(text: str, source: str = "t", truth: str = "42", **extra) -> Response:
    prompt = Prompt("u", (1,), source, truth, extra)
    return Response(prompt, 0, (5, 6), (-0.1, -0.2), "stop", 0, text=text)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool():
    functions = {
        "t": reward_fns.hostile, "async": reward_fns.async_exact, "kw": reward_fns.keyword_only,
    }
    scorer = ProcessScorer(functions, PoolSettings(timeout_s=TIMEOUT_S, min_workers=1, max_workers=2))
    yield scorer
    await scorer.aclose()


def _gone(pid: int) -> bool:
    """Exited and reaped, or at least dead (a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped before, or while, it was read
        return True
    return state in ("Z", "X")


async def test_good_calls_sync_and_async(pool):
    assert (await pool.score(response("fine"))).reward == 1.0
    a = await pool.score(response("42", source="async"))
    assert a.reward == 1.0 and a.correct and a.error is None
    wrong = await pool.score(response("41", source="async"))
    assert wrong.reward == 0.0 and not wrong.correct and wrong.error is None
    keywords = await pool.score(response("42", source="kw"))  # called as veRL calls it
    assert keywords.reward == 1.0 and keywords.error is None


@pytest.mark.parametrize(
    "text, kind, why",
    [
        *MISBEHAVING,
        ("sys_exit", "raised", "SystemExit"),
        ("hang", "timeout", f"killed after {TIMEOUT_S}s"),
        ("exit:3", "crashed", "exit code 3"),
        ("segv", "crashed", "exit code -11"),
    ],
)
async def test_one_bad_sample_costs_only_that_sample(pool, text, kind, why):
    before = pool.failures[kind]
    t0 = time.monotonic()
    bad = await pool.score(response(text))
    took = time.monotonic() - t0
    assert bad.reward == 0.0 and bad.correct is False
    assert bad.error is not None and bad.error.startswith(kind) and why in bad.error
    assert pool.failures[kind] == before + 1
    assert took < TIMEOUT_S + 1.0
    good = await pool.score(response("fine"))
    assert good.reward == 1.0 and good.error is None
    assert pool.metrics()[f"reward_failed_{kind}_total"] == pool.failures[kind]


async def test_a_hung_worker_is_killed(pool, tmp_path):
    pidfile = tmp_path / "pid"
    bad = await pool.score(response("pidfile", pidfile=str(pidfile)))
    assert bad.error is not None and bad.error.startswith("timeout")
    pid = int(pidfile.read_text())
    for _ in range(50):
        if _gone(pid):
            break
        await asyncio.sleep(0.05)
    assert _gone(pid)


async def test_megabytes_of_output_flood_nothing(pool, capfd):
    # 20 MB over stdout and stderr, Python-level and raw fds: with either left on a pipe
    # the worker would block (and time out) or corrupt the reply stream.
    got = await pool.score(response("flood:5"))
    assert got.reward == 1.0 and got.error is None
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err


async def test_cancelling_score_kills_the_running_call(pool, tmp_path):
    pidfile = tmp_path / "pid"
    cancelled_before = pool.cancelled
    task = asyncio.create_task(pool.score(response("pidfile", pidfile=str(pidfile))))
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        await asyncio.sleep(0.02)
    pid = int(pidfile.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(40):
        if _gone(pid):
            break
        await asyncio.sleep(0.05)
    assert _gone(pid), "the cancelled call's worker still runs"
    assert pool.cancelled == cancelled_before + 1
    assert (await pool.score(response("fine"))).reward == 1.0


async def test_pool_grows_with_the_backlog_and_shrinks_when_idle():
    settings = PoolSettings(timeout_s=5.0, min_workers=1, max_workers=3, idle_s=0.5)
    scorer = ProcessScorer({"t": reward_fns.hostile}, settings)
    try:
        await scorer.score(response("fine"))
        assert scorer.metrics()["reward_workers"] == 1.0
        peak = 0.0
        calls = asyncio.gather(*(scorer.score(response("sleep:0.6")) for _ in range(6)))
        while not calls.done():
            peak = max(peak, scorer.metrics()["reward_workers"])
            await asyncio.sleep(0.05)
        assert all(s.reward == 1.0 for s in await calls)
        assert peak == 3.0  # grew to max_workers, never past it
        assert scorer.workers_started == 3
        await asyncio.sleep(1.2)
        assert scorer.metrics()["reward_workers"] == 1.0  # back to min_workers
        assert (await scorer.score(response("fine"))).reward == 1.0
    finally:
        await scorer.aclose()


async def test_five_percent_of_samples_hang():
    settings = PoolSettings(timeout_s=0.5, min_workers=1, max_workers=4)
    scorer = ProcessScorer({"t": reward_fns.hostile}, settings)
    try:
        texts = ["hang" if i % 20 == 0 else "fine" for i in range(100)]
        t0 = time.monotonic()
        got = await asyncio.gather(*(scorer.score(response(t)) for t in texts))
        took = time.monotonic() - t0
    finally:
        await scorer.aclose()
    hung = [s for s, t in zip(got, texts) if t == "hang"]
    assert len(hung) == 5 and all(s.reward == 0.0 and s.error.startswith("timeout") for s in hung)
    assert sum(s.reward for s in got) == 95.0
    assert scorer.failures == {"timeout": 5}
    assert took < 15.0


async def test_math_verify_runs_in_the_worker_main_thread():
    scorer = ProcessScorer(
        {"lighteval/MATH": math_reward.compute_score}, PoolSettings(timeout_s=30.0, max_workers=1)
    )
    cases = [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("so $x = \\frac{1}{2}$", "1/2", 1.0),
        ("\\boxed{x^2+2x}", "x(x+2)", 1.0),
        ("She earns 72 dollars.", "#### 72", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("no answer here", "\\sqrt{2}", 0.0),
    ]
    try:
        got = [await scorer.score(response(t, "lighteval/MATH", g)) for t, g, _ in cases]
    finally:
        await scorer.aclose()
    assert [s.reward for s in got] == [want for _, _, want in cases]
    assert all(s.error is None for s in got)
    assert [s.correct for s in got] == [want == 1.0 for _, _, want in cases]


async def test_math_verify_off_the_main_thread_has_no_signal_timeout():
    score = await asyncio.to_thread(math_reward.compute_score, "math", "\\boxed{2^{10}}", "1024")
    assert score == {"score": 1.0, "acc": True}


async def test_unpicklable_function_is_a_config_error_and_a_closed_pool_refuses():
    with pytest.raises(RewardError, match="importable module-level"):
        ProcessScorer({"t": lambda *a: 1.0}, PoolSettings(timeout_s=1.0))
    scorer = ProcessScorer({"t": reward_fns.hostile}, PoolSettings(timeout_s=1.0))
    await scorer.aclose()
    with pytest.raises(RewardPoolError, match="closed"):
        await scorer.score(response("fine"))


async def test_a_worker_that_cannot_start_breaks_the_pool(monkeypatch):
    monkeypatch.setattr("rpk.reward.pool._WORKER_CODE", "import sys; sys.exit('no such worker')")
    scorer = ProcessScorer({"t": reward_fns.hostile}, PoolSettings(timeout_s=1.0))
    try:
        with pytest.raises(RewardPoolError, match="did not start"):
            await scorer.score(response("fine"))
        with pytest.raises(RewardPoolError, match="broken"):
            await scorer.score(response("fine"))
    finally:
        await scorer.aclose()


async def test_the_pool_never_starts_more_than_max_workers_under_steady_arrivals():
    # Calls keep arriving while finished workers are handed to waiting ones: a worker in
    # that hand-over must still count, or every arrival starts one more.
    scorer = ProcessScorer({"t": reward_fns.hostile}, PoolSettings(timeout_s=5.0, max_workers=2))
    try:
        calls = []
        for _ in range(60):
            calls += [asyncio.create_task(scorer.score(response("fine"))) for _ in range(5)]
            await asyncio.sleep(0.002)
        got = await asyncio.gather(*calls)
    finally:
        await scorer.aclose()
    assert all(s.reward == 1.0 for s in got)
    assert scorer.workers_started == 2


async def test_a_memory_bomb_costs_one_sample_and_one_worker():
    """4 GiB asked of a worker limited to 256 MiB: the call fails alone (MemoryError, or
    a crash if it dies in C), the worker that holds what it got retires, and a fresh
    one serves the next call."""
    settings = PoolSettings(timeout_s=30.0, max_workers=1, memory_mb=256)
    scorer = ProcessScorer({"t": reward_fns.hostile}, settings)
    try:
        assert (await scorer.score(response("fine"))).reward == 1.0
        bomb = await scorer.score(response("bomb:4096"))
        after = await scorer.score(response("fine"))
    finally:
        await scorer.aclose()
    assert bomb.reward == 0.0 and bomb.correct is False
    assert bomb.error is not None and bomb.error.startswith(("raised: MemoryError", "crashed"))
    assert scorer.failures["raised"] + scorer.failures["crashed"] == 1
    assert after.reward == 1.0 and after.error is None
    assert scorer.workers_started == 2

