"""Trainers that train nothing, for runs on virtual time, where what matters is when
the loop feeds them, not what they learn: `NullTrainer` (the `Trainer` Protocol, free)
and `sim_trainer` (the loop's own `AsyncTrainer` over it, each call costing virtual time
on the devices it is given: `VirtualCompute`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpk.core.modes import Offload
from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample
from rpk.loop.trainer import AsyncTrainer, Work
from rpk.sim.node import SimNode


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

    def compute_on(self, ranks: Sequence[int] | None) -> None:
        """One process, nothing to narrow: the ranks are not this trainer's business."""

    def offload(self, what: Offload) -> None:
        """No state to move: a simulated GPU's memory is the simulator's (`rpk.sim.memory`)."""

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


class VirtualCompute:
    """The simulator's compute part for `rpk.loop.trainer.AsyncTrainer`: every call runs
    on the event loop, after the virtual seconds its `Work` costs on the devices it is
    given.

    An accumulate call of T tokens takes `T * token_s / share()` virtual seconds, where
    `share()` is the fraction of the fleet's devices the trainer computes on when the
    call starts (1 after the round; the lent replicas' share while borrowing; what
    thread streaming gets of devices it shares with decoding). `on_busy(True/False)`
    brackets each costed call: where the trainer shares the engine's devices, the caller
    slows decoding meanwhile (`SimEngine.set_cost`)."""

    def __init__(
        self, node: SimNode, cost: TrainCost, share: Callable[[], float] = lambda: 1.0,
        on_busy: Callable[[bool], None] | None = None,
    ) -> None:
        self.node = node
        self.cost = cost
        self.share = share
        self.on_busy = on_busy

    async def run(self, work: Work | None, fn: Callable[..., Any], *args: Any) -> Any:
        if work is not None:
            await self._work(self._seconds(work))
        return fn(*args)

    def _seconds(self, work: Work) -> float:
        if work.optimizer_step:
            return self.cost.finish_s
        share = self.share()
        if not 0 < share <= 1:
            raise ValueError(f"the trainer's share of the devices must be in (0, 1], got {share!r}")
        return work.tokens * self.cost.token_s / share

    async def _work(self, seconds: float) -> None:
        if self.on_busy:
            self.on_busy(True)
        try:
            await self.node.sleep_until(self.node.clock.now() + seconds)
        finally:
            if self.on_busy:
                self.on_busy(False)

    def close(self) -> None:
        pass


def sim_trainer(
    node: SimNode, cost: TrainCost, share: Callable[[], float] = lambda: 1.0,
    on_busy: Callable[[bool], None] | None = None,
) -> AsyncTrainer:
    """The loop's own trainer driver over a `NullTrainer`, on virtual time."""
    return AsyncTrainer(NullTrainer(), compute=VirtualCompute(node, cost, share, on_busy))
