"""What a round is asked to do and what it, a step and a validation pass produce: plain
records, made by the drivers in `rpk.loop` and the policies in `rpk.sched`, read by
`rpk.obs` and the controller.

Imports nothing of rpk's outside `rpk.core`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rpk.core.drafts import PromptDrafts
from rpk.core.records import Carried, Group, Prompt, RoundKind, Scored


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
    # Speculative decoding: per prompt, the draft texts the policy holds for it (aborted
    # partial responses, earlier epochs; `rpk.sched.drafts`); () when none.
    drafts: tuple[PromptDrafts, ...] = ()

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
        if self.drafts and len(self.drafts) != len(self.prompts):
            raise ValueError(f"drafts has {len(self.drafts)} entries for {len(self.prompts)} prompts")
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


@dataclass(frozen=True, slots=True)
class PromptLengths:
    """What one round saw of a prompt's response lengths: what a length predictor learns
    from. Cut lengths are lower bounds (the response was aborted mid-way)."""

    prompt: Prompt
    finished: tuple[int, ...]  # finished responses, in finishing order
    cut: tuple[int, ...]  # responses aborted while running: tokens they had reached
    trained: bool  # its group was completed this round
    # Trajectories: each finished one's seconds in tool calls, in finishing order (a
    # single-turn response has none).
    tool_s: tuple[float, ...] = ()
    tool_calls: tuple[int, ...] = ()  # ... and its tool calls, in the same order


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
    # (time, decode steps) of each finished request: its tokens, less the drafted ones
    # it accepted under speculative decoding (a verify step gains several)
    finishes: tuple[tuple[float, int], ...] = ()
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


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step: int
    round: RoundResult
    train: Mapping[str, float]
    time_rollout_s: float
    time_train_s: float
    time_sync_s: float
    time_step_s: float
    version: int  # the policy version after this step's update
    capacity: int  # the engine's concurrency during the round (its layout's, if elastic)
    time_train_busy_s: float = 0.0  # trainer busy, streamed part included
    time_train_hidden_s: float = 0.0  # trainer busy while the round still generated
    sync_bytes: int = 0  # weights sent to the engine after the update
    sync_buckets: int = 0
    time_regroup_s: float = 0.0  # `before_round`: the engine regrouped for this round
    # (a regroup `after_round` makes for the next round is in time_sync_s: it replaces
    # the weight sync)
    # borrow mode: the trigger's fraction of responses done (None: it did not fire),
    # and the migration `Fleet.lend` reported
    borrow_frac: float | None = None
    migration: MigrationReport | None = None


@dataclass(frozen=True, slots=True)
class PromptEval:
    """One validation prompt's scored responses."""

    prompt: Prompt
    greedy: Scored
    sampled: tuple[Scored, ...]


@dataclass(frozen=True, slots=True)
class EvalRun:
    step: int  # the steps trained before it (0: the starting model)
    version: int  # the weights the engine served
    k: int
    results: tuple[PromptEval, ...]
    started_at: float
    ended_at: float


@dataclass(frozen=True, slots=True)
class RegroupReport:
    """What a fleet's regroup to another TP did (`rpk.core.protocols.Regrouping`)."""

    from_tp: int
    to_tp: int
    seconds: float = 0.0
    synced: int = 0  # replicas whose weights were brought to the fleet's version
    restarted: bool = False  # the target layout was started anew (restart-on-switch)


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What lending replicas to the trainer moved (`rpk.core.protocols.Lending`)."""

    lent: tuple[int, ...]  # replica indices put to sleep for the trainer
    requests: int = 0  # requests moved, running or waiting
    tokens: int = 0  # generated tokens they carried (recomputed as prompt on arrival)
    seconds: float = 0.0  # from the first abort to the lent replicas asleep
    move_s: float = 0.0  # ... to every moved request started on its new replica
