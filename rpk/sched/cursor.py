"""A resumable, seeded walk over the dataset, epoch by epoch."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass


class CursorMismatch(ValueError):
    """A checkpoint's cursor was made over another dataset."""


@dataclass(slots=True)
class PromptCursor:
    """Walks the dataset epoch by epoch in a seeded order; its state is two integers,
    so a checkpoint resumes exactly where it stopped."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[int]:
        """The next `n` dataset indices, crossing into the next epoch when needed."""
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.epoch)
            chunk = order[self.position : self.position + (n - len(out))]
            out.extend(chunk)
            self.position += len(chunk)
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["size"] != self.size:
            raise CursorMismatch(
                f"checkpoint cursor was over {state['size']} prompts, the dataset has {self.size}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
