"""The process-pool scorer (`reward.backend=process`): reward functions run in worker
processes, each call under a hard timeout that kills its worker.

Why not `multiprocessing` (or pebble, which is built on it): its `spawn` and
`forkserver` children re-import the parent's `__main__`, which for `python -m rpk.run`
is the whole vLLM stack (seconds and hundreds of MB per worker), and a pool of fixed
size cannot follow the backlog. A worker here is a fresh interpreter started with
`asyncio.create_subprocess_exec` (spawn semantics: nothing is inherited from a parent
that has threads and vLLM), driven over its stdin/stdout pipes by the event loop with
no helper threads. It runs one call at a time, so killing it can never take another
sample with it.

- Timeout: the call's clock starts when its worker receives it; past `timeout_s` the
  worker's process group is SIGKILLed and the sample scores 0 ("timeout").
- A worker that dies mid-call (os._exit, segfault, OOM kill) costs that sample only
  ("crashed", with the exit code); raising, NaN and wrong types come back as
  "raised" / "bad_value". Every kind is counted in `metrics()`.
- Memory: each worker runs under RLIMIT_AS (`memory_mb`), set before it imports the
  reward functions, so a memory bomb fails its own allocation ("raised" MemoryError, or
  "crashed" when it dies in C) instead of taking the machine. A worker whose call ran
  out of memory may hold what it allocated (a module-level cache), so it retires after
  its reply and a fresh one takes its place.
- Workers' stdout and stderr go to /dev/null (the protocol uses a private copy of the
  original stdout), so a function that prints megabytes floods nothing.
- `async def` functions run in the worker too, under `asyncio.run`: the same hard
  timeout and kill then hold for them, and a coroutine that blocks cannot stall the
  engine's event loop. The price is one call at a time per worker.
- Cancelling `score()` while its call runs kills that worker.
- Sizing: a call that finds no idle worker waits in the backlog, and the pool starts
  one worker per waiting call not already covered by a starting one, up to
  `max_workers`; a worker idle for `idle_s` stops, down to `min_workers`. Calls in
  flight = busy workers, so the in-flight limit follows the pool size.
- A worker that cannot start breaks the pool: that is the loop-level failure that
  raises (`RewardPoolError`), to every waiting call and every later one.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import signal
import struct
import sys
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from rpk.core.errors import UserError
from rpk.core.records import Response, Scored
from rpk.lifetime import die_with_parent
from rpk.reward.functions import (
    RewardError,
    RewardFn,
    as_score,
    call_sync,
    describe,
    failed,
    failure_metrics,
    response_kwargs,
)

_HEADER = struct.Struct("!Q")
_WORKER_CODE = "from rpk.reward.pool import worker_main; worker_main()"
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
# The default worker memory limit: this share of the machine's memory, split over the
# most workers the pool may run (the trainer and the engine need the rest).
_MEMORY_SHARE = 0.5


def worker_memory_mb(max_workers: int) -> int:
    """The default address-space limit of one worker, MiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, int(total * _MEMORY_SHARE / max_workers) >> 20)


