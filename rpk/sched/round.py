"""The bookkeeping of one rollout round, as plain synchronous state.

`RoundBook` knows every request of the round and its state, which finished responses
are accepted (the first R to finish per prompt), which groups are complete (all R
accepted responses scored), and when the round is done (the plan's number of groups is
complete). The async driver reports events to it and does what it answers; the book
never awaits and never touches an engine, so the policy is testable on its own.

Every event costs O(1) bookkeeping (plus the ids it hands back): live requests are
indexed globally and per prompt, and states are counted, because a 128-GPU round holds
tens of thousands of requests and a scan per event would be quadratic in them.

A plan may set `defer_after`: a response that grows past that many tokens cannot be
accepted in this round. The book then hands back its request at once, and every other
request of its prompt as soon as the prompt can no longer complete, instead of letting
them run to the round's end. The limit holds only for prompts the round can spare
(enough others can still complete): the first prompt to cross it that the round needs
is exempt from it, and its responses run on. Prompts that cross in the same step are
decided in launch order, so a plan puts the prompts it would rather give up first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rpk.core.records import (
    Carried,
    FinishReason,
    GenRequest,
    Group,
    IllegalTransition,
    Prompt,
    RequestState,
    Response,
    RoundKind,
    Scored,
)

_LIVE = (RequestState.PENDING, RequestState.RUNNING)


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
    # Partial rollout: per prompt, the responses an earlier round left (finished ones are
    # taken as they are, cut-off ones continue from their tokens); () when none.
    carried: tuple[tuple[Carried, ...], ...] = ()
    keep_partial: bool = False  # keep the tokens of cut-off requests for the next round
    drop_zero_variance: bool = False  # DAPO dynamic sampling: equal-reward groups don't count
    # Per prompt, the responses launched when they differ (speculation where a length
    # prediction is unsure); () launches responses_per_prompt for every prompt.
    launch: tuple[int, ...] = ()
    # A response that generates more tokens than this in the round is not accepted in
    # it (0: no such limit).
    defer_after: int = 0

    def __post_init__(self) -> None:
        if self.responses_per_prompt < self.group_size:
            raise ValueError(
                f"responses_per_prompt ({self.responses_per_prompt}) < group_size "
                f"({self.group_size})"
            )
        if self.launch and (
            len(self.launch) != len(self.prompts)
            or not all(self.group_size <= n <= self.responses_per_prompt for n in self.launch)
        ):
            raise ValueError(
                f"launch must give each of the {len(self.prompts)} prompts "
                f"{self.group_size}..{self.responses_per_prompt} responses, got {self.launch}"
            )
        if self.defer_after < 0:
            raise ValueError(f"defer_after must be >= 0, got {self.defer_after}")
        if not 0 < self.groups_needed <= len(self.prompts):
            raise ValueError(
                f"groups_needed ({self.groups_needed}) must be in 1..{len(self.prompts)}"
            )
        if self.carried and len(self.carried) != len(self.prompts):
            raise ValueError(
                f"carried has {len(self.carried)} entries for {len(self.prompts)} prompts"
            )
        for pos, slots in enumerate(self.carried):
            for c in slots:
                if not 0 <= c.index < self.responses_per_prompt:
                    raise ValueError(f"prompt {pos}: carried response index {c.index} out of range")
                if c.finish_reason is None and len(c.token_ids) >= self.max_tokens:
                    raise ValueError(
                        f"prompt {pos}: carried response {c.index} has {len(c.token_ids)} "
                        f"tokens, no room left under max_tokens {self.max_tokens}"
                    )

    def launched(self, pos: int) -> int:
        """Responses launched for prompt `pos`."""
        return self.launch[pos] if self.launch else self.responses_per_prompt


@dataclass(slots=True)
class RequestRecord:
    request: GenRequest
    prompt_pos: int  # index into plan.prompts
    index: int  # response index within the prompt
    prefix: Carried | None = None  # the tokens this request continues (partial rollout)
    state: RequestState = RequestState.PENDING
    tokens: int = 0  # generated by this request (the prefix not included)
    over: bool = False  # grew past the plan's defer_after: no longer acceptable

    def check_move(self, new: RequestState) -> None:
        if not self.state.can_become(new):
            raise IllegalTransition(
                f"request {self.request.request_id}: {self.state.value} -> {new.value}"
            )


@dataclass(slots=True)
class _PromptSlot:
    accepted: list[Response] = field(default_factory=list)
    scored: list[Scored] = field(default_factory=list)
    complete: bool = False  # a group, trained
    dropped: bool = False  # a group with equal rewards, left out (dynamic sampling)
    cut: dict[int, Carried] = field(default_factory=dict)  # partial tokens of aborted requests
    live: dict[str, None] = field(default_factory=dict)  # pending or running, in launch order
    over_live: int = 0  # live requests past defer_after (aborted, not yet reported so)
    given_up: bool = False  # can no longer complete in this round (defer_after)
    exempt: bool = False  # the round needs it: its responses may run past defer_after
    finished_lengths: list[int] = field(default_factory=list)  # in finishing order
    cut_lengths: list[int] = field(default_factory=list)  # tokens of requests cut mid-way

    def hope(self) -> int:
        """Responses it has or may still get: accepted plus live, not past defer_after."""
        return len(self.accepted) + len(self.live) - self.over_live


@dataclass(frozen=True, slots=True)
class PromptLengths:
    """What one round saw of a prompt's response lengths: what a length predictor learns
    from. Cut lengths are lower bounds (the response was aborted mid-way)."""

    prompt: Prompt
    finished: tuple[int, ...]  # finished responses, in finishing order
    cut: tuple[int, ...]  # responses aborted while running: tokens they had reached
    trained: bool  # its group was completed this round


def carried_response(prompt: Prompt, c: Carried) -> Response:
    return Response(
        prompt=prompt,
        index=c.index,
        token_ids=c.token_ids,
        logprobs=c.logprobs,
        finish_reason=c.finish_reason or FinishReason.ABORT,
        version=c.versions[-1] if c.versions else 0,
        text=c.text,
        token_versions=c.versions,
    )


class RoundBook:
    """Per-round state. Times are whatever clock the driver passes in (real or virtual)."""

    def __init__(self, plan: RoundPlan, advantages: Callable[[Sequence[float]], list[float]]):
        self.plan = plan
        self._advantages = advantages
        self.requests: dict[str, RequestRecord] = {}
        self._live: dict[str, None] = {}  # pending or running, in launch order
        self._states: Counter[RequestState] = Counter()
        self._slots = [_PromptSlot() for _ in plan.prompts]
        self.groups: list[Group] = []
        self.dropped: list[Prompt] = []
        # Finished responses carried in from an earlier round: accepted, still to score.
        self.carried_finished: list[tuple[int, Response]] = []
        self._full = 0  # prompts with group_size accepted responses
        self._viable = len(plan.prompts)  # prompts not given up (defer_after)
        self.in_flight = 0
        self.timeline: list[tuple[float, int]] = []  # (time, requests in flight after it)
        self.finishes: list[tuple[float, int]] = []  # (time, tokens) of each finished request
        self.tokens_generated = 0
        self.tokens_aborted = 0
        self.tokens_carried = 0  # aborted tokens kept for the next round (not wasted)
        carried = plan.carried or ((),) * len(plan.prompts)
        for pos, prompt in enumerate(plan.prompts):
            by_index = {c.index: c for c in carried[pos]}
            for j in range(plan.launched(pos)):
                c = by_index.get(j)
                if c is not None and c.finish_reason is not None:
                    response = carried_response(prompt, c)
                    self._accept(pos, response)
                    self.carried_finished.append((pos, response))
                    continue
                rid = f"s{plan.step}-p{pos}-r{j}"
                prefix = c.token_ids if c else ()
                req = GenRequest(
                    request_id=rid,
                    prompt_token_ids=prompt.token_ids + prefix,
                    max_tokens=plan.max_tokens - len(prefix),
                    temperature=plan.temperature,
                    top_p=plan.top_p,
                    seed=(plan.seed * 1_000_003 + plan.step) * 65_537 + pos * 257 + j,
                    progress=plan.keep_partial or plan.defer_after > 0,
                )
                self.requests[rid] = RequestRecord(req, pos, j, prefix=c)
                self._live[rid] = None
                self._slots[pos].live[rid] = None
                self._states[RequestState.PENDING] += 1

    @property
    def done(self) -> bool:
        return len(self.groups) >= self.plan.groups_needed

    @property
    def generation_complete(self) -> bool:
        """Enough prompts have all their responses: the rest of the generation is waste.
        Not under dynamic sampling, where a complete group may still be dropped."""
        return not self.plan.drop_zero_variance and self._full >= self.plan.groups_needed

    def _move(self, rec: RequestRecord, new: RequestState) -> None:
        rec.check_move(new)
        self._states[rec.state] -= 1
        self._states[new] += 1
        rec.state = new
        if new not in _LIVE:
            rid = rec.request.request_id
            del self._live[rid]
            slot = self._slots[rec.prompt_pos]
            del slot.live[rid]
            if rec.over:
                slot.over_live -= 1

    def _set_in_flight(self, now: float, delta: int) -> None:
        self.in_flight += delta
        self.timeline.append((now, self.in_flight))

    def _accept(self, pos: int, response: Response) -> None:
        slot = self._slots[pos]
        slot.accepted.append(response)
        if len(slot.accepted) == self.plan.group_size:
            self._full += 1

    def started(self, rid: str, now: float) -> None:
        self._move(self.requests[rid], RequestState.RUNNING)
        self._set_in_flight(now, +1)

    def progressed(self, rid: str, new_tokens: int) -> list[str]:
        """Tokens arrived. Returns the request ids to abort now (usually none): past the
        plan's defer_after a response cannot be accepted, so its request goes, and with
        it the prompt's others once the prompt can no longer complete."""
        rec = self.requests[rid]
        rec.tokens += new_tokens
        self.tokens_generated += new_tokens
        limit = self.plan.defer_after
        if not limit or rec.over or rec.tokens <= limit or rec.state not in _LIVE:
            return []
        slot = self._slots[rec.prompt_pos]
        if slot.exempt or slot.given_up or len(slot.accepted) >= self.plan.group_size:
            return []
        if self._viable - 1 < self.plan.groups_needed:
            slot.exempt = True  # the round cannot complete without it: no limit for it
            return []
        if slot.hope() - 1 >= self.plan.group_size:
            self._mark_over(slot, rec)
            return [rid]
        slot.given_up = True
        self._viable -= 1
        for other in slot.live:
            self._mark_over(slot, self.requests[other])
        return list(slot.live)

    @staticmethod
    def _mark_over(slot: _PromptSlot, rec: RequestRecord) -> None:
        if not rec.over:
            rec.over = True
            slot.over_live += 1

    def finished(self, rid: str, response: Response, now: float) -> tuple[bool, list[str]]:
        """A response finished. Returns (accepted for scoring, request ids to abort now):
        once a prompt has its R accepted responses its other requests are waste, and
        once P prompts have theirs, so is everything still running."""
        rec = self.requests[rid]
        over = rec.over
        self._move(rec, RequestState.FINISHED)
        self._set_in_flight(now, -1)
        slot = self._slots[rec.prompt_pos]
        slot.finished_lengths.append(len(response.token_ids))
        self.finishes.append((now, rec.tokens))
        if (
            over or self.done or slot.complete or slot.dropped
            or len(slot.accepted) >= self.plan.group_size
        ):
            return False, []
        if self.generation_complete:
            # Too late for this round; partial rollout still keeps it for the next one.
            if self.plan.keep_partial:
                self._accept(rec.prompt_pos, response)
            return False, []
        self._accept(rec.prompt_pos, response)
        if self.generation_complete:
            return True, self.unfinished()
        if len(slot.accepted) < self.plan.group_size:
            return True, []
        return True, self.running_of_prompt(rec.prompt_pos)

    def running_of_prompt(self, pos: int) -> list[str]:
        """The prompt's requests still pending or running."""
        return list(self._slots[pos].live)

    def scored(self, pos: int, scored: Scored) -> Group | None:
        """A response of prompt `pos` was scored; returns the group if that completed it."""
        slot = self._slots[pos]
        if self.done or slot.complete or slot.dropped:
            return None
        slot.scored.append(scored)
        if len(slot.scored) < self.plan.group_size:
            return None
        members = tuple(sorted(slot.scored, key=lambda s: s.response.index))
        if self.plan.drop_zero_variance and len({m.reward for m in members}) == 1:
            slot.dropped = True
            self.dropped.append(self.plan.prompts[pos])
            return None
        slot.complete = True
        group = Group(
            prompt=self.plan.prompts[pos],
            members=members,
            advantages=tuple(self._advantages([m.reward for m in members])),
        )
        self.groups.append(group)
        return group

    def aborted(self, rid: str, now: float, cut: Carried | None = None) -> None:
        """A request was cut off; `cut` holds its tokens so far (prefix included), kept
        for the next round when the plan keeps partial responses."""
        rec = self.requests[rid]
        was_running = rec.state is RequestState.RUNNING
        self._move(rec, RequestState.ABORTED)
        self.tokens_aborted += rec.tokens
        if was_running:
            self._set_in_flight(now, -1)
            prefix = len(rec.prefix.token_ids) if rec.prefix else 0
            self._slots[rec.prompt_pos].cut_lengths.append(prefix + rec.tokens)
        kept = cut if cut is not None else rec.prefix
        if self.plan.keep_partial and kept is not None and kept.token_ids:
            self._slots[rec.prompt_pos].cut[rec.index] = kept
            self.tokens_carried += rec.tokens

    def failed(self, rid: str, now: float) -> None:
        self._move(self.requests[rid], RequestState.FAILED)
        self._set_in_flight(now, -1)

    def unfinished(self) -> list[str]:
        """Requests still pending or running: what the driver aborts when the round ends."""
        return list(self._live)

    @property
    def any_unfinished(self) -> bool:
        return bool(self._live)

    def _incomplete(self) -> list[tuple[Prompt, _PromptSlot]]:
        return [
            (p, slot)
            for p, slot in zip(self.plan.prompts, self._slots)
            if not (slot.complete or slot.dropped)
        ]

    def incomplete_prompts(self) -> list[Prompt]:
        """Prompts launched but neither in a group nor dropped: deferred (tail batching),
        carried (partial rollout) or lost (oversampling)."""
        return [p for p, _ in self._incomplete()]

    def carry_over(self) -> tuple[tuple[Carried, ...], ...]:
        """For each incomplete prompt, what partial rollout takes into the next round:
        its finished responses and the cut-off ones' tokens, by response index."""
        out = []
        for _, slot in self._incomplete():
            kept = {
                r.index: Carried(r.index, r.token_ids, r.logprobs, r.versions(), r.text, r.finish_reason)
                for r in slot.accepted[: self.plan.group_size]
            }
            for index, c in slot.cut.items():
                kept.setdefault(index, c)
            out.append(tuple(kept[i] for i in sorted(kept)))
        return tuple(out)

    def count(self, state: RequestState) -> int:
        return self._states[state]

    def prompt_lengths(self) -> tuple[PromptLengths, ...]:
        """Per prompt, the lengths its responses reached this round (once, at its end)."""
        return tuple(
            PromptLengths(p, tuple(slot.finished_lengths), tuple(slot.cut_lengths), slot.complete)
            for p, slot in zip(self.plan.prompts, self._slots)
        )


