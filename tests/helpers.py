"""Helpers of the loop and scheduler tests: request ids and prompts read back, a round's
plan, whole steps on the virtual-time engine, and an aiohttp app served on a loopback port
(on the test's loop, or from a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator

from aiohttp import web

from rpk.core.outcomes import RoundPlan
from rpk.core.records import RoundKind
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.sim import CostModel, SimEngine
from tests.fakes import LengthScorer, RecordingTrainer, mean_centred

FLAT = CostModel(base_s=0.01, per_seq_s=0.0)  # 10 ms a step, whatever the batch


def prompt_of(request) -> int:
    """The index i of a `make_prompts` prompt, from its request's token ids (7, i)."""
    return request.prompt_token_ids[1]


def index_of(request) -> int:
    """A request's response index, from its id (`...-r<j>`)."""
    return int(request.request_id.rsplit("-r", 1)[1])


def resp_index(request_id: str) -> int:
    """The response index in a request id `<step>-<prompt>-r<j>`."""
    return int(request_id.split("-")[2][1:])


def plan(prompts, launched: int, group: int, needed: int, max_tokens: int = 64) -> RoundPlan:
    """Step 1's round: `launched` responses a prompt, `needed` groups of `group`; short
    when it over-provisions, else sync."""
    return RoundPlan(
        step=1,
        kind=RoundKind.SHORT if launched > group else RoundKind.SYNC,
        prompts=tuple(prompts),
        responses_per_prompt=launched,
        group_size=group,
        groups_needed=needed,
        max_tokens=max_tokens,
    )


async def run_steps(policy, engine: SimEngine, steps: int, first: int = 1, stop=None):
    """`steps` whole steps of `policy` on the virtual-time engine (a recording trainer,
    rewards by length); each round's kind is the one the policy announced."""
    trainer = RecordingTrainer()
    runner = AsyncTrainer(trainer)
    outcomes = []
    try:
        for step in range(first, first + steps):
            if stop is not None and stop():
                break
            said = policy.next_kind()  # what a regroup for the round is chosen by
            outcomes.append(
                await run_step(step, policy, engine, LengthScorer(threshold=30), runner,
                               mean_centred, version=trainer.version, clock=engine.clock)
            )
            assert outcomes[-1].round.plan.kind is said, (step, said)
    finally:
        await runner.aclose()
    return outcomes


def waiting(policy) -> list[int]:
    """Drawn but not yet trained: tail's long-prompt queue, length_aware's pending."""
    return list(getattr(policy, "queue", None) or getattr(policy, "pending", ()))


def assert_idle(engine: SimEngine) -> None:
    assert engine.running == frozenset() and engine.waiting == ()


@contextlib.asynccontextmanager
async def served(app: web.Application, path: str = "") -> AsyncIterator[str]:
    """`app` on a free loopback port of the running loop: its base URL (then `path`)."""
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}{path}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def serving(app: web.Application) -> Iterator[str]:
    """`served(app)` run by its own event loop in a thread, for a caller that blocks."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = served(app)
    try:
        url = asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(10)
        try:
            yield url
        finally:
            asyncio.run_coroutine_threadsafe(server.__aexit__(None, None, None), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
