"""What a judge's answer is worth: the verdict kinds in one table, and the readings they
turn into a reward.

A verdict kind (`Verdict`, the config's `reward.judge.verdict`) fixes everything that
differs between kinds, so that nothing downstream compares names (`KINDS`, a row each):
the engine that answers it (a chat model, or a reward model on vLLM's pooling runner),
whether the judge sees the grading prompt or the conversation, what the engine reads,
how many tokens the judge writes (what the memory plan adds to its input), and how the
reading becomes a reward.

- `logprob`: P(yes) from the yes and no words' log-probs at the judge's first output
  token (one decode step).
- `reason`: the judge thinks first, greedily, up to `reason_tokens` tokens, stopping at
  `verdict_marker`; P(yes) is then read at the position right after the marker (a second,
  one-token request over the prompt, the thought and the marker, almost free with
  prefix caching). A judge that did not write the marker within its budget has it
  appended by rpk, and is read there all the same (`Reading.marker_cut`, counted).
- `score`: a graded judge writes `Score: x`, the reward is x / score_max; only a judge
  that ended its answer itself counts (one cut at max_tokens is a failure).
- `classify`: a discriminative reward model's own score over the conversation.

A verdict from the yes/no words is only as good as the mass the judge put on them: a
thinking judge whose first token is `<think>`, or an off-format one, gives two
near-zero log-probs whose ratio is noise. So `Judged.mass` is P(yes) + P(no), and a mass
below `min_mass` is a failure of its own kind (`judge_low_mass`), never a reward.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from rpk.core.modes import Runner


class Verdict(enum.StrEnum):
    LOGPROB = "logprob"
    REASON = "reason"
    SCORE = "score"
    CLASSIFY = "classify"


class Reads(enum.Enum):
    """What the engine reads of the judge's answer."""

    FIRST_TOKEN = "the yes/no log-probs at the first output token"
    AFTER_MARKER = "the yes/no log-probs right after the verdict marker, past a thought"
    TEXT = "the text written"
    POOLED = "the reward model's score"