class RewardPoolError(UserError, RuntimeError):
    """The pool itself is broken (a worker could not start); the run stops."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    timeout_s: float
    min_workers: int = 1
    max_workers: int = 4
    idle_s: float = 120.0
    start_timeout_s: float = 60.0
    memory_mb: int | None = None  # RLIMIT_AS of a worker; None: no limit

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(
                f"need 0 <= min_workers <= max_workers and max_workers >= 1, got "
                f"min_workers={self.min_workers!r}, max_workers={self.max_workers!r}"
            )
        if not self.idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {self.idle_s!r}")
        if self.memory_mb is not None and not self.memory_mb > 0:
            raise ValueError(f"memory_mb must be > 0, got {self.memory_mb!r}")


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class _Worker:
    __slots__ = ("proc", "uses")

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.uses = 0  # calls served: tells a stale idle timer from a current one

    async def send(self, frame: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame)
        await self.proc.stdin.drain()

    async def recv(self) -> Any:
        assert self.proc.stdout is not None
        (size,) = _HEADER.unpack(await self.proc.stdout.readexactly(_HEADER.size))
        return pickle.loads(await self.proc.stdout.readexactly(size))

    def kill(self) -> None:
        # The worker leads its own process group: whatever the user function started
        # dies with it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def exit_code(self, grace_s: float = 2.0) -> int | None:
        try:
            return await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            return None


class ProcessScorer:
    """Scores responses in a pool of worker processes; see the module docstring."""

    def __init__(self, functions: Mapping[str, RewardFn], settings: PoolSettings) -> None:
        self.settings = settings
        try:
            # Pickled once, here: a function that cannot travel is a config error now,
            # not a failure of every sample later. Nested so the worker can set sys.path
            # before it imports the functions' modules.
            self._hello = _frame(
                (list(sys.path), settings.memory_mb, pickle.dumps(dict(functions)))
            )
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise RewardError(
                f"reward functions must be importable module-level functions: {e}"
            ) from None
        self._sources = frozenset(functions)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._waiters: deque[asyncio.Future[_Worker]] = deque()
        self._starting = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._broken: BaseException | None = None
        self._closed = False
        self._backlog_peak = 0
        self.failures: Counter[str] = Counter()
        self.cancelled = 0
        self.workers_started = 0
        self.workers_retired = 0  # after running out of memory

    @property
    def size(self) -> int:
        return len(self._idle) + len(self._busy) + self._starting

    async def score(self, response: Response) -> Scored:
        if self._closed:
            raise RewardPoolError("the reward pool is closed")
        p = response.prompt
        if p.data_source not in self._sources:
            raise RewardPoolError(f"no reward function for data_source {p.data_source!r}")
        kwargs = response_kwargs(response)
        try:
            task = _frame((p.data_source, kwargs))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            return failed(self.failures, response, "bad_input", f"cannot send the row to a worker: {e}")
        worker = await self._acquire()
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await worker.send(task)
                reply = await worker.recv()
        except TimeoutError:
            self._discard(worker)
            return failed(self.failures, response, "timeout", f"killed after {self.settings.timeout_s}s")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._discard(worker)
            code = await worker.exit_code()
            return failed(self.failures, response, "crashed", f"worker process died (exit code {code})")
        except BaseException as e:
            # Cancelled (the round ended) or worse, mid-call: the worker still runs the
            # call and its late reply would desynchronise the pipe, so it goes.
            self._discard(worker)
            if isinstance(e, asyncio.CancelledError):
                self.cancelled += 1
            raise
        kind, value, acc, retiring = reply
        if retiring:
            self._discard(worker)
            self.workers_retired += 1
        else:
            self._busy.discard(worker)
            worker.uses += 1
            self._hand_over(worker)
        if kind != "ok":
            return failed(self.failures, response, kind, value)
        return Scored(response, value, acc if acc is not None else value > 0)

    async def _acquire(self) -> _Worker:
        if self._broken is not None:
            raise RewardPoolError("the reward pool is broken") from self._broken
        if self._idle:
            worker = self._idle.pop()
        else:
            waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self._backlog_peak = max(self._backlog_peak, len(self._waiters))
            self._grow()
            try:
                return await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    handed = waiter.result()  # handed a worker as we were cancelled
                    self._busy.discard(handed)
                    self._hand_over(handed)
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._busy.add(worker)
        return worker

    def _hand_over(self, worker: _Worker) -> None:
        """An idle worker goes to the oldest waiting call, else to the idle list. A
        handed-over worker is busy from now, not from when its caller wakes: until then
        it would be in no list, and the pool would start one more in its place."""
        if self._closed:
            worker.kill()
            self._spawn_task(worker.proc.wait())
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._busy.add(worker)
                waiter.set_result(worker)
                return
        self._idle.append(worker)
        asyncio.get_running_loop().call_later(
            self.settings.idle_s, self._retire_if_idle, worker, worker.uses
        )

    def _grow(self) -> None:
        if self._closed or self._broken is not None:
            return
        room = self.settings.max_workers - self.size
        uncovered = len(self._waiters) - self._starting - len(self._idle)
        for _ in range(max(self.settings.min_workers - self.size, min(uncovered, room))):
            self._starting += 1
            self._spawn_task(self._start_worker())

    def _retire_if_idle(self, worker: _Worker, uses: int) -> None:
        if worker.uses != uses or worker not in self._idle:
            return  # used since the timer was set: it has a newer timer
        if self.size <= self.settings.min_workers:
            return
        self._idle.remove(worker)
        assert worker.proc.stdin is not None
        worker.proc.stdin.close()  # the worker exits at end of input
        self._spawn_task(self._reap(worker))

    def _discard(self, worker: _Worker) -> None:
        """Kill a worker that is mid-call, then restore the minimum and serve waiters."""
        self._busy.discard(worker)
        worker.kill()
        self._spawn_task(self._reap(worker))
        self._grow()

    async def _reap(self, worker: _Worker) -> None:
        if await worker.exit_code() is None:
            worker.kill()
            await worker.proc.wait()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_worker(self) -> None:
        try:
            worker = await self._launch()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._break(e)
            return
        finally:
            self._starting -= 1
        self.workers_started += 1
        self._hand_over(worker)

    async def _launch(self) -> _Worker:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [_REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
        )}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER_CODE,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
        )
        worker = _Worker(proc)
        try:
            async with asyncio.timeout(self.settings.start_timeout_s):
                await worker.send(self._hello)
                status, detail = await worker.recv()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            worker.kill()
            assert proc.stderr is not None
            tail = (await proc.stderr.read())[-2000:].decode(errors="replace").strip()
            raise RewardPoolError(
                f"a reward worker did not start ({type(e).__name__}, exit code "
                f"{await worker.exit_code()}): {tail or 'no output'}"
            ) from None
        except BaseException:
            worker.kill()
            raise
        if status != "ready":
            worker.kill()
            limit = self.settings.memory_mb
            raise RewardPoolError(
                f"a reward worker did not start: {detail}"
                + (f" (its memory limit: {limit} MiB, reward.worker_memory_mb)" if limit else "")
            )
        return worker

    def _break(self, error: BaseException) -> None:
        self._broken = error
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RewardPoolError(str(error)))

    def metrics(self) -> dict[str, float]:
        """Pool state now, the backlog's peak since the last call, and totals."""
        peak, self._backlog_peak = self._backlog_peak, len(self._waiters)
        return {
            "reward_workers": float(self.size),
            "reward_busy": float(len(self._busy)),
            "reward_backlog": float(len(self._waiters)),
            "reward_backlog_peak": float(peak),
            "reward_timeout_s": self.settings.timeout_s,
            "reward_workers_started_total": float(self.workers_started),
            "reward_workers_retired_total": float(self.workers_retired),
            "reward_cancelled_total": float(self.cancelled),
            **failure_metrics(self.failures),
        }

    async def aclose(self) -> None:
        """Kill every worker and wait for them; pending calls fail, later ones raise."""
        self._closed = True
        self._break(RewardPoolError("the reward pool is closed"))
        for worker in [*self._idle, *self._busy]:
            worker.kill()
            self._spawn_task(worker.proc.wait())
        self._idle.clear()
        self._busy.clear()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _write(stream: BinaryIO, obj: Any) -> None:
    stream.write(_frame(obj))
    stream.flush()


