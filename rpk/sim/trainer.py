"""A trainer that trains nothing: the `Trainer` Protocol for runs on virtual time, where
what matters is when the loop feeds it, not what it learns."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping, Sequence

from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample


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
