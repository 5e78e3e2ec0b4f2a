"""The draft texts one replica's proposer copies from, and the matching: plain state, no
vLLM, no torch (numpy arrays in, lists of token ids out), so it is tested alone.

Each step vLLM hands the proposer every running row as token ids (prompt and output
together, no boundary). A row is mapped to the prompt whose token ids it starts with
(the longest registered one: a trajectory's later turns start with its prompt too);
the mapping is cached per row slot and revalidated each step by the row's length and
the tokens before its newest ones. Then its latest tokens are matched, suffix-match
style, against that prompt's candidate texts: the longest run of the row's last tokens
(at least `min_match`) that a candidate contains, and the candidate's continuation
after it is the draft. A candidate's text is indexed with the prompt's last tokens in
front, so a row that has just started (its context ends in the prompt) drafts the
first tokens of a finished sibling. Among matches, a long enough one (`confident`)
is ranked by source first (siblings, partials, earlier epochs, the prompt), then by
the draft it leaves (a repetitive text matches near its end too, with little after),
then by length, then the newest text; shorter ones by length first. A prompt with no
response text yet drafts nothing from its own n-grams, unless they are the round's
only source (measuring them alone).

The draft length follows the live batch: the schedule (`(lo, hi, k)` ranges, the
planner's `DraftPlan`) gives k for the number of rows decoding, and k = 0 drafts
nothing. vLLM's own per-batch-size schedule is fixed when the engine starts; this one
is replaced every round.

What each source's drafts did is counted here too: a row's drafts of one step are
verified in its next, where the tokens it gained (accepted drafts and the bonus token)
tell how many were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rpk.core.drafts import DraftSource, PromptDrafts, SourceCounts

# Occurrences of the row's last `min_match` tokens examined per row and step, newest
# first: bounds a step's matching however repetitive the texts are.
_MAX_OCCURRENCES = 8
# Tokens of a row's tail compared when checking that its slot still holds the same
# request (and kept to extend matches with).
_TAIL = 8
_PROMPT_ONLY = frozenset({DraftSource.PROMPT})


@dataclass(slots=True)
class _Prompt:
    key: bytes  # the prompt's token ids, int32
    length: int
    tail: list[int]  # its last max_match tokens: put in front of every response text
    texts: list[list[int]] = field(default_factory=list)
    sources: list[DraftSource] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # where a text's own tokens begin
    # (first token, second token, ...) of each `min_match` run -> [(text, position after)]
    index: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    tokens: int = 0
    responses: int = 0  # texts of a response source (all but the prompt's own)


@dataclass(slots=True)
class _Row:
    prompt: _Prompt | None
    seen: int  # the row's token count when last checked
    tail: bytes  # its tokens just before `seen`
    pending: tuple[DraftSource, int] | None = None  # last step's draft: source, tokens


class DraftIndex:
    """A replica's draft texts by prompt and the per-row matching; see the module
    docstring. `max_k`: the engine's `num_speculative_tokens`, the longest draft."""

    def __init__(self, max_k: int, *, min_match: int = 2, max_match: int = 12, confident: int = 4,
                 max_texts: int = 32, max_prompt_tokens: int = 1 << 16) -> None:
        if max_k < 1 or not 1 <= min_match <= confident <= max_match:
            raise ValueError(f"need max_k >= 1 and 1 <= min_match <= confident <= max_match, got "
                             f"{max_k}, {min_match}, {confident}, {max_match}")
        self.max_k = max_k
        self.min_match, self.max_match, self.confident = min_match, max_match, confident
        self.max_texts, self.max_prompt_tokens = max_texts, max_prompt_tokens
        self.schedule: tuple[tuple[int, int, int], ...] = ((1, 1 << 30, max_k),)
        self.sources: frozenset[DraftSource] = frozenset(DraftSource)
        self._prompts: dict[int, dict[bytes, _Prompt]] = {}  # by length, then key
        self._lengths: list[int] = []  # registered lengths, longest first
        self._rows: dict[int, _Row] = {}
        self.counts: dict[DraftSource, SourceCounts] = {}
        self._pending = False  # some row's draft of the last step is still to be scored

    # -- state from rpk ------------------------------------------------------------
    def reset(self, schedule: Sequence[Sequence[int]], sources: Sequence[DraftSource],
              prompts: Sequence[PromptDrafts]) -> None:
        """A new round: its draft-length schedule, the sources it may copy from, and its
        prompts' draft texts (every earlier prompt forgotten)."""
        bands = tuple((int(lo), int(hi), min(int(k), self.max_k)) for lo, hi, k in schedule)
        if not bands or bands[0][0] != 1 or any(k < 0 for _, _, k in bands):
            raise ValueError(f"a schedule starts at batch size 1 with k >= 0, got {list(schedule)}")
        self.schedule, self.sources = bands, frozenset(sources)
        self._prompts, self._lengths, self._rows = {}, [], {}
        for p in prompts:
            self.add(p)

    def add(self, drafts: PromptDrafts) -> None:
        """More texts for a prompt (a sibling that just finished); registers the prompt."""
        prompt = self._register(drafts.prompt)
        for d in drafts.drafts:
            if d.source in self.sources and d.source is not DraftSource.PROMPT:
                self._add_text(prompt, d.source, list(d.token_ids), len(prompt.tail))

    def _register(self, tokens: Sequence[int]) -> _Prompt:
        key = np.asarray(tokens, dtype=np.int32).tobytes()
        by_key = self._prompts.get(len(tokens))
        if by_key is None:
            by_key = self._prompts[len(tokens)] = {}
            self._lengths = sorted(self._prompts, reverse=True)
        prompt = by_key.get(key)
        if prompt is None:
            prompt = by_key[key] = _Prompt(key, len(tokens), list(tokens[-self.max_match:]))
            if DraftSource.PROMPT in self.sources:
                self._add_text(prompt, DraftSource.PROMPT, [], 0, own=list(tokens))
        return prompt

    def _add_text(self, prompt: _Prompt, source: DraftSource, tokens: list[int], start: int,
                  own: list[int] | None = None) -> None:
        """Index a text: a response's tokens behind the prompt's tail (drafts only from
        the response), or the prompt's own tokens (`own`, drafts from anywhere in it)."""
        if len(prompt.texts) >= self.max_texts or prompt.tokens >= self.max_prompt_tokens:
            return
        text = own if own is not None else prompt.tail + tokens
        if len(text) - start < 1:
            return
        t = len(prompt.texts)
        prompt.texts.append(text)
        prompt.sources.append(source)
        prompt.starts.append(start)
        prompt.tokens += len(text)
        prompt.responses += source is not DraftSource.PROMPT
        n, index = self.min_match, prompt.index
        for j in range(max(n, start), len(text)):
            index.setdefault(tuple(text[j - n:j]), []).append((t, j))

    # -- the proposer's step -------------------------------------------------------
    def k_for(self, batch: int) -> int:
        for lo, hi, k in self.schedule:
            if lo <= batch <= hi:
                return k
        return self.schedule[-1][2]

    def propose(self, sampled: Sequence[Sequence[int]], num_tokens: np.ndarray,
                token_ids: np.ndarray) -> list[list[int]]:
        """One draft (maybe empty) per row; `sampled`: the tokens each row gained this
        step (empty: not decoding), `num_tokens` and `token_ids`: vLLM's rows, without
        drafts."""
        rows = len(sampled)
        decoding = sum(1 for s in sampled if s)
        k = self.k_for(decoding) if decoding else 0
        out: list[list[int]] = [[] for _ in range(rows)]
        if k == 0 and not self._pending:
            # Nothing to draft and no draft of the last step to score: skip the rows (a
            # full batch pays no matching; the slots are mapped afresh when it thins).
            self._rows = {}
            return out
        self._pending = False
        for i in range(rows):
            got = sampled[i]
            if not got:
                continue
            n = int(num_tokens[i])
            row = self._row(i, token_ids[i], n, len(got))
            if k == 0 or row.prompt is None or n + 1 >= token_ids.shape[1]:
                continue
            lo = max(0, n - self.max_match)
            context = token_ids[i, lo:n].tolist()
            found = self._match(row.prompt, context, min(k, token_ids.shape[1] - n - 1))
            if found is not None:
                source, draft = found
                out[i] = draft
                row.pending = (source, len(draft))
                self._pending = True
                c = self.counts.get(source, SourceCounts())
                self.counts[source] = SourceCounts(c.drafts + 1, c.tokens + len(draft), c.accepted)
        return out

    def _row(self, i: int, tokens: np.ndarray, n: int, gained: int) -> _Row:
        """Row slot `i`'s state, revalidated: the same request has `gained` more tokens
        and the same ones before them; else it is mapped afresh. Last step's draft of the
        same request is scored here: it gained accepted drafts + 1."""
        row = self._rows.get(i)
        before = n - gained
        if (row is not None and row.seen == before
                and tokens[max(0, before - _TAIL):before].tobytes() == row.tail):
            if row.pending is not None:
                source, drafted = row.pending
                c = self.counts.get(source, SourceCounts())
                self.counts[source] = SourceCounts(c.drafts, c.tokens, c.accepted + min(drafted, gained - 1))
                row.pending = None
        else:
            row = self._rows[i] = _Row(self._prompt_of(tokens, n), 0, b"")
        row.seen = n
        row.tail = tokens[max(0, n - _TAIL):n].tobytes()
        return row

    def _prompt_of(self, tokens: np.ndarray, n: int) -> _Prompt | None:
        for length in self._lengths:
            if length < n:
                prompt = self._prompts[length].get(tokens[:length].tobytes())
                if prompt is not None:
                    return prompt
        return None

    def _match(self, prompt: _Prompt, context: list[int], k: int) -> tuple[DraftSource, list[int]] | None:
        n = self.min_match
        if len(context) < n or k < 1:
            return None
        found = prompt.index.get(tuple(context[-n:]))
        if not found:
            return None
        if not prompt.responses and self.sources != _PROMPT_ONLY:
            # The prompt's own n-grams alone draft too poorly to pay for a verify
            # (bench/results/spec_tail.json: 1.04 tokens per verify): a prompt drafts
            # only once it has a response text, unless they are all the round may use.
            return None
        best: tuple[tuple[int, ...], int, int] | None = None
        limit = min(len(context), self.max_match)
        for t, j in reversed(found[-_MAX_OCCURRENCES:]):
            text = prompt.texts[t]
            m = n
            while m < limit and j - m - 1 >= 0 and text[j - m - 1] == context[-m - 1]:
                m += 1
            # A repetitive text matches at many places: one that leaves a whole draft
            # after it beats a longer match near the text's end.
            room = min(len(text) - j, k)
            score = (min(m, self.confident), -prompt.sources[t], room, m, t)
            if best is None or score > best[0]:
                best = (score, t, j)
                if m == limit and room == k and prompt.sources[t] == 0:
                    break  # nothing can beat a whole match from the first-ranked source
        if best is None:
            return None
        _, t, j = best
        return prompt.sources[t], prompt.texts[t][j:j + k]

    def take_counts(self) -> dict[DraftSource, SourceCounts]:
        """Each source's drafts since the last call."""
        counts, self.counts = self.counts, {}
        return counts
