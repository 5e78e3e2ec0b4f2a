"""The bookkeeping of one rollout round, as plain synchronous state.

`RoundBook` knows every request of the round and its state, which finished responses
are accepted (the first R to finish per prompt), which groups are complete (all R
accepted responses scored), and when the round is done (the plan's number of groups is
complete). The async driver reports events to it and does what it answers; the book
never awaits and never touches an engine, so the policy is testable on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rpk.loop.records import (
    GenRequest,
    Group,
    IllegalTransition,
    Prompt,
    RequestState,
    Response,
    Scored,
)


class RoundKind(enum.Enum):
    SYNC = "sync"  # every launched response runs to completion
    SHORT = "short"  # speculative: over-provisioned, stops at the groups it needs
    LONG = "long"  # the long-tail queue's prompts, full budget, no speculation


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """What the policy asks one round to do."""

    step: int
    kind: RoundKind
    prompts: tuple[Prompt, ...]
    responses_per_prompt: int  # launched per prompt (>= the group size under speculation)
    group_size: int  # R0: accepted responses that make a group
    groups_needed: int  # P0: the round ends when this many groups are complete
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.responses_per_prompt < self.group_size:
            raise ValueError(
                f"responses_per_prompt ({self.responses_per_prompt}) < group_size "
                f"({self.group_size})"
            )
        if not 0 < self.groups_needed <= len(self.prompts):
            raise ValueError(
                f"groups_needed ({self.groups_needed}) must be in 1..{len(self.prompts)}"
            )


@dataclass(slots=True)
class RequestRecord:
    request: GenRequest
    prompt_pos: int  # index into plan.prompts
    index: int  # response index within the prompt
    state: RequestState = RequestState.PENDING
    tokens: int = 0

    def move(self, new: RequestState) -> None:
        if not self.state.can_become(new):
            raise IllegalTransition(
                f"request {self.request.request_id}: {self.state.value} -> {new.value}"
            )
        self.state = new


@dataclass(slots=True)
class _PromptSlot:
    accepted: list[Response] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    complete: bool = False


class RoundBook:
    """Per-round state. Times are whatever clock the driver passes in (real or virtual)."""

    def __init__(self, plan: RoundPlan, advantages: Callable[[Sequence[float]], list[float]]):
        self.plan = plan
        self._advantages = advantages
        self.requests: dict[str, RequestRecord] = {}
        self._slots = [_PromptSlot() for _ in plan.prompts]
        self.groups: list[Group] = []
        self.in_flight = 0
        self.timeline: list[tuple[float, int]] = []  # (time, requests in flight after it)
        self.tokens_generated = 0
        self.tokens_aborted = 0
        for pos, prompt in enumerate(plan.prompts):
            for j in range(plan.responses_per_prompt):
                rid = f"s{plan.step}-p{pos}-r{j}"
                req = GenRequest(
                    request_id=rid,
                    prompt_token_ids=prompt.token_ids,
                    max_tokens=plan.max_tokens,
                    temperature=plan.temperature,
                    top_p=plan.top_p,
                    seed=(plan.seed * 1_000_003 + plan.step) * 65_537 + pos * 257 + j,
                )
                self.requests[rid] = RequestRecord(req, pos, j)

    @property
    def done(self) -> bool:
        return len(self.groups) >= self.plan.groups_needed

    def _set_in_flight(self, now: float, delta: int) -> None:
        self.in_flight += delta
        self.timeline.append((now, self.in_flight))

    def started(self, rid: str, now: float) -> None:
        self.requests[rid].move(RequestState.RUNNING)
        self._set_in_flight(now, +1)

    def progressed(self, rid: str, new_tokens: int) -> None:
        self.requests[rid].tokens += new_tokens
        self.tokens_generated += new_tokens

    def finished(self, rid: str, response: Response, now: float) -> tuple[bool, list[str]]:
        """A response finished. Returns (accepted, request ids to abort now): once a
        prompt has its R accepted responses, its other requests are waste."""
        rec = self.requests[rid]
        rec.move(RequestState.FINISHED)
        self._set_in_flight(now, -1)
        slot = self._slots[rec.prompt_pos]
        if self.done or len(slot.accepted) >= self.plan.group_size:
            return False, []
        slot.accepted.append(response)
        if len(slot.accepted) < self.plan.group_size:
            return True, []
        return True, self.running_of_prompt(rec.prompt_pos)

    def running_of_prompt(self, pos: int) -> list[str]:
        return [
            rid
            for rid, r in self.requests.items()
            if r.prompt_pos == pos and r.state in (RequestState.PENDING, RequestState.RUNNING)
        ]

    def scored(self, rid: str, scored: Scored) -> Group | None:
        """A response's score came in; returns the group if that completed it."""
        slot = self._slots[self.requests[rid].prompt_pos]
        if self.done or slot.complete:
            return None
        slot.scored.append(scored)
        if len(slot.scored) < self.plan.group_size:
            return None
        slot.complete = True
        members = tuple(sorted(slot.scored, key=lambda s: s.response.index))
        group = Group(
            prompt=self.plan.prompts[self.requests[rid].prompt_pos],
            members=members,
            advantages=tuple(self._advantages([m.reward for m in members])),
        )
        self.groups.append(group)
        return group

    def aborted(self, rid: str, now: float) -> None:
        rec = self.requests[rid]
        was_running = rec.state is RequestState.RUNNING
        rec.move(RequestState.ABORTED)
        self.tokens_aborted += rec.tokens
        if was_running:
            self._set_in_flight(now, -1)

    def failed(self, rid: str, now: float) -> None:
        self.requests[rid].move(RequestState.FAILED)
        self._set_in_flight(now, -1)

    def unfinished(self) -> list[str]:
        """Requests still pending or running: what the driver aborts when the round ends."""
        return [
            rid
            for rid, r in self.requests.items()
            if r.state in (RequestState.PENDING, RequestState.RUNNING)
        ]

    def incomplete_prompts(self) -> list[Prompt]:
        """Prompts launched but not in a complete group (deferred by tail batching)."""
        return [p for p, slot in zip(self.plan.prompts, self._slots) if not slot.complete]

    def count(self, state: RequestState) -> int:
        return sum(1 for r in self.requests.values() if r.state is state)
