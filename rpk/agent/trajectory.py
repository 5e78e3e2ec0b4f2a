"""One trajectory's state, pure: no await, no engine, no environment.

A trajectory answers one `GenRequest` (one response slot of a GRPO group) with model
turns and observations in turn. Its context is always the request's prompt ids plus
every response id so far, exactly as sampled or encoded; the response ids carry a
log-prob and a loss-mask bit each (1 = the model sampled it, 0 = an observation with a
0.0 placeholder log-prob). The driver (`rpk.agent.engine`) feeds it what the engine and
the environment said and asks it for the next turn's request; every decision (another
turn, or stop: STOP on a final answer, the environment's done or `max_turns`; LENGTH
when the token budget is spent) is made here and tested alone.

Phases: GENERATING (a model turn is wanted or running) -> ACTING (the turn ended, the
environment answers) -> GENERATING ... -> FINISHED. A call out of phase raises.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rpk.core.records import FinishReason, GenRequest, IllegalTransition, TurnStats

if TYPE_CHECKING:
    from rpk.agent.env import EnvStep

class TrajectoryPhase(enum.Enum):
    GENERATING = "generating"
    ACTING = "acting"
    FINISHED = "finished"


class Trajectory:
    """The state of one trajectory answering `request`, at most `max_turns` model turns
    and `request.max_tokens` response tokens (model and observation tokens alike: both
    take context length, and the budget is what keeps the context inside the model's)."""

    def __init__(self, request: GenRequest, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.request = request
        self.max_turns = max_turns
        self.phase = TrajectoryPhase.GENERATING
        self.turns = 0  # model turns requested so far
        self.turn_open = False  # a turn's request was issued and has not ended
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.turn_text: list[str] = []
        self.reason: FinishReason | None = None
        self.acts = TurnStats(0)  # the environment's answers so far (turns counted above)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def budget_left(self) -> int:
        return self.request.max_tokens - len(self.response_ids)

    @property
    def finished(self) -> bool:
        return self.phase is TrajectoryPhase.FINISHED

    @property
    def last_id(self) -> int | None:
        return self.response_ids[-1] if self.response_ids else None

    def context(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids + tuple(self.response_ids)

    def _expect(self, phase: TrajectoryPhase, what: str) -> None:
        if self.phase is not phase:
            raise IllegalTransition(
                f"trajectory {self.request_id}: {what} while {self.phase.value} (turn {self.turns})"
            )

    def next_request(self) -> GenRequest:
        """The next model turn: the whole context as its prompt, the budget left as its
        length, the trajectory's seed moved on per turn (so turns do not replay one
        random stream), and the trajectory's id as its affinity (a fleet keeps the turns
        on the replica that holds the context in its prefix cache)."""
        self._expect(TrajectoryPhase.GENERATING, "a new turn")
        if self.turn_open:
            raise IllegalTransition(f"trajectory {self.request_id}: turn {self.turns} still runs")
        self.turns += 1
        self.turn_open = True
        self.turn_text = []
        r = self.request
        return dataclasses.replace(
            r,
            request_id=f"{r.request_id}-t{self.turns}",
            prompt_token_ids=self.context(),
            max_tokens=self.budget_left,
            seed=self._seed(),
            affinity=r.affinity or r.request_id,
        )

    def _seed(self) -> int | None:
        # The first turn keeps the request's seed (a one-turn trajectory samples as a
        # plain request would); later ones mix the turn in rather than adding it, which
        # would replay a sibling's seed (the round numbers siblings' seeds consecutively).
        seed = self.request.seed
        if seed is None or self.turns == 1:
            return seed
        return (seed * 1_000_003 + self.turns) % 2**63

    def sampled(self, token_ids: Sequence[int], logprobs: Sequence[float], text: str = "") -> None:
        """Tokens the model sampled in the running turn (in the loss)."""
        self._expect(TrajectoryPhase.GENERATING, "sampled tokens")
        if not self.turn_open:
            raise IllegalTransition(f"trajectory {self.request_id}: tokens with no turn running")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"trajectory {self.request_id}: {len(token_ids)} tokens but "
                             f"{len(logprobs)} logprobs")
        self.response_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(token_ids))
        self.turn_text.append(text)

    def end_turn(self, reason: FinishReason | None) -> bool:
        """The running turn ended with `reason` (None: its stream ended without one).
        True when the environment should answer it; otherwise the trajectory finished."""
        self._expect(TrajectoryPhase.GENERATING, "a turn's end")
        self.turn_open = False
        if reason is None or reason is FinishReason.ABORT:
            return self._finish(FinishReason.ABORT)
        if reason is FinishReason.LENGTH or self.budget_left <= 0:
            return self._finish(FinishReason.LENGTH)
        if self.turns >= self.max_turns:
            return self._finish(FinishReason.STOP)
        self.phase = TrajectoryPhase.ACTING
        return True

    def acted(self, step: EnvStep) -> None:
        """The environment's answer to the turn (its counts add up, its reward is the
        latest); `step.done` ends it."""
        self._expect(TrajectoryPhase.ACTING, "an environment step")
        reward = self.acts.env_reward if step.reward is None else step.reward
        self.acts = dataclasses.replace(self.acts, env_reward=reward, tools=self.acts.tools + step.tools)
        if step.done:
            self._finish(FinishReason.STOP)

    def observe(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Append an observation's ids (out of the loss) and return what was appended:
        one that would reach the budget is cut to it, and the trajectory finishes LENGTH
        (no room is left for a model turn)."""
        self._expect(TrajectoryPhase.ACTING, "an observation")
        kept = tuple(token_ids[: self.budget_left])
        self.response_ids.extend(kept)
        self.logprobs.extend([0.0] * len(kept))
        self.mask.extend([0] * len(kept))
        if self.budget_left <= 0:
            self._finish(FinishReason.LENGTH)
        else:
            self.phase = TrajectoryPhase.GENERATING
        return kept

    def _finish(self, reason: FinishReason) -> bool:
        self.phase = TrajectoryPhase.FINISHED
        self.reason = reason
        return False

    def stats(self) -> TurnStats:
        return dataclasses.replace(self.acts, turns=self.turns)

    def text(self) -> str:
        """The running (or last) turn's text, as the engine detokenised it."""
        return "".join(self.turn_text)
