"""The vocabulary of speculative rollout: where a draft comes from, the draft texts a
prompt's requests may copy from, the config's choices, and what a replica's speculative
decoding did.

A draft is only a guess: vLLM verifies every drafted token against the policy being
sampled (rejection sampling), so whatever a draft's source, the responses keep the
policy's distribution. Sources differ only in how often their guesses are accepted.

Imports nothing of rpk's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


class DraftSource(enum.IntEnum):
    """Where a draft text comes from, in the order a prompt's sources are ranked (lower
    first): responses further along than the one being drafted for."""

    SIBLING = 0  # the prompt's responses finished earlier in the same round
    PARTIAL = 1  # its responses an earlier round aborted (tail batching's deferred prompts)
    EPOCH = 2  # its responses in earlier epochs
    PROMPT = 3  # the prompt's own text (prompt lookup)

    @property
    def label(self) -> str:
        return self.name.lower()


class SpecMethod(enum.StrEnum):
    """The vLLM proposer a choice runs on."""

    NGRAM = "ngram"  # vLLM's built-in prompt lookup over each request's context
    RPK = "custom_class"  # rpk's proposer (`rpk.sync.worker.spec`), fed draft texts


class Speculative(enum.StrEnum):
    """`rollout.speculative`: speculative decoding in the rollout replicas, and the draft
    sources it copies from (`SPECULATIVE` gives each choice's row)."""

    OFF = "off"
    NGRAM = "ngram"
    PROMPT = "prompt"
    SIBLINGS = "siblings"
    PARTIALS = "partials"
    HISTORY = "history"
    ALL = "all"


@dataclass(frozen=True, slots=True)
class SpecChoice:
    method: SpecMethod | None  # None: no speculative decoding
    sources: frozenset[DraftSource]
    help: str


def _from(source: DraftSource, help: str) -> SpecChoice:
    """rpk's proposer drafting from one source alone."""
    return SpecChoice(SpecMethod.RPK, frozenset({source}), help)


SPECULATIVE: dict[Speculative, SpecChoice] = {
    Speculative.OFF: SpecChoice(None, frozenset(), "no speculative decoding"),
    Speculative.NGRAM: SpecChoice(
        SpecMethod.NGRAM, frozenset({DraftSource.PROMPT}),
        "vLLM's n-gram prompt lookup over each request's own context (its draft length fixed at start)"),
    Speculative.PROMPT: _from(DraftSource.PROMPT, "rpk's proposer, the prompt's own n-grams alone"),
    Speculative.SIBLINGS: _from(DraftSource.SIBLING, "the prompt's responses finished earlier in the round"),
    Speculative.PARTIALS: _from(
        DraftSource.PARTIAL, "the prompt's responses an earlier round aborted (tail batching's deferred prompts)"),
    Speculative.HISTORY: _from(DraftSource.EPOCH, "the prompt's responses in earlier epochs"),
    Speculative.ALL: SpecChoice(
        SpecMethod.RPK, frozenset(DraftSource),
        "every source, ranked: finished siblings, aborted partials, earlier epochs, the prompt's n-grams"),
}


@dataclass(frozen=True, slots=True)
class Draft:
    """A text a request of the prompt may copy from, as token ids."""

    source: DraftSource
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptDrafts:
    """A prompt's draft texts; `prompt` (its token ids) is the key a replica's rows are
    matched by: every request of the prompt, a trajectory's later turns included, starts
    with it."""

    prompt: tuple[int, ...]
    drafts: tuple[Draft, ...]

    def to_wire(self) -> list[object]:
        """As plain lists of ints, what `collective_rpc` and JSON carry."""
        return [list(self.prompt), [[int(d.source), list(d.token_ids)] for d in self.drafts]]

    @classmethod
    def from_wire(cls, item: Sequence[object]) -> PromptDrafts:
        prompt, drafts = item
        return cls(tuple(int(t) for t in prompt),  # type: ignore[attr-defined]
                   tuple(Draft(DraftSource(int(s)), tuple(int(t) for t in ts)) for s, ts in drafts))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class SourceCounts:
    """What one source's drafts did: rows drafted for, draft tokens, tokens accepted."""

    drafts: int = 0
    tokens: int = 0
    accepted: int = 0

    def plus(self, other: SourceCounts) -> SourceCounts:
        return SourceCounts(self.drafts + other.drafts, self.tokens + other.tokens,
                            self.accepted + other.accepted)


def _add_lists(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))


