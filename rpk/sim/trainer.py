"""Trainers that train nothing, for runs on virtual time, where what matters is when
the loop feeds them, not what they learn: `NullTrainer` (the `Trainer` Protocol, free)
and `SimAsyncTrainer` (the loop's async trainer, each call costing virtual time on the
devices it is given)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Mapping, Sequence

from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample
from rpk.sim.engine import SimNode


class NullTrainer:
    """Keeps the samples of the open step; `finish_step` is one 'optimizer step'."""

    def __init__(self) -> None:
        self.version = 0
        self.steps = 0
        self.abandoned = 0
        self.samples: list[TrainSample] = []
        self.in_step = False

    def begin_step(self) -> None:
        if self.in_step:
            raise RuntimeError("begin_step while a step is open")
        self.in_step = True
        self.samples = []

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        if not self.in_step:
            raise RuntimeError("accumulate outside a step")
        self.samples.extend(samples)
        return {}

    def finish_step(self) -> Mapping[str, float]:
        if not self.in_step:
            raise RuntimeError("finish_step outside a step")
        self.in_step = False
        self.steps += 1
        self.version += 1
        return {"train_samples": float(len(self.samples))}

    def abandon_step(self) -> None:
        if self.in_step:
            self.abandoned += 1
        self.in_step = False
        self.samples = []

    def weight_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        return iter([[("version", self.version)]])

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "null_trainer.txt").write_text(str(self.version))

    def load(self, directory: Path) -> None:
        self.version = int((Path(directory) / "null_trainer.txt").read_text())

    def close(self) -> None:
        self.in_step = False


@dataclass(frozen=True, slots=True)
class TrainCost:
    """Virtual seconds of training: `token_s` per trained token (prompt and response)
    with every device of the fleet computing, `finish_s` for the optimizer step and the
    gradient reduction deferred to it."""

    token_s: float
    finish_s: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in (("token_s", self.token_s), ("finish_s", self.finish_s)) if not v >= 0}
        if bad:
            raise ValueError(f"TrainCost values must be >= 0, got {bad}")


class SimAsyncTrainer:
    """`rpk.loop.step.AsyncTrainer`'s interface on virtual time, over a `NullTrainer`.

    An accumulate call of T tokens takes `T * token_s / share()` virtual seconds, where
    `share()` is the fraction of the fleet's devices the trainer computes on when the
    call starts (1 after the round; the lent replicas' share while borrowing; what
    thread streaming gets of devices it shares with decoding). `on_busy(True/False)`
    brackets each call: where the trainer shares the engine's devices, the caller
    slows decoding meanwhile (`SimEngine.set_cost`)."""

    def __init__(
        self, node: SimNode, cost: TrainCost, share: Callable[[], float] = lambda: 1.0,
        on_busy: Callable[[bool], None] | None = None,
    ) -> None:
        self.trainer = NullTrainer()
        self.node = node
        self.cost = cost
        self.share = share
        self.on_busy = on_busy

    @property
    def version(self) -> int:
        return self.trainer.version

    async def _work(self, seconds: float) -> None:
        if self.on_busy:
            self.on_busy(True)
        try:
            await self.node.sleep_until(self.node.clock.now() + seconds)
        finally:
            if self.on_busy:
                self.on_busy(False)

    async def begin_step(self) -> None:
        self.trainer.begin_step()

    async def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        share = self.share()
        if not 0 < share <= 1:
            raise ValueError(f"the trainer's share of the devices must be in (0, 1], got {share!r}")
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        await self._work(tokens * self.cost.token_s / share)
        return self.trainer.accumulate(samples)

    async def finish_step(self) -> Mapping[str, float]:
        await self._work(self.cost.finish_s)
        return self.trainer.finish_step()

    async def abandon_step(self) -> None:
        self.trainer.abandon_step()

    async def weight_buckets(self, max_bytes: int) -> AsyncIterator[WeightBucket]:
        for bucket in self.trainer.weight_buckets(max_bytes):
            yield bucket

    async def aclose(self) -> None:
        self.trainer.close()