class VerdictSettings(Protocol):
    """What a verdict kind reads of the judge's settings (`rpk.reward.judge.JudgeSettings`)."""

    @property
    def threshold(self) -> float | None: ...
    @property
    def min_mass(self) -> float: ...
    @property
    def score_max(self) -> float: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def reason_tokens(self) -> int: ...
    @property
    def verdict_marker(self) -> str: ...
    @property
    def votes(self) -> int: ...
    @property
    def temperature(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Sampling:
    """The judge's generation for one vote (an engine turns it into its own params):
    tokens it may write, temperature (0: greedy), where it stops."""

    max_tokens: int
    temperature: float
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reading:
    """What the judge answered: its text and whether it ended it itself (`finished`:
    finish_reason "stop", not cut at its token budget); the log-probs of the yes and no
    words at the reading position; a reward model's score; for `reason`, whether rpk
    appended the marker because the judge never wrote it (`marker_cut`)."""

    text: str = ""
    finished: bool = True
    yes_logprob: float | None = None
    no_logprob: float | None = None
    score: float | None = None
    marker_cut: bool = False


@dataclass(frozen=True, slots=True)
class Judged:
    """One reading's worth: the reward, whether it counts as correct, and the yes+no
    probability mass it was read from (None where no words were read)."""

    reward: float
    correct: bool
    mass: float | None = None


class VerdictError(ValueError):
    """No verdict could be read from the judge's answer; `kind` is the failure's count."""

    kind = "judge_parse"


class LowMass(VerdictError):
    """The judge put less than `min_mass` on the yes and no words together."""

    kind = "judge_low_mass"


class Unfinished(VerdictError):
    """A graded judge was cut at its token budget: its last score may be mid-thought."""

    kind = "judge_cut"


# Whole word on both sides: "subscore: 3" or "score: 7x" is no score.
_SCORE = re.compile(r"(?<!\w)score\s*[:=]\s*(-?\d+(?:\.\d+)?)(?!\.?\d)(?!\w)", re.IGNORECASE)


def p_yes(yes_logprob: float, no_logprob: float) -> float:
    """P(yes) among {yes, no}, from the two log-probs (stable for very negative ones)."""
    top = max(yes_logprob, no_logprob)
    if top == -math.inf:
        raise VerdictError("the judge gave both the yes and the no word probability 0")
    yes, no = math.exp(yes_logprob - top), math.exp(no_logprob - top)
    return yes / (yes + no)


def graded(text: str, score_max: float) -> float:
    """`Score: x` -> x / score_max; the last such line counts (a judge may quote the
    format first). VerdictError for none or one out of range: never read as 0."""
    found = _SCORE.findall(text)
    if not found:
        raise VerdictError(f"no 'Score: x' in the judge's answer {text[:120]!r}")
    value = float(found[-1])
    if not 0 <= value <= score_max:
        raise VerdictError(f"score {value:g} is outside [0, {score_max:g}]")
    return value / score_max


def read_words(settings: VerdictSettings, reading: Reading) -> Judged:
    """P(yes) from the yes/no log-probs, refused below `min_mass`; 1/0 against
    `threshold` when set."""
    if reading.yes_logprob is None or reading.no_logprob is None:
        raise VerdictError("the judge returned no log-probs for the yes and no words")
    mass = math.exp(reading.yes_logprob) + math.exp(reading.no_logprob)
    if mass < settings.min_mass:
        raise LowMass(f"the yes and no words have probability {mass:.3g} together, below "
                      f"reward.judge.min_mass={settings.min_mass:g}")
    p = p_yes(reading.yes_logprob, reading.no_logprob)
    if settings.threshold is not None:
        return Judged(float(p >= settings.threshold), p >= settings.threshold, mass)
    return Judged(p, p >= 0.5, mass)


def read_score(settings: VerdictSettings, reading: Reading) -> Judged:
    if not reading.finished:
        raise Unfinished(f"the judge was cut at max_tokens={settings.max_tokens} before it "
                         f"finished: {reading.text[-120:]!r}")
    reward = graded(reading.text, settings.score_max)
    return Judged(reward, reward >= (settings.threshold if settings.threshold is not None else 0.5))


def read_pooled(settings: VerdictSettings, reading: Reading) -> Judged:
    if reading.score is None or not math.isfinite(reading.score):
        raise VerdictError(f"the reward model returned score {reading.score!r}")
    cut = settings.threshold if settings.threshold is not None else 0.0
    return Judged(reading.score, reading.score > cut)


# The marker rpk appends (a line of its own) and the reading token after it: what the
# memory plan allows a reasoning verdict beyond its thought.
MARKER_TOKENS = 16


@dataclass(frozen=True, slots=True)
class VerdictKind:
    """One row of `KINDS`.

    `conversation`: the judge sees [user: question, assistant: response] through its own
    chat template (a reward model's training input), not the grading prompt.
    `words`: the yes/no words are read (each must be one token of the judge's).
    `bounded`: a set threshold is a probability or a share of score_max, in [0, 1].
    `votes`: it samples, so `votes` > 1 means something."""

    verdict: Verdict
    runner: Runner  # what serves it: a chat model generating, or a reward model pooling
    reads: Reads
    conversation: bool
    words: bool
    bounded: bool
    votes: bool
    # The judge's generation (None: nothing is generated) and the tokens it adds to its
    # input at most (the memory plan's allowance).
    sampling: Callable[[VerdictSettings], Sampling | None]
    output_tokens: Callable[[VerdictSettings], int]
    read: Callable[[VerdictSettings, Reading], Judged]


def _temperature(settings: VerdictSettings) -> float:
    """Greedy for one vote; votes sample at `temperature`."""
    return settings.temperature if settings.votes > 1 else 0.0


KINDS: Mapping[Verdict, VerdictKind] = {k.verdict: k for k in (
    # Temperature 1 and no top-p: the log-probs returned are the model's own.
    VerdictKind(Verdict.LOGPROB, Runner.GENERATE, Reads.FIRST_TOKEN, conversation=False,
                words=True, bounded=True, votes=False,
                sampling=lambda s: Sampling(1, 1.0), output_tokens=lambda s: 1, read=read_words),
    VerdictKind(Verdict.REASON, Runner.GENERATE, Reads.AFTER_MARKER, conversation=False,
                words=True, bounded=True, votes=True,
                sampling=lambda s: Sampling(s.reason_tokens, _temperature(s), (s.verdict_marker,)),
                output_tokens=lambda s: s.reason_tokens + MARKER_TOKENS, read=read_words),
    VerdictKind(Verdict.SCORE, Runner.GENERATE, Reads.TEXT, conversation=False,
                words=False, bounded=True, votes=True,
                sampling=lambda s: Sampling(s.max_tokens, _temperature(s)),
                output_tokens=lambda s: s.max_tokens, read=read_score),
    VerdictKind(Verdict.CLASSIFY, Runner.POOLING, Reads.POOLED, conversation=True,
                words=False, bounded=False, votes=False,
                sampling=lambda s: None, output_tokens=lambda s: 0, read=read_pooled),
)}
