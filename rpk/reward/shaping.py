"""Reward shaping on top of the task's score: a format bonus and DAPO's soft overlong
penalty, applied in the event loop after the scorer returns (both are a regex search
or arithmetic on the finished response; the response's token count is not part of
veRL's reward signature, so the penalty cannot live in the reward function).

    reward = task score + format_weight * [response matches format_regex]
                        + overlong_weight * overlong_penalty(len(response tokens))

`Scored.correct` keeps the task's own verdict. A sample whose scoring failed stays at 0:
shaping a failure would hide it in the reward statistics. Several reward functions
summed with weights (`reward.functions`) are `rpk.reward.functions.WeightedSum`: that
sum runs inside the scorer, so it shares one timeout.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from rpk.core.protocols import Scorer
from rpk.core.records import Response, Scored


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to `max_tokens - buffer` tokens, then
    linear down to -1 at `max_tokens`, and -1 beyond."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return max(-1.0, -(length - start) / buffer)


@dataclass(frozen=True, slots=True)
class Shaping:
    format_regex: str | None = None
    format_weight: float = 0.0
    max_tokens: int = 0  # DAPO's L_max: the response length budget
    overlong_buffer: int = 0  # DAPO's L_cache; 0 turns the penalty off
    overlong_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.format_regex is not None:
            re.compile(self.format_regex)
        if self.overlong_buffer < 0 or self.overlong_buffer >= max(self.max_tokens, 1):
            raise ValueError(
                f"overlong_buffer must be in [0, max_tokens={self.max_tokens}), "
                f"got {self.overlong_buffer!r}"
            )

    @property
    def active(self) -> bool:
        return (self.format_regex is not None and self.format_weight != 0) or (
            self.overlong_buffer > 0 and self.overlong_weight != 0
        )

    def format_matches(self, response: Response) -> bool | None:
        """None when no format is configured."""
        if self.format_regex is None:
            return None
        return re.search(self.format_regex, response.text) is not None

    def overlong_term(self, response: Response) -> float:
        length = len(response.token_ids)
        return self.overlong_weight * overlong_penalty(length, self.max_tokens, self.overlong_buffer)


class ShapedScorer:
    """Wraps any scorer and adds the shaping terms to each successful score."""

    def __init__(self, inner: Scorer, shaping: Shaping) -> None:
        self.inner = inner
        self.shaping = shaping
        self.counts: Counter[str] = Counter()

    async def score(self, response: Response) -> Scored:
        return self.shape(await self.inner.score(response))

    def shape(self, scored: Scored) -> Scored:
        """`scored` with the shaping added (and counted): also for the scores of a group
        judged at once, which do not pass through `score`."""
        if scored.error is not None:
            return scored
        response = scored.response
        matched = self.shaping.format_matches(response)
        fmt = self.shaping.format_weight if matched else 0.0
        over = self.shaping.overlong_term(response)
        if matched is False:
            self.counts["format_miss"] += 1
        if over < 0:
            self.counts["overlong"] += 1
        return Scored(response, scored.reward + fmt + over, scored.correct)

    def metrics(self) -> dict[str, float]:
        inner = getattr(self.inner, "metrics", None)
        return {
            **(inner() if inner else {}),
            "reward_format_miss_total": float(self.counts["format_miss"]),
            "reward_overlong_total": float(self.counts["overlong"]),
        }

    async def aclose(self) -> None:
        await self.inner.aclose()
