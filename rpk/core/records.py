"""Records that flow through one RL step, the request state machine, and the small
vocabularies (finish reasons, round kinds) every stage shares.

This package imports nothing of rpk's: every other package may depend on it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from typing import Any


class FinishReason(enum.StrEnum):
    """Why a response stopped. A str enum, so records and JSON carry the plain word."""

    STOP = "stop"  # the model ended it (EOS or a stop string)
    LENGTH = "length"  # it hit its token budget
    ABORT = "abort"  # cut off by the scheduler (or a carried response not yet finished)


class RoundKind(enum.StrEnum):
    SYNC = "sync"  # every launched response runs to completion
    SHORT = "short"  # speculative: over-provisioned, stops at the groups it needs
    LONG = "long"  # the long-tail queue's prompts, full budget, no speculation


@dataclass(frozen=True, slots=True)
class Prompt:
    """One dataset row, already tokenised with the model's chat template."""

    uid: str  # stable identity across epochs and checkpoints (file:row)
    token_ids: tuple[int, ...]
    data_source: str
    ground_truth: Any  # veRL rows carry strings, numbers or structured test cases
    extra_info: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""  # the rendered prompt, for logs and reward functions that want it
    # veRL's `reward_model.style`: "model" sends the row to the judge (rpk.reward.judge).
    reward_style: str = "rule"
    # The row's last user message as written: the judge's question, where `text` would
    # bring the policy's chat markers along.
    last_user: str = ""


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One response to generate: rpk sends one request per response (n=1, own seed)
    so that any single response can be aborted while its siblings go on."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Stream tokens as they come (a round that keeps cut-off tokens, or aborts responses
    # that grow past a cap, must see them); otherwise the engine may send one output when
    # the request ends, so that finishes reach the loop in the engine's order.
    progress: bool = False
    # Requests with the same key go to the replica the key went to last, so that the
    # turns of one trajectory reuse its context through prefix caching ("" = none).
    affinity: str = ""
    ignore_eos: bool = False  # run to max_tokens (benchmarks, tests of aborts)
    prompt_uid: str = ""  # the `Prompt.uid` it answers (a multi-turn environment reads the row)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """Tool calls and their time, one environment step's or a trajectory's summed.
    Failures are errors, timeouts and oversized outputs, each of which became the
    observation."""

    calls: int = 0
    failures: int = 0
    seconds: float = 0.0
    # Blocking tools' seconds waiting for a free worker (`agent.tool_workers`) before
    # their calls started: not in `seconds`.
    queued_s: float = 0.0
    # Of `seconds`, those when no model turn was decoding anywhere on the engine (the
    # engine sets it): the part generation did not hide.
    exposed_s: float = 0.0

    def __add__(self, other: ToolUse) -> ToolUse:
        return ToolUse(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True, slots=True)
class TurnStats:
    """What a multi-turn trajectory did besides sampling: its model turns, its tools,
    and an environment's own reward when the environment gives one."""

    turns: int
    tools: ToolUse = ToolUse()
    env_reward: float | None = None


@dataclass(frozen=True, slots=True)
class GenDelta:
    """What an engine yields while a request runs: the tokens new since the last delta
    and the sampler's log-prob of each. The last delta has `finished=True`."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str = ""  # detokenised text of the new tokens
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Tokens the model did not sample: a tool's or an environment's observation, encoded
    # once by the chat template. They are in the context and out of the loss; their
    # logprobs are 0.0 placeholders.
    observation: bool = False
    turns: TurnStats | None = None  # on a trajectory's last delta
    # On the last delta, with speculative decoding: the drafted tokens the request
    # accepted, all of it (its tokens less these are the engine steps it took).
    accepted: int = 0


class RequestState(enum.Enum):
    PENDING = "pending"  # planned, not yet sent to the engine
    RUNNING = "running"
    FINISHED = "finished"  # stopped on EOS or on the length budget
    ABORTED = "aborted"  # cut off by the scheduler; its tokens are discarded
    FAILED = "failed"

    def can_become(self, new: RequestState) -> bool:
        return new in _REQUEST_TRANSITIONS[self]


_REQUEST_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.PENDING: frozenset({RequestState.RUNNING, RequestState.ABORTED}),
    RequestState.RUNNING: frozenset(
        {RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED}
    ),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
    RequestState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Response:
    """A finished response of one prompt, as sampled (policy `version` sampled it)."""

    prompt: Prompt
    index: int  # 0..R-1 within the prompt's group
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    version: int
    text: str = ""
    # The policy version of each token, for responses continued across rounds (partial
    # rollout); empty when every token came from `version`.
    token_versions: tuple[int, ...] = ()
    # 1 for each token the loss trains on, 0 for observation tokens; empty when every
    # token is the model's (a single-turn response).
    loss_mask: tuple[int, ...] = ()
    turns: TurnStats | None = None  # a multi-turn trajectory's turns and tool calls

    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.version,) * len(self.token_ids)

    def trained(self) -> int:
        """How many of its tokens the loss trains on."""
        return sum(self.loss_mask) if self.loss_mask else len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Carried:
    """One response slot of a prompt that a round left incomplete, kept for the next
    round by partial rollout: either finished (`finish_reason` set) or cut off mid-way,
    to be continued from its tokens."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    text: str = ""
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"carried response {self.index}: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )


@dataclass(frozen=True, slots=True)
class Scored:
    response: Response
    reward: float
    correct: bool  # the task's own verdict (reward can include shaping)
    error: str | None = None  # why scoring failed, when it did (reward is then 0)


@dataclass(frozen=True, slots=True)
class Group:
    """The R scored responses of one prompt, with their group-relative advantages."""

    prompt: Prompt
    members: tuple[Scored, ...]
    advantages: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class TrainSample:
    """What the trainer needs of one response: tokens, the sampler's log-probs (the
    behaviour policy of the PPO ratio) and the advantage."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    truncated: bool = False  # hit the length budget (DAPO's overlong filtering masks these)
    # Per response token, 1 where the loss trains (see `Response.loss_mask`); empty: all.
    loss_mask: tuple[int, ...] = ()

    def trained_positions(self) -> list[int]:
        """Indices of the response tokens the loss trains on."""
        if not self.loss_mask:
            return list(range(len(self.response_ids)))
        return [j for j, m in enumerate(self.loss_mask) if m]


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """What one rollout replica's scheduler saw since it was last asked (the loop asks
    once per round): the requests it preempted for want of KV cache (vLLM recomputes
    them later), the largest share of its KV cache in use, and the tokens it generated
    (aborted requests' included: under one-output-per-request streaming the loop never
    sees those)."""

    preemptions: int = 0
    kv_usage_max: float = 0.0
    tokens_generated: int = 0