def _run(fn: RewardFn, kwargs: dict[str, Any]) -> tuple[str, Any, Any, bool]:
    """(kind, score or why, acc, whether this worker must retire)."""
    try:
        value = call_sync(fn, kwargs)
    except MemoryError as e:
        return ("raised", describe(e), None, True)
    except BaseException as e:  # SystemExit too: user code must not end the worker
        return ("raised", describe(e), None, False)
    try:
        score, acc = as_score(value)
    except ValueError as e:
        return ("bad_value", str(e), None, False)
    return ("ok", score, acc, False)


def _limit_memory(memory_mb: int | None) -> None:
    if memory_mb is not None:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def worker_main() -> None:
    """A worker's loop: read (data_source, kwargs) frames, answer (kind, value, acc,
    retiring); after a retiring answer the worker exits."""
    die_with_parent()
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        sys_path, memory_mb, functions_blob = _read(requests)
        sys.path[:] = sys_path
        _limit_memory(memory_mb)  # before the user's modules are imported
        functions: dict[str, RewardFn] = pickle.loads(functions_blob)
    except EOFError:
        return
    except BaseException as e:
        _write(replies, ("failed", describe(e)))
        return
    _write(replies, ("ready", os.getpid()))
    while True:
        try:
            data_source, kwargs = _read(requests)
        except EOFError:
            return
        reply = _run(functions[data_source], kwargs)
        _write(replies, reply)
        if reply[-1]:
            return