@dataclass(frozen=True, slots=True)
class RoundResult:
    plan: RoundPlan
    groups: tuple[Group, ...]
    timeline: tuple[tuple[float, int], ...]  # (time, requests in flight)
    launched: int
    finished: int
    aborted: int
    tokens_generated: int  # every token the engine produced, wasted ones included
    tokens_aborted: int  # tokens of aborted requests: the price of speculation
    started_at: float
    ended_at: float
    last_response_at: float  # when the last accepted response finished generating
    reward_busy_s: float  # summed duration of score calls
    reward_exposed_s: float  # scoring still running after generation ended
    incomplete: tuple[Prompt, ...] = ()  # prompts neither trained nor dropped
    carry: tuple[tuple[Carried, ...], ...] = ()  # per incomplete prompt (partial rollout)
    dropped: tuple[Prompt, ...] = ()  # equal-reward groups left out (dynamic sampling)
    tokens_carried: int = 0  # aborted tokens kept for the next round, not wasted
    version: int = 0  # the policy version that sampled this round
    finishes: tuple[tuple[float, int], ...] = ()  # (time, tokens) of each finished request
    lengths: tuple[PromptLengths, ...] = ()  # per prompt of the plan

    @property
    def tokens_off_policy(self) -> int:
        """Trained tokens sampled by an older policy than this round's (partial rollout)."""
        return sum(
            sum(1 for v in m.response.versions() if v < self.version)
            for g in self.groups
            for m in g.members
        )

    @property
    def tokens_wasted(self) -> int:
        return self.tokens_aborted - self.tokens_carried