def _add_fit(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    if not a or not b:
        return a or b
    return tuple(x + y for x, y in zip(a, b))


@dataclass(frozen=True, slots=True)
class SpecStats:
    """One replica's speculative decoding since it was last asked: vLLM's counters
    (verified rows, draft tokens, accepted ones, both by draft position) and its engine
    steps that verified drafts (with the tokens they generated and the sequences they
    ran), rpk's proposer's attribution by draft source, the engine's step times against
    the tokens each step ran (`step_fit`: the sums n, x, y, xx, xy of a least-squares
    fit of seconds on tokens, over the steps that verified no draft; `verify_fit`: the
    sums n, x, y of those that did) and the tokens of the requests it aborted (`cut`, by
    request id: their partial responses, drafts of their prompts' later rounds)."""

    drafts: int = 0  # a request's step that verified drafts
    draft_tokens: int = 0
    accepted: int = 0
    drafted_by_pos: tuple[int, ...] = ()  # drafts that reached position i + 1
    accepted_by_pos: tuple[int, ...] = ()  # ... and were accepted there
    spec_steps: int = 0  # engine steps that verified drafts
    spec_step_tokens: int = 0  # tokens generated in those steps
    spec_step_rows: int = 0  # sequences running in those steps, summed
    steps: int = 0  # engine steps that generated tokens, all of them
    by_source: Mapping[DraftSource, SourceCounts] = field(default_factory=dict)
    step_fit: tuple[float, ...] = ()  # (n, sum x, sum y, sum xx, sum xy): x tokens a step ran, y its seconds
    cut: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    verify_fit: tuple[float, ...] = ()  # (n, sum x, sum y) of the steps that verified drafts

    def plus(self, other: SpecStats) -> SpecStats:
        sources = dict(self.by_source)
        for s, c in other.by_source.items():
            sources[s] = sources.get(s, SourceCounts()).plus(c)
        return SpecStats(
            self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
            self.accepted + other.accepted, _add_lists(self.drafted_by_pos, other.drafted_by_pos),
            _add_lists(self.accepted_by_pos, other.accepted_by_pos), self.spec_steps + other.spec_steps,
            self.spec_step_tokens + other.spec_step_tokens, self.spec_step_rows + other.spec_step_rows,
            self.steps + other.steps, sources, _add_fit(self.step_fit, other.step_fit),
            {**self.cut, **other.cut}, _add_fit(self.verify_fit, other.verify_fit),
        )

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a verifying row gained per step, the bonus token included (1.0: none)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def to_json(self) -> dict[str, object]:
        return {
            "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
            "drafted_by_pos": list(self.drafted_by_pos), "accepted_by_pos": list(self.accepted_by_pos),
            "spec_steps": self.spec_steps, "spec_step_tokens": self.spec_step_tokens,
            "spec_step_rows": self.spec_step_rows, "steps": self.steps,
            "by_source": {s.label: [c.drafts, c.tokens, c.accepted] for s, c in self.by_source.items()},
            "step_fit": list(self.step_fit), "cut": {rid: list(t) for rid, t in self.cut.items()},
            "verify_fit": list(self.verify_fit),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> SpecStats:
        by_label = {s.label: s for s in DraftSource}
        sources = d.get("by_source") or {}
        assert isinstance(sources, Mapping)
        return cls(
            int(d.get("drafts", 0)), int(d.get("draft_tokens", 0)), int(d.get("accepted", 0)),  # type: ignore[arg-type]
            tuple(int(x) for x in d.get("drafted_by_pos", ())),  # type: ignore[attr-defined]
            tuple(int(x) for x in d.get("accepted_by_pos", ())),  # type: ignore[attr-defined]
            int(d.get("spec_steps", 0)), int(d.get("spec_step_tokens", 0)),  # type: ignore[arg-type]
            int(d.get("spec_step_rows", 0)), int(d.get("steps", 0)),  # type: ignore[arg-type]
            {by_label[k]: SourceCounts(*(int(x) for x in v)) for k, v in sources.items()},
            tuple(float(x) for x in d.get("step_fit", ())),  # type: ignore[attr-defined]
            {str(rid): tuple(int(x) for x in t) for rid, t in d.get("cut", {}).items()},  # type: ignore[attr-defined]
            tuple(float(x) for x in d.get("verify_fit", ())),  # type: ignore[attr-defined]
        )
