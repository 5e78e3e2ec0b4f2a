"""The speculative tail's async side: the draft texts into the replicas around each
round, and what the round's speculation did out of them.

Before a round, each replica gets its draft-length schedule (`Speculation.plan`: k by
batch size, from the measured cost curve and acceptance for the round's kind on that
replica; k = 0 everywhere when it does not pay) and the round's prompts with their
stored texts (partials, earlier epochs). vLLM fixes `num_speculative_tokens` when the
engine starts; the schedule below it is rpk's proposer's, replaced every round, so
re-planning costs a `collective_rpc`, not a restart. During the round every finished
response goes out as a draft for its siblings still running (`finished` queues it,
`feed` sends what has queued in one call). After it, the replicas' counters feed the
plan and the step's record.

With speculating twins (a plain replica beside each speculating one: vLLM pays for
speculation every step once it is configured, drafts or not), the round runs on the
plain replicas, and once no more requests are in flight there than the largest batch
the twins' plans draft at, the feed hands the tail over (`Fleet.hand_over`: each
request continues on a twin with its tokens).

The feed is the only task here: `run_step` starts it in the step's TaskGroup and
`end_round` lets it drain and return. Its queue is bounded; a sibling that does not fit
is dropped (and counted): a draft is an optimisation, never a result.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rpk.core.drafts import Draft, DraftSource, PromptDrafts, SpecStats
from rpk.core.outcomes import MigrationReport, RoundPlan, RoundResult
from rpk.core.protocols import Speculating
from rpk.core.records import Prompt, Response, RoundKind
from rpk.sched.speculate import PRIOR_COST, DraftPlan, Speculation, StepCost, reached_by_position

# Finished siblings waiting for the feed's next call, at most.
_PENDING = 4096


@dataclass(frozen=True, slots=True)
class _Seen:
    """One round's speculation: its kind, each replica's plan and counters, the step
    cost the plans were made with (measured or not) and the siblings dropped."""

    kind: RoundKind
    plans: dict[str, DraftPlan]
    stats: dict[str, SpecStats]
    cost: StepCost | None
    dropped: int
    moved: MigrationReport | None  # the tail handed over to the speculating twins


class SpecTail:
    """Drives `speculation` on `fleet` around each round; see the module docstring."""

    def __init__(self, speculation: Speculation, fleet: Speculating, max_pending: int = _PENDING) -> None:
        self.speculation = speculation
        self.fleet = fleet
        self.max_pending = max_pending
        self._plans: dict[str, DraftPlan] = {}
        self._sources: frozenset[DraftSource] = frozenset()  # this round's, as the plan keeps them
        self._pending: list[PromptDrafts] = []
        self._wake = asyncio.Event()
        self._closed = True
        self._dropped = 0
        self._tail_at = 0
        self._hand = False  # the tail is small enough: hand it over (`feed` does)
        self._moved: MigrationReport | None = None
        self._seen: _Seen | None = None

    @property
    def speculates(self) -> bool:
        """Whether some replica's plan for this round drafts at all."""
        return any(p.speculates for p in self._plans.values())

    async def before_round(self, plan: RoundPlan) -> None:
        """Plan each replica's draft lengths for the round and send them its drafts."""
        spec = self.speculation
        await self.fleet.take_spec_stats()  # what ran between rounds (validation) is no round's
        targets = self.fleet.draft_targets()
        self._plans = {name: spec.plan(plan.kind, name, batch, len(targets)) for name, batch in targets.items()}
        self._sources = spec.sources_for(plan.kind)
        self._pending, self._dropped, self._closed = [], 0, False
        self._wake.clear()
        self.fleet.settle()
        # With twins: the round's tail goes to them once no more requests run than the
        # largest batch their plans draft at.
        self._tail_at = max((hi for p in self._plans.values() for _, hi, k in p.bands if k > 0), default=0)
        self._hand, self._moved = False, None
        prompts = plan.drafts or tuple(PromptDrafts(p.token_ids, ()) for p in plan.prompts)
        await self.fleet.set_drafts({n: p.schedule() for n, p in self._plans.items()},
                                    sorted(self._sources), prompts)

    def finished(self, response: Response) -> None:
        """A response finished: a draft for its prompt's requests still running."""
        self.turn(response.prompt, response.token_ids)

    def turn(self, prompt: Prompt, tokens: tuple[int, ...]) -> None:
        """A response, or a trajectory so far (its turns and observations: the agent
        engine's `on_turn`), is a draft for its prompt's requests further behind; and
        one request fewer in flight may make the tail small enough to hand over."""
        if self._closed or not self.speculates:
            return
        left = self.fleet.tail_in_flight()
        if left is not None and not self._hand and left <= self._tail_at:
            self._hand = True
            self._wake.set()
        if DraftSource.SIBLING not in self._sources:
            return
        if len(self._pending) >= self.max_pending:
            self._dropped += 1
            return
        self._pending.append(PromptDrafts(prompt.token_ids, (Draft(DraftSource.SIBLING, tokens),)))
        self._wake.set()

    async def feed(self) -> None:
        """Send the queued siblings as they come, in one call per batch, until the round
        ends (`end_round`)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._hand and self._moved is None and not self._closed:
                self._moved = await self.fleet.hand_over()
            batch, self._pending = self._pending, []
            if batch:
                await self.fleet.add_drafts(batch)
            if self._closed and not self._pending:
                return

    def end_round(self) -> None:
        """The round is over: the feed sends what is left and returns."""
        self._closed = True
        self._wake.set()

    async def after_round(self, result: RoundResult) -> None:
        """What each replica's speculation did in the round, into the plan state."""
        stats = dict(await self.fleet.take_spec_stats())
        cut: dict[str, tuple[int, ...]] = {}
        for s in stats.values():
            cut.update(s.cut)
        self.speculation.observe_cut(result, cut)
        self.speculation.observe_stats(result.plan.kind, stats)
        costs = [self.speculation.step_cost(name, len(stats)) for name in stats]
        measured = [c for c in costs if c is not PRIOR_COST]
        self.fleet.settle()
        self._seen = _Seen(result.plan.kind, dict(self._plans), stats, measured[0] if measured else None,
                           self._dropped, self._moved)

    def record(self) -> dict[str, float]:
        """The step's speculation columns (`docs/metrics.md`)."""
        if self._seen is None:
            return {}
        seen = self._seen
        total = SpecStats()
        for s in seen.stats.values():
            total = total.plus(s)
        k_max = max((p.max_k for p in seen.plans.values()), default=0)
        out: dict[str, float] = {
            "spec_k_max": float(k_max),
            # the largest batch that drafted: the timeline shades where fewer ran
            "spec_batch_max": float(max((hi for p in seen.plans.values() for _, hi, k in p.bands if k > 0),
                                        default=0)),
            "spec_drafts": float(total.drafts),
            "spec_draft_tokens": float(total.draft_tokens),
            "spec_accepted": float(total.accepted),
            "tokens_per_verify": total.tokens_per_verify,
            "spec_steps": float(total.spec_steps),
            "spec_feed_dropped": float(seen.dropped),
            "spec_handed_over": float(seen.moved.requests) if seen.moved is not None else 0.0,
            "spec_hand_over_s": seen.moved.seconds if seen.moved is not None else 0.0,
        }
        reached = reached_by_position(total.drafts, total.drafted_by_pos, total.accepted_by_pos)
        for i, (r, a) in enumerate(zip(reached, total.accepted_by_pos), start=1):
            if r:
                out[f"spec_accept_pos{i}"] = a / r
        drafted = sum(c.tokens for c in total.by_source.values())
        for source, c in sorted(total.by_source.items()):
            out[f"spec_share_{source.label}"] = c.tokens / drafted if drafted else 0.0
            out[f"spec_accept_{source.label}"] = c.accepted / c.tokens if c.tokens else 0.0
        if seen.cost is not None:
            out["spec_tail_s_saved"] = tail_seconds_saved(total, seen.cost)
            # the measured step cost the next round plans with
            out["spec_cost_fixed_s"] = seen.cost.fixed_s
            out["spec_cost_token_s"] = seen.cost.per_token_s
            out["spec_cost_verify_s"] = seen.cost.verify_s
        return out


def tail_seconds_saved(stats: SpecStats, cost: StepCost) -> float:
    """An estimate of the seconds speculation saved: its verify steps ran n rows each
    gaining `tau` tokens (their means), which plain decoding would have taken `tau`
    steps at batch n for, less what the draft tokens verified and the verifying itself
    (`verify_s` a step) added to those steps."""
    if not stats.spec_steps or not stats.spec_step_rows:
        return 0.0
    n = stats.spec_step_rows / stats.spec_steps
    tau = stats.spec_step_tokens / stats.spec_step_rows
    plain = cost.fixed_s + cost.per_token_s * n
    return stats.spec_steps * ((tau - 1) * plain - cost.verify_s) - cost.per_token_s * stats.draft_tokens
