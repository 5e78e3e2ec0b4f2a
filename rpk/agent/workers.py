"""Threads for blocking tools, apart from everything else rpk runs on threads.

A plain (blocking) tool function cannot be cancelled: once it hangs, its thread is gone
for good. Run on the event loop's default executor (`asyncio.to_thread`), such a thread
is one less for rpk's own blocking work (weight sync, checkpoints, reward calls), and
the executor's threads are joined at interpreter exit, so a hung tool also kept Ctrl-C
from exiting. `ToolWorkers` gives tools threads of their own:

- at most `size` calls run at once; the others wait for a free worker, and that wait
  is not the call's time: a call's timeout counts from the moment it starts;
- each call runs on a daemon thread of its own (a thread per call costs tens of
  microseconds, nothing beside a tool's latency), so a call past its timeout or whose
  trajectory was aborted is abandoned where it hangs, frees its worker at once, and
  never holds up the interpreter's exit;
- abandoned calls still running are bounded too (`max_abandoned`): past that many, a
  tool that hangs every time would grow a thread per call, so further calls fail at
  once with an error naming the count, until some abandoned call returns.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any


class ToolsHung(RuntimeError):
    """Too many abandoned blocking calls are still running to start another."""


class ToolWorkers:
    """Runs blocking callables, at most `size` at once, each on a daemon thread."""

    def __init__(self, size: int, max_abandoned: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if size < 1:
            raise ValueError(f"tool workers: size={size} must be at least 1")
        self.size = size
        self.max_abandoned = size if max_abandoned is None else max_abandoned
        self.clock = clock
        self.running = 0
        self.abandoned = 0
        self._calls = 0
        self._free: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _slots(self) -> asyncio.Semaphore:
        # Made on the loop that first calls: a semaphore belongs to one event loop.
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            self._free, self._loop = asyncio.Semaphore(self.size), loop
        return self._free

    async def call(self, fn: Callable[..., Any], kwargs: Mapping[str, Any],
                   timeout_s: float | None) -> tuple[Any, float, float]:
        """`fn(**kwargs)` on a worker: (its result, seconds queued for a worker, seconds
        it ran). TimeoutError `timeout_s` after it started; its exception as raised;
        ToolsHung when `max_abandoned` abandoned calls still run. Cancelled or timed out,
        the call is abandoned: its thread runs on, unwaited for."""
        queued_at = self.clock()
        async with self._slots():
            if self.abandoned >= self.max_abandoned:
                raise ToolsHung(
                    f"{self.abandoned} blocking tool calls are still running past their "
                    f"timeout or abort (at most {self.max_abandoned}); this call did not run"
                )
            started = self.clock()
            loop = asyncio.get_running_loop()
            done: asyncio.Future[Any] = loop.create_future()
            self._calls += 1
            thread = threading.Thread(
                target=_work, args=(loop, done, fn, kwargs, self._returned),
                name=f"rpk-tool-{getattr(fn, '__name__', type(fn).__name__)}-{self._calls}",
                daemon=True,
            )
            self.running += 1
            thread.start()
            try:
                async with asyncio.timeout(timeout_s):
                    out = await asyncio.shield(done)
            except BaseException:
                if not done.done():
                    # The thread still runs: it is no longer this worker's, and counts
                    # as abandoned until it returns.
                    done.cancel()
                    self.abandoned += 1
                raise
            return out, started - queued_at, self.clock() - started

    def _returned(self, done: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
        self.running -= 1
        if done.cancelled():
            self.abandoned -= 1
            return
        value, error = outcome
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)


def _work(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], fn: Callable[..., Any],
          kwargs: Mapping[str, Any], returned: Callable[..., None]) -> None:
    try:
        outcome: tuple[Any, BaseException | None] = (fn(**kwargs), None)
    except Exception as e:  # the tool's own failure, handed to the caller
        outcome = (None, e)
    except BaseException as e:  # SystemExit in a tool ends the call, not the process
        outcome = (None, RuntimeError(f"the tool raised {type(e).__name__}"))
    try:
        loop.call_soon_threadsafe(returned, done, outcome)
    except RuntimeError:
        pass  # the loop has closed: nobody waits for this answer any more
