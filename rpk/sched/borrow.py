"""The borrowing stream trainer's decisions, as pure state (no await, no device).

RollPacker's stream trainer (arXiv 2509.21009, section "Stream trainer"): once 20-50% of
a round's responses are done and more keep arriving, half of the rollout devices stop
generating, their running requests move to the other half with the tokens they already
have, and the freed devices compute gradients on completed groups (no optimizer step,
no gradient reduction until the round ends). This module says when (`BorrowTrigger`),
which replicas lend (`lenders`) and where each moved request goes (`place_moves`);
`rpk.engine.fleet.Fleet.lend` moves them and `rpk.loop.feed` runs the trainer.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BorrowRule:
    """Fire once, at a check where at least `min_frac` of the round's responses are done
    and at least `min_gain` more were done since the previous check (responses still
    arrive: the round is not draining its last few), or at the first finish that reaches
    `max_frac` whatever the gain. Checks happen on response finishes, at most one per
    `check_s` seconds: the rate is measured over that window, not between two
    neighbouring finishes."""

    min_frac: float = 0.2
    max_frac: float = 0.5
    min_gain: float = 0.05
    check_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.min_frac <= self.max_frac <= 1:
            raise ValueError(
                f"need 0 < min_frac <= max_frac <= 1, got min_frac={self.min_frac!r}, "
                f"max_frac={self.max_frac!r}"
            )
        if not 0 <= self.min_gain <= 1:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain!r}")
        if not self.check_s >= 0:
            raise ValueError(f"check_s must be >= 0, got {self.check_s!r}")


class BorrowTrigger:
    """One round's trigger: fed every response finish, says once when to lend."""

    def __init__(self, rule: BorrowRule, responses_needed: int) -> None:
        if responses_needed < 1:
            raise ValueError(f"a round needs >= 1 response, got {responses_needed}")
        self.rule = rule
        self.needed = responses_needed
        self.fired_at_frac: float | None = None
        self._checked_at: float | None = None
        self._checked_frac = 0.0

    @property
    def fired(self) -> bool:
        return self.fired_at_frac is not None

    def observe(self, done: int, now: float) -> bool:
        """`done` responses of the round are finished at `now`: True exactly once, when
        the replicas should lend."""
        if self.fired:
            return False
        frac = min(1.0, done / self.needed)
        if self.rule.max_frac <= frac < 1.0:
            # The bound holds on any finish, not only at a check: a window longer than
            # the round (sub-second rounds on a CPU) must not let it pass.
            self.fired_at_frac = frac
            return True
        if self._checked_at is None:
            self._checked_at = now  # the window starts at the first finish
            return False
        if now - self._checked_at < self.rule.check_s:
            return False
        gain = frac - self._checked_frac
        self._checked_at, self._checked_frac = now, frac
        if frac >= 1.0:
            return False  # the round has all it needs: nothing left to hide
        if frac >= self.rule.min_frac and gain >= self.rule.min_gain:
            self.fired_at_frac = frac
            return True
        return False


def lenders(in_flight: Sequence[int]) -> tuple[int, ...]:
    """The replicas that stop generating: half of them (rounded down), those with the
    fewest requests in flight (the least to move), the highest index on a tie. Empty
    with fewer than two replicas: the last one never lends."""
    n = len(in_flight) // 2
    order = sorted(range(len(in_flight)), key=lambda i: (in_flight[i], -i))
    return tuple(sorted(order[:n]))


def place_moves(
    moving: Sequence[tuple[str, Hashable]],
    kept: Sequence[int],
    in_flight: Mapping[int, int],
    capacity: Mapping[int, int],
) -> dict[str, int]:
    """Where each moved request goes: `moving` is (request id, prompt key) in order; the
    requests of one prompt stay together (they share its KV through prefix caching),
    each prompt to the kept replica with the least load (in flight / capacity, counting
    what this call placed), the lowest index on a tie."""
    if not kept:
        raise ValueError("no replica is kept to take the moved requests")
    load = {i: in_flight.get(i, 0) for i in kept}
    groups: dict[Hashable, list[str]] = {}
    for rid, key in moving:
        groups.setdefault(key, []).append(rid)
    target: dict[str, int] = {}
    for rids in groups.values():
        i = min(kept, key=lambda j: (load[j] / capacity[j], j))
        load[i] += len(rids)
        for rid in rids:
            target[rid] = i
    return target
