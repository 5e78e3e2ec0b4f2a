"""Round scheduling policies: which prompts a step launches, how many responses each,
and what happens to prompts a round did not finish.

Plain synchronous code over explicit state (the dataset cursor and counters): no I/O,
no awaits, so a policy is unit-tested on its own and its state goes into checkpoints.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rpk.data import PromptCursor
from rpk.loop.records import Prompt
from rpk.loop.rollout import RoundResult
from rpk.loop.round import RoundKind, RoundPlan


class SyncPolicy:
    """veRL's synchronous step: P0 prompts x R0 responses, every response runs to the
    end of its length budget, so the step waits for its longest response."""

    name = "sync"

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        prompts_per_step: int,
        responses_per_prompt: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        self.prompts = prompts
        self.cursor = PromptCursor(len(prompts), seed, shuffle)
        self.p0 = prompts_per_step
        self.r0 = responses_per_prompt
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed

    def plan(self, step: int) -> RoundPlan:
        chosen = tuple(self.prompts[i] for i in self.cursor.take(self.p0))
        return RoundPlan(
            step=step,
            kind=RoundKind.SYNC,
            prompts=chosen,
            responses_per_prompt=self.r0,
            group_size=self.r0,
            groups_needed=len(chosen),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )

    def commit(self, result: RoundResult) -> None:
        if len(result.groups) != len(result.plan.prompts):
            raise RuntimeError(
                f"sync round of step {result.plan.step} trained {len(result.groups)} of "
                f"{len(result.plan.prompts)} prompts"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.name, "cursor": self.cursor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("policy") != self.name:
            raise ValueError(
                f"checkpoint was made with policy {state.get('policy')!r}, not {self.name!r}"
            )
        self.cursor.load_state_dict(state["cursor"])
