"""RollPacker's parallelism planner: the rollout TP size, chosen per round.

Short rounds launch many requests at once and run out of KV cache: vLLM preempts
requests and later recomputes them. A larger TP per replica holds more KV (the weights
are spread over more devices) and cuts the preemptions; rounds that do not preempt pay
TP's communication for nothing. The paper's rule, over per-round statistics:

- preemptions rising above `rise` (1.05) times the last round's double the TP (to the
  next layout built; the first round of a kind compares against none, so any
  preemption is a rise);
- `calm_rounds` (4) rounds in a row without a preemption halve it;
- bounded by the layouts built (the smallest and largest TP sizes).

The round kind is the hint: short rounds (many concurrent requests) and long rounds
(few) keep their own TP and history, so a long round does not undo what the short
rounds learned, and each kind's next round starts at its own TP. A kind's very first
round starts at the largest TP any kind has been pushed up to by preemptions (the
initial TP if none was): preempting costs far more than TP's communication (a
preempted request is recomputed), so the cautious first guess is the better one. A TP
that was halved and had to be doubled back on the very next round of its kind needs
twice as many calm rounds before it is halved again (hysteresis: no flapping every
`calm_rounds + 1` rounds between two layouts).

The paper profiles each TP's throughput offline; rpk measures it online instead: per
kind and TP, the tokens per second its rounds generated. A move the rule asks for is
not made when the kind already ran `slower` (5%) slower at the target TP than where it
is: some preemptions can cost less than the communication of a larger TP (GPUs without
NVLink, or CPUs), and fewer KV-cache tokens than needed can still be faster than more
devices. For the same reason a round without a rise, at a TP measured slower than the
next smaller one, halves the TP at once, without waiting out the calm rounds.

Plain synchronous code over explicit state: no await, no device. `TPPlanner.decide`
says which TP a round of a kind should run at; `observe` takes what the round saw and
returns the decision for that kind's next round, with its reason.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rpk.core.records import RoundKind


class PlannerMode(enum.StrEnum):
    FIXED = "fixed"  # every round at the initial TP
    ELASTIC = "elastic"  # the rule above, per round kind


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    mode: PlannerMode
    tp_sizes: tuple[int, ...]  # the layouts built, ascending
    initial: int  # every kind's TP before it is first observed
    rise: float = 1.05
    calm_rounds: int = 4
    slower: float = 0.05  # a TP measured this much slower for a kind is not moved to

    def __post_init__(self) -> None:
        if self.mode not in set(PlannerMode):
            raise ValueError(f"mode must be fixed or elastic, got {self.mode!r}")
        object.__setattr__(self, "mode", PlannerMode(self.mode))
        if not self.tp_sizes or list(self.tp_sizes) != sorted(set(self.tp_sizes)):
            raise ValueError(f"tp_sizes must be distinct and ascending, got {self.tp_sizes!r}")
        if self.initial not in self.tp_sizes:
            raise ValueError(f"initial tp {self.initial} is not a layout built {self.tp_sizes}")
        if not self.rise >= 1:
            raise ValueError(f"rise must be >= 1, got {self.rise!r}")
        if self.calm_rounds < 1:
            raise ValueError(f"calm_rounds must be >= 1, got {self.calm_rounds!r}")
        if not 0 <= self.slower < 1:
            raise ValueError(f"slower must be in [0, 1), got {self.slower!r}")


@dataclass(frozen=True, slots=True)
class RoundLoad:
    """What one round saw, summed over the replicas of the layout it ran on."""

    kind: RoundKind
    tp: int
    preemptions: int
    kv_usage_max: float = 0.0
    requests: int = 0
    seconds: float = 0.0  # the round's rollout time
    tokens: int = 0  # tokens the engine generated in it


@dataclass(frozen=True, slots=True)
class TPDecision:
    kind: RoundKind
    tp: int
    previous: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.tp != self.previous


@dataclass(slots=True)
class _KindState:
    tp: int
    last_preemptions: int | None = None  # the last round of this kind (None: none yet)
    calm: int = 0  # rounds in a row without a preemption
    calm_needed: int = 0  # 0: the config's calm_rounds
    halved_last: bool = False  # the last change of this kind was a halving
    # Measured tokens per second per TP (an average over rounds, newest weighing half).
    rate: dict[int, float] = field(default_factory=dict)


class TPPlanner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._kinds: dict[RoundKind, _KindState] = {}
        self._needed: int | None = None  # the largest TP preemptions pushed any kind to

    def decide(self, kind: RoundKind) -> int:
        """The TP a round of `kind` runs at."""
        return self._state(kind).tp

    def observe(self, load: RoundLoad) -> TPDecision:
        """Take one round's statistics; the TP of the next round of its kind, and why."""
        c = self.config
        s = self._state(load.kind)
        at = load.tp
        if at not in c.tp_sizes:
            raise ValueError(f"a round ran at tp {at}, not a layout built {c.tp_sizes}")
        last = s.last_preemptions or 0
        s.last_preemptions = load.preemptions
        s.tp = at
        if load.seconds > 0 and load.tokens > 0:
            rate = load.tokens / load.seconds
            s.rate[at] = rate if at not in s.rate else (s.rate[at] + rate) / 2
        seen = f"{load.kind.value} round at tp {at}: {load.preemptions} preemptions"
        if c.mode is PlannerMode.FIXED:
            return TPDecision(load.kind, at, at, f"{seen}; tp fixed")
        decision = self._rule(load, s, last, seen)
        if decision.tp > at:
            self._needed = max(self._needed or 0, decision.tp)
        return decision

    def _rule(self, load: RoundLoad, s: _KindState, last: int, seen: str) -> TPDecision:
        c = self.config
        at = load.tp
        needed = s.calm_needed or c.calm_rounds
        if load.preemptions > 0 and load.preemptions > c.rise * last:
            rose = f"{seen} > {c.rise:g} x {last} (the last round's)"
            bounced = s.halved_last
            s.calm = 0
            up = self._move_to(load, s, self._next(at, +1), "largest", rose, f"{rose}; but")
            if isinstance(up, TPDecision):
                return up
            s.tp, s.halved_last = up, False
            if bounced:  # halved, then pushed straight back up: wait longer next time
                s.calm_needed = 2 * needed
                return TPDecision(load.kind, up, at,
                                  f"{rose}; tp {at} -> {up}, next halving after {2 * needed} calm rounds")
            return TPDecision(load.kind, up, at, f"{rose}; tp {at} -> {up}")
        down = self._next(at, -1)
        if down is not None and (slow := self._slower(s, at, down)):
            # No rise, and the smaller TP was faster, preemptions and all: go back now.
            s.calm, s.tp, s.halved_last = 0, down, True
            return TPDecision(load.kind, down, at, f"{seen}; {slow} than tp {down}: tp {at} -> {down}")
        if load.preemptions > 0:
            s.calm, s.halved_last = 0, False
            return TPDecision(load.kind, at, at, f"{seen}, not above {c.rise:g} x {last}; stays")
        s.calm += 1
        if s.calm < needed:
            s.halved_last = False
            return TPDecision(load.kind, at, at, f"{seen}; {s.calm} of {needed} calm rounds")
        s.calm = 0
        to = self._move_to(load, s, down, "smallest", seen, f"{seen}; {needed} calm rounds, but")
        if isinstance(to, TPDecision):
            return to
        s.tp, s.halved_last = to, True
        return TPDecision(load.kind, to, at, f"{seen}; {needed} calm rounds: tp {at} -> {to}")

    def _move_to(
        self, load: RoundLoad, s: _KindState, to: int | None, edge: str, why: str, but: str
    ) -> int | TPDecision:
        """`to`, where the rule moves the kind; or the decision to stay where no layout lies
        that way (`to` None: `load.tp` is the `edge` one) or `to` measured slower (`why`,
        `but`: the words of each reason)."""
        at = load.tp
        if to is None:
            return TPDecision(load.kind, at, at, f"{why}; tp {at} is the {edge} layout")
        if slow := self._slower(s, to, at):
            s.halved_last = False
            return TPDecision(load.kind, at, at, f"{but} {slow}: stays")
        return to

    def _slower(self, s: _KindState, target: int, at: int) -> str:
        """Why `target` is no move for this kind (it measured slower than `at`), or ''."""
        there, here = s.rate.get(target), s.rate.get(at)
        if there is None or here is None or there >= (1 - self.config.slower) * here:
            return ""
        return f"tp {target} ran these rounds {1 - there / here:.0%} slower ({there:.0f} vs {here:.0f} tokens/s)"

    def _state(self, kind: RoundKind) -> _KindState:
        if kind not in self._kinds:
            first = self._needed if self._needed is not None else self.config.initial
            self._kinds[kind] = _KindState(first)
        return self._kinds[kind]

    def _next(self, tp: int, direction: int) -> int | None:
        sizes = self.config.tp_sizes
        i = sizes.index(tp) + direction
        return sizes[i] if 0 <= i < len(sizes) else None

    def metrics(self) -> dict[str, float]:
        return {f"tp_planned_{k.value}": float(s.tp) for k, s in sorted(self._kinds.items())}

    def state_dict(self) -> dict[str, Any]:
        return {"kinds": {k.value: asdict(s) for k, s in self._kinds.items()}, "needed": self._needed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sizes = self.config.tp_sizes
        kinds = {}
        for k, v in state.get("kinds", {}).items():
            # JSON made the TP keys strings; rates of layouts not built now are dropped.
            rate = {int(tp): r for tp, r in v.get("rate", {}).items() if int(tp) in sizes}
            kinds[RoundKind(k)] = s = _KindState(**{**v, "rate": rate})
            if s.tp not in sizes:
                # A run resumed with other layouts: the nearest one built below.
                s.tp = self._nearest(s.tp)
        self._kinds = kinds
        needed = state.get("needed")
        self._needed = None if needed is None else self._nearest(needed)

    def _nearest(self, tp: int) -> int:
        sizes = self.config.tp_sizes
        return max((t for t in sizes if t <= tp), default=sizes[0])

