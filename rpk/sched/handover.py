"""Which rows of a round's tail go to the speculating twins: pure policy over numbers.

With speculating twins (`rpk.engine.vllm_fleet`) a round runs on the plain replicas,
and its tail may move to a twin that decodes it with drafts. That pays only where two
things hold:

- the row has a text to draft from (a finished sibling, an aborted partial, an earlier
  epoch's response): a row without one gains nothing on the twin and pays its every
  step, so it stays on the plain replica;
- the measured gain covers the twin's own cost. A speculating engine pays more per step
  than a plain one whether it drafts or not (on the CPU engine, `bench/spec_step_cost.py`:
  +22-39% a step), and verifying costs more again; a verify of k drafts yields `tau(k)`
  tokens a row. Both come from the run's own measurements: the twin's verifying steps
  timed against the plain replicas' line (`TwinCost`), and the acceptance of the round's
  kind (`rpk.sched.speculate.Speculation.acceptance`).

A twin runs at its plain replica's place, on the same devices, so while both have rows
their steps take turns: a row left on the plain replica then waits for the twin's step
too. The round ends with its last row, and which row that is is not known, so the
predicted gain is the slower group's speed-up: a split only pays where the devices are
not shared (`shared` False), and on a shared place the tail moves once every row left
has a text. Before anything is measured, the twin's step is priced at
`rpk.sched.speculate.PRIOR_TWIN_RATIO` the plain one's; a kind whose hand-over was
declined some rounds running is handed over anyway once (`explore`,
`Speculation.explore_due`), so a cost measured in a bad moment is measured again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from rpk.sched.speculate import Acceptance, TwinCost


@dataclass(frozen=True, slots=True)
class HandOverPlan:
    """One decision over the rows in flight on the plain replicas."""

    rows: int  # in flight on the plain replicas
    with_texts: int  # of them, rows whose prompt has a text to draft from
    hand: tuple[str, ...]  # the request ids to move to the twins (empty: none)
    k: int  # the twins' draft length at that many rows
    tau: float  # tokens a handed row is expected to gain per verify
    gain: float  # predicted speed-up of the tail's slower group (1.0 where none moves)
    explore: bool = False  # handed over without paying, to measure again

    @property
    def hands(self) -> bool:
        return bool(self.hand)


def rows_with_texts(rows: Mapping[str, tuple[int, ...]], texts: Collection[tuple[int, ...]]) -> list[str]:
    """The request ids whose prompt tokens start with a prompt that has a text (a
    trajectory's later turn carries its earlier turns after its prompt)."""
    lengths = sorted({len(t) for t in texts})
    keys = set(texts)
    return [rid for rid, tokens in rows.items() if any(tuple(tokens[:n]) in keys for n in lengths
                                                        if n <= len(tokens))]


def tail_gain(cost: TwinCost, rows: int, handed: int, k: int, tau: float, shared: bool) -> float:
    """The speed-up of the slower group of rows if `handed` of the `rows` move to the
    twins (drafting `k`, gaining `tau` tokens a verify) and the rest stay plain."""
    if not 0 < handed <= rows or k < 1:
        return 1.0
    stay = cost.plain.seconds(rows, 0)
    twin = cost.twin_seconds(handed, k)
    left = rows - handed
    rest = cost.plain.seconds(left, 0) if left else 0.0
    if shared:
        twin = rest = twin + rest  # their steps take turns on the same devices
    handed_gain = tau * stay / twin
    return min(handed_gain, stay / rest) if left else handed_gain


def decide(rows: Mapping[str, tuple[int, ...]], texts: Collection[tuple[int, ...]], cost: TwinCost,
           k_for: Callable[[int], int], acceptance: Acceptance, min_gain: float, shared: bool,
           explore: bool = False) -> HandOverPlan:
    """Hand the rows with texts over where the predicted gain reaches `min_gain` (or
    `explore`), at the draft length the twins' plans have for that many rows (`k_for`)
    and the tokens a verify of it yields at `acceptance`; rows without a text always
    stay."""
    drafting = rows_with_texts(rows, texts)
    k = k_for(len(drafting)) if drafting else 0
    tau = acceptance.tokens_per_verify(k)
    gain = tail_gain(cost, len(rows), len(drafting), k, tau, shared)
    go = bool(drafting) and k > 0 and (gain >= min_gain or explore)
    return HandOverPlan(len(rows), len(drafting), tuple(drafting) if go else (), k, tau, gain,
                        explore=go and gain < min_gain)


def tail_window_s(timeline: Sequence[tuple[float, int]], at: int) -> float:
    """Seconds of a round (its `(time, requests in flight)` steps) with 1 to `at`
    requests in flight: the share of its rollout the twins could have run."""
    return sum(t1 - t0 for (t0, n), (t1, _) in zip(timeline, timeline[1:]) if 0 < n <= at)
