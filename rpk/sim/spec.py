"""Speculative decoding in a simulated replica: what rpk's proposer (`rpk.sync.worker.
spec_index.DraftIndex`) and vLLM's rejection sampler do, on virtual time.

The replica takes what a vLLM replica takes (`set_drafts` before a round: the draft
length by batch size and the sources the round may draft from, its prompts and their
stored texts; `add_drafts` as siblings finish) and drafts the way rpk's proposer does:
each step drafts k tokens (the round's schedule at the live batch size) for every
running row whose prompt has a text of an allowed source, the best-ranked source first;
a row with none drafts nothing. Whether a draft matches is the acceptance model's
(`rpk.sim.accept`): a text, once there, drafts for every row of its prompt, since the
published drafters it is calibrated to match suffixes anywhere in a text (as rpk's
does). The texts' tokens are never read, so the simulator hands back placeholders
(`TEXT_TOKENS` long) as aborted requests' partial responses.

Draws. Between two events every drafting row verifies k drafts a step. Where no row can
reach its end within the next S steps (S (k + 1) tokens short of it), the S verifies of
each row are drawn at once: how many of them accepted 0..k tokens is multinomial. A row
that could end sooner makes the replica step one verify at a time, each row's accepted
tokens drawn and cut at its last token (vLLM drops what follows a stop). Draws come
from one seeded generator per replica, in the order the replica decides: a run
reproduces exactly.

`rpk.sim.fleet.SoloFleet` puts one replica behind the fleet's speculation calls, for
runs that drive a bare engine (`rpk.loop.speculate.SpecTail` asks a fleet).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from rpk.core.drafts import DraftSource, PromptDrafts, SourceCounts, SpecStats
from rpk.sim.accept import AcceptanceModel

if TYPE_CHECKING:
    from rpk.core.records import GenRequest


class Row(Protocol):
    """A running sequence as the draws see it (`rpk.sim.engine._Seq`); its prompt's
    texts, and the source it drafts from, are looked up once per `SimDrafts.epoch`."""

    request: GenRequest
    stop: int
    produced: int
    texts: set[DraftSource] | None
    texts_epoch: int
    draft: DraftSource | None

# Tokens of the placeholder an aborted request leaves as its partial response: only
# whether a prompt has a text counts here, and the policy's store keeps what it is given.
TEXT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SimSpec:
    """A simulated replica's speculative decoding: the acceptance its verifies draw from
    and the seed of its draws (each replica of a fleet gets its own, `for_replica`)."""

    model: AcceptanceModel
    seed: int = 0

    def for_replica(self, index: int) -> SimSpec:
        return SimSpec(self.model, self.seed * 1_000_003 + index)


@dataclass(frozen=True, slots=True)
class Verifies:
    """`steps` engine steps of a batch in which `drafting` rows verify `k` drafts each:
    per row of the batch (in its order), the drafted tokens it accepted over them (0 for
    a row not drafting); the accepted tokens by draft position (position i + 1 at i);
    per source, (rows drafting, tokens accepted)."""

    steps: int
    k: int
    drafting: int
    accepted: np.ndarray
    by_pos: np.ndarray
    by_source: Mapping[DraftSource, tuple[int, int]]

    def part(self, steps: int) -> Verifies:
        """The first `steps` of them (a batch touched mid-way): the accepted tokens in
        proportion, rounded down."""
        if steps >= self.steps:
            return self
        f = steps / self.steps
        return Verifies(steps, self.k, self.drafting, np.floor(self.accepted * f).astype(np.int64),
                        np.floor(self.by_pos * f).astype(np.int64),
                        {s: (rows, math.floor(acc * f)) for s, (rows, acc) in self.by_source.items()})

    def stats(self, batch: int, x: float, first: float, dt: float, first_x: float) -> SpecStats:
        """vLLM's counters for these steps, and the engine's step times against the
        tokens each ran (`x`, the first `first_x`), as the real replica reports them."""
        s, k = self.steps, self.k
        accepted = int(self.accepted.sum())
        return SpecStats(
            drafts=self.drafting * s, draft_tokens=self.drafting * s * k, accepted=accepted,
            drafted_by_pos=(self.drafting * s,) * k, accepted_by_pos=tuple(int(a) for a in self.by_pos),
            spec_steps=s, spec_step_tokens=batch * s + accepted, spec_step_rows=batch * s, steps=s,
            by_source={src: SourceCounts(rows * s, rows * s * k, acc) for src, (rows, acc) in self.by_source.items()},
            step_fit=step_fit(s, x, first, dt, first_x),
        )


def step_fit(steps: int, x: float, first: float, dt: float, first_x: float) -> tuple[float, ...]:
    """The sums (n, x, y, xx, xy) of `steps` steps: the first of `first_x` tokens in
    `first` seconds, the others of `x` tokens in `dt` each."""
    rest = steps - 1
    return (float(steps), first_x + rest * x, first + rest * dt, first_x * first_x + rest * x * x,
            first_x * first + rest * x * dt)


class SimDrafts:
    """One replica's draft state (the round's schedule, sources and prompts' texts) and
    its draws; see the module docstring."""

    def __init__(self, spec: SimSpec) -> None:
        self.model = spec.model
        self.rng = np.random.default_rng(spec.seed)
        self.schedule: tuple[tuple[int, int, int], ...] = ((1, 1 << 30, 0),)
        self.sources: frozenset[DraftSource] = frozenset()
        # prompt token ids -> the sources it has a text of, by key length
        self.prompts: dict[int, dict[tuple[int, ...], set[DraftSource]]] = {}
        # Bumped whenever a row's prompt may map elsewhere: rows look theirs up again.
        self.epoch = 0
        self.cut: dict[str, tuple[int, ...]] = {}
        self._pmf: dict[tuple[DraftSource, int], np.ndarray] = {}

    def set_round(self, schedule: Sequence[tuple[int, int, int]], sources: Sequence[DraftSource],
                  prompts: Sequence[PromptDrafts]) -> None:
        bands = tuple((int(lo), int(hi), int(k)) for lo, hi, k in schedule)
        if not bands or bands[0][0] != 1 or any(k < 0 for _, _, k in bands):
            raise ValueError(f"a schedule starts at batch size 1 with k >= 0, got {list(schedule)}")
        self.schedule, self.sources = bands, frozenset(sources)
        self.prompts = {}
        self.epoch += 1
        self.add(prompts)

    def add(self, prompts: Sequence[PromptDrafts]) -> None:
        for p in prompts:
            by_key = self.prompts.setdefault(len(p.prompt), {})
            texts = by_key.get(p.prompt)
            if texts is None:
                texts = by_key[p.prompt] = set()
                self.epoch += 1
            before = len(texts)
            texts.update(d.source for d in p.drafts if d.token_ids)
            if len(texts) != before:
                self.epoch += 1  # rows of the prompt may draft from a better source now

    def texts_of(self, prompt_ids: tuple[int, ...]) -> set[DraftSource] | None:
        """The texts of the longest registered prompt `prompt_ids` starts with."""
        for n in sorted(self.prompts, reverse=True):
            if n <= len(prompt_ids):
                got = self.prompts[n].get(prompt_ids[:n])
                if got is not None:
                    return got
        return None

    def source(self, texts: set[DraftSource] | None) -> DraftSource | None:
        """The best-ranked source a row with these texts drafts from this round."""
        if not texts:
            return None
        usable = texts & self.sources
        return min(usable) if usable else None

    def k_for(self, batch: int) -> int:
        for lo, hi, k in self.schedule:
            if lo <= batch <= hi:
                return k
        return self.schedule[-1][2]

    def keep_cut(self, rid: str, produced: int) -> None:
        """An aborted request's partial response (a placeholder as long as it had, up to
        `TEXT_TOKENS`), handed back with the next counters."""
        if produced > 0:
            self.cut[rid] = tuple(range(min(produced, TEXT_TOKENS)))

    def take_cut(self) -> dict[str, tuple[int, ...]]:
        cut, self.cut = self.cut, {}
        return cut

    def next(self, rows: Sequence[Row], chunk_left: int, kv_room: int | None) -> Verifies | None:
        """The verifies of the running `rows`' next steps, up to the next delta
        (`chunk_left` steps), a row that does not draft reaching its end, or the KV cache
        (`kv_room` tokens) filling; None where the plan does not draft at this batch size
        or no row has a text to draft from (a token a step)."""
        n = len(rows)
        k = self.k_for(n)
        if k < 1:
            return None
        for row in rows:
            if row.texts_epoch != self.epoch:
                row.texts, row.texts_epoch = self.texts_of(row.request.prompt_token_ids), self.epoch
                row.draft = self.source(row.texts)
        sources = [row.draft for row in rows]
        left = [r.stop - r.produced for r in rows]
        remaining = np.asarray(left, dtype=np.int64)
        limit = min([chunk_left, *(x for x, s in zip(left, sources) if s is None)])
        if kv_room is not None:
            limit = min(limit, max(1, kv_room // (n * (k + 1))))
        return self.draw(sources, remaining, k, limit)

    def draw(self, sources: Sequence[DraftSource | None], remaining: np.ndarray, k: int,
             max_steps: int) -> Verifies | None:
        """The verifies of the batch's next steps, up to `max_steps` (>= 1): rows drafting
        from `sources` (None: not drafting), `remaining` tokens each before its end. None
        when no row drafts (k = 0 or no source)."""
        drafting = [i for i, s in enumerate(sources) if s is not None]
        if k < 1 or not drafting:
            return None
        idx = np.asarray(drafting)
        safe = int(((remaining[idx] - 1) // (k + 1)).min())
        steps = min(max_steps, safe) if safe >= 1 else 1
        accepted = np.zeros(len(sources), dtype=np.int64)
        by_pos = np.zeros(k, dtype=np.int64)
        by_source: dict[DraftSource, tuple[int, int]] = {}
        for src in sorted({s for s in sources if s is not None}):
            rows = np.asarray([i for i in drafting if sources[i] is src])
            pmf = self._pmf_of(src, k)
            if safe >= 1:
                counts = self.rng.multinomial(steps, pmf, size=len(rows))
                got = counts @ np.arange(k + 1)
                per_j = counts.sum(axis=0)
            else:
                got = np.minimum(self.rng.choice(k + 1, size=len(rows), p=pmf), remaining[rows] - 1)
                per_j = np.bincount(got, minlength=k + 1)
            accepted[rows] = got
            # a verify that accepted j tokens accepted one at each position up to j
            by_pos += np.cumsum(per_j[::-1])[::-1][1:]
            by_source[src] = (len(rows), int(got.sum()))
        return Verifies(steps, k, len(drafting), accepted, by_pos, by_source)

    def _pmf_of(self, source: DraftSource, k: int) -> np.ndarray:
        key = (source, k)
        got = self._pmf.get(key)
        if got is None:
            p = np.asarray(self.model.pmf(source, k))
            got = self._pmf[key] = p / p.sum()
        return got
