"""The draft texts a policy keeps across rounds, per prompt: plain state, no I/O.

Two of the speculative tail's sources outlive a round:
- a prompt's partial responses that a short round aborted (tail batching defers the
  prompt to a long round, which samples it afresh: its earlier responses, cut off
  part-way, are the best guess of how the new ones go). They are kept while the prompt
  waits, with the long-prompt queue, and dropped once it trains;
- its responses of earlier epochs, a bounded store (the prompts trained most recently
  are kept).
Both go into every checkpoint with the policy's state. The other two sources need no
store: a round's finished siblings reach the replicas as they finish
(`rpk.loop.speculate`), and the prompt's own text is its token ids.

Drafts are guesses that vLLM verifies token by token against the current policy, so
old texts (another policy version's) cost acceptance, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rpk.core.drafts import Draft, DraftSource, PromptDrafts
from rpk.core.outcomes import RoundResult
from rpk.core.records import Prompt

Texts = list[tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """What the store keeps at most: texts per prompt of each kind, prompts with partial
    texts and with earlier-epoch texts (the oldest go first), and tokens of one text."""

    partials_per_prompt: int = 4
    epochs_per_prompt: int = 4
    partial_prompts: int = 4096
    epoch_prompts: int = 4096
    text_tokens: int = 8192

    def __post_init__(self) -> None:
        bad = {k: getattr(self, k) for k in self.__slots__ if getattr(self, k) < 0}  # type: ignore[attr-defined]
        if bad:
            raise ValueError(f"StoreLimits must be >= 0, got {bad}")


class DraftStore:
    """Partial and earlier-epoch texts by prompt uid, for the sources in `sources` (a
    source not chosen is never kept)."""

    def __init__(self, sources: Iterable[DraftSource], limits: StoreLimits = StoreLimits()) -> None:
        self.sources = frozenset(sources)
        self.limits = limits
        self.partials: OrderedDict[str, Texts] = OrderedDict()
        self.epochs: OrderedDict[str, Texts] = OrderedDict()

    @property
    def keeps_partials(self) -> bool:
        """Whether a round's aborted requests' tokens are kept (`keep_partials`)."""
        return DraftSource.PARTIAL in self.sources

    def drafts(self, prompt: Prompt) -> PromptDrafts:
        """The prompt's stored texts, partials first (the newer policy's)."""
        texts = [Draft(DraftSource.PARTIAL, t) for t in self.partials.get(prompt.uid, ())]
        texts += [Draft(DraftSource.EPOCH, t) for t in self.epochs.get(prompt.uid, ())]
        return PromptDrafts(prompt.token_ids, tuple(texts))

    def observe(self, result: RoundResult) -> None:
        """A round's end: its trained prompts' responses become earlier-epoch texts and
        their partials go."""
        lim = self.limits
        done = [g.prompt.uid for g in result.groups] + [p.uid for p in result.dropped]
        for uid in done:
            self.partials.pop(uid, None)
        if DraftSource.EPOCH in self.sources:
            for g in result.groups:
                texts = sorted((m.response.token_ids[: lim.text_tokens] for m in g.members), key=len, reverse=True)
                self._put(self.epochs, g.prompt.uid, texts[: lim.epochs_per_prompt], lim.epoch_prompts)

    def keep_partials(self, prompt: Prompt, cut: Iterable[tuple[int, ...]]) -> None:
        """A prompt a round left incomplete keeps its aborted responses' tokens, the
        longest first (the furthest along), beside what it had."""
        if not self.keeps_partials:
            return
        lim = self.limits
        texts = sorted((t[: lim.text_tokens] for t in cut if t), key=len, reverse=True)
        texts += self.partials.get(prompt.uid, [])
        if texts:
            self._put(self.partials, prompt.uid, texts[: lim.partials_per_prompt], lim.partial_prompts)

    @staticmethod
    def _put(store: OrderedDict[str, Texts], uid: str, texts: Texts, limit: int) -> None:
        store[uid] = texts
        store.move_to_end(uid)
        while len(store) > limit:
            store.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "partials": [[uid, [list(t) for t in ts]] for uid, ts in self.partials.items()],
            "epochs": [[uid, [list(t) for t in ts]] for uid, ts in self.epochs.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("partials", "epochs"):
            store: OrderedDict[str, Texts] = OrderedDict(
                (str(uid), [tuple(int(x) for x in t) for t in ts]) for uid, ts in state.get(name, ())
            )
            setattr(self, name, store)
