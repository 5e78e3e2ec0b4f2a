"""The trainer as the loop drives it: `AsyncTrainer` awaits a blocking `Trainer`'s calls.

What runs a call is the trainer's compute part (`Compute`): `OnThread`, one dedicated
thread for every call in the order made, so the event loop keeps serving the engine and
torch's per-thread state stays on one thread; `Inline`, on the event loop itself (virtual
time, where a real thread would let the engine race ahead by however long the OS takes
to schedule it); the simulator's `rpk.sim.trainer.VirtualCompute`, which charges each
call virtual seconds for the `Work` it does. The driver itself is the same for all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rpk.core.modes import Offload
from rpk.core.protocols import Trainer, WeightBucket
from rpk.core.records import TrainSample


@dataclass(frozen=True, slots=True)
class Work:
    """What one trainer call computes, for a compute part that charges time by it."""

    tokens: int = 0  # tokens trained (prompt and response) by an accumulate call
    optimizer_step: bool = False  # finish_step: the step and the reduction deferred to it


class Compute(Protocol):
    async def run(self, work: Work | None, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, a blocking trainer call doing `work` (None: bookkeeping)."""
        ...

    def close(self) -> None: ...


class OnThread:
    """Every call on one dedicated thread, in the order made. `thread_init` runs once on
    that thread: on GPU it makes a side CUDA stream current there (rpk.gpu.streams), so
    trainer kernels queue apart from the engine's."""

    def __init__(self, thread_init: Callable[[], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rpk-trainer", initializer=thread_init
        )

    async def run(self, work: Work | None, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class Inline:
    """Every call on the event loop, at once (virtual time)."""

    async def run(self, work: Work | None, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def close(self) -> None:
        pass


class AsyncTrainer:
    """A blocking `Trainer` driven from the event loop (`rpk.core.protocols.StepTrainer`):
    each call runs on `compute` (a thread of its own, started with `thread_init`, unless
    given)."""

    def __init__(
        self, trainer: Trainer, thread_init: Callable[[], None] | None = None, *,
        compute: Compute | None = None,
    ) -> None:
        self.trainer = trainer
        self.compute = compute if compute is not None else OnThread(thread_init)

    @property
    def version(self) -> int:
        return self.trainer.version

    async def call(self, fn: Callable[..., Any], *args: Any, work: Work | None = None) -> Any:
        return await self.compute.run(work, fn, *args)

    async def begin_step(self) -> None:
        await self.call(self.trainer.begin_step)

    async def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return await self.call(self.trainer.accumulate, samples, work=Work(tokens=tokens))

    async def finish_step(self) -> Mapping[str, float]:
        return await self.call(self.trainer.finish_step, work=Work(optimizer_step=True))

    async def abandon_step(self) -> None:
        await self.call(self.trainer.abandon_step)

    async def compute_on(self, ranks: Sequence[int] | None) -> None:
        await self.call(self.trainer.compute_on, ranks)

    async def offload(self, what: Offload) -> None:
        """The trainer's state to host (`none`, `optimizer`, `all`) while vLLM generates;
        it comes back with the first micro-batch (`TorchTrainer.offload`)."""
        await self.call(self.trainer.offload, what)

    async def weight_buckets(self, max_bytes: int) -> AsyncIterator[WeightBucket]:
        """The trainer's `weight_buckets`, each bucket made where the calls run."""
        buckets = await self.call(self.trainer.weight_buckets, max_bytes)
        while (bucket := await self.call(next, buckets, None)) is not None:
            yield bucket

    async def save(self, directory: Path) -> None:
        await self.call(self.trainer.save, directory)

    async def load(self, directory: Path) -> None:
        await self.call(self.trainer.load, directory)

    async def aclose(self) -> None:
        """After whatever call is running: the trainer's `close`, then the compute part."""
        try:
            await self.call(self.trainer.close)
        finally:
            self.compute.close()


class WeightTally:
    """Counts the buckets and bytes of weights on their way to the engine."""

    def __init__(self) -> None:
        self.buckets = 0
        self.bytes = 0

    async def count(self, buckets: AsyncIterable[WeightBucket]) -> AsyncIterator[WeightBucket]:
        async for bucket in buckets:
            self.buckets += 1
            self.bytes += sum(_nbytes(t) for _, t in bucket)
            yield bucket


def _nbytes(tensor: Any) -> int:
    # torch tensors, without importing torch here: numel * element_size
    return int(tensor.numel() * tensor.element_size()) if hasattr(tensor, "element_size") else 0
