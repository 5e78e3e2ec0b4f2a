"""Elastic rollout TP between rounds: the planner (`rpk.sched.tp_planner`, pure) told
what each round saw, and the fleet regrouped to the TP it picks for the next round.

`RolloutTP` is `run_step`'s `between`. `after_round` reads the fleet's per-replica
statistics for the round that just ended and feeds the planner; the policy says what
kind the next round is, so if the planner wants another TP for it the fleet regroups
right there, in place of the step's weight sync: the new weights go straight into the
woken layout, and the layout put to sleep (its weights dropped) is never loaded with
weights it would drop. `before_round` regroups only where that did not happen (the
first round, a resumed run). `record` gives the step's metrics. With `rollout.tp
fixed` the planner never moves, and the metrics are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rpk.core.outcomes import RegroupReport, RoundPlan, RoundResult, StepOutcome
from rpk.core.protocols import ElasticFleet, StepTrainer
from rpk.core.records import ReplicaStats, RoundKind
from rpk.loop.step import Weights
from rpk.loop.trainer import WeightTally
from rpk.sched.tp_planner import RoundLoad, TPDecision, TPPlanner


class RolloutTP:
    def __init__(
        self,
        planner: TPPlanner,
        fleet: ElasticFleet,
        trainer: StepTrainer,
        bucket_bytes: int,
        say: Callable[[str], None] = lambda line: None,
        last_step: int | None = None,
    ) -> None:
        self.planner = planner
        self.last_step = last_step  # no regroup for a round after it
        self.fleet = fleet
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes
        self.say = say
        # This step's: what the round saw, and the regroups made (before the round,
        # and for the next round in place of the sync).
        self._seen: tuple[RoundLoad, TPDecision, Mapping[str, ReplicaStats]] | None = None
        self._regroups: list[tuple[str, RegroupReport, WeightTally]] = []

    async def before_round(self, plan: RoundPlan) -> None:
        # What the engine did between rounds (a validation pass) is not the round's.
        self.fleet.take_round_stats()
        self._seen, self._regroups = None, []
        tally = WeightTally()
        await self._regroup(
            self.planner.decide(plan.kind), f"step {plan.step} ({plan.kind.value} round)",
            "before_round", lambda: tally.count(self.trainer.weight_buckets(self.bucket_bytes)),
            tally,
        )

    async def after_round(
        self, result: RoundResult, rollout_s: float, next_kind: RoundKind,
        weights: Weights, version: int,
    ) -> bool:
        """The round's per-replica statistics into the planner; then, if the next round
        of `next_kind` runs at another TP, the regroup that also syncs `version`."""
        stats = self.fleet.take_round_stats()
        # The engine's own count: the loop sees no tokens of a request aborted before
        # its single final output.
        load = RoundLoad(
            kind=result.plan.kind,
            tp=self.fleet.tp,
            preemptions=sum(s.preemptions for s in stats.values()),
            kv_usage_max=max((s.kv_usage_max for s in stats.values()), default=0.0),
            requests=result.launched,
            seconds=rollout_s,
            tokens=sum(s.tokens_generated for s in stats.values()),
        )
        decision = self.planner.observe(load)
        self._seen = (load, decision, stats)
        step = result.plan.step
        if decision.changed or "slower" in decision.reason:
            self.say(f"step {step}: {decision.reason}")
        if step == self.last_step:
            return False
        tally = WeightTally()
        return await self._regroup(
            self.planner.decide(next_kind), f"step {step}, for the next ({next_kind.value}) round",
            "sync", lambda: tally.count(weights()), tally, version,
        )

    async def _regroup(
        self, tp: int, when: str, at: str, weights: Weights, tally: WeightTally,
        version: int | None = None,
    ) -> bool:
        if tp == self.fleet.tp:
            return False
        report = await self.fleet.regroup(tp, weights, version)
        self._regroups.append((at, report, tally))
        self.say(
            f"{when}: regrouped tp {report.from_tp} -> {report.to_tp} in {report.seconds:.2f}s"
            + (f", {report.synced} replica(s) synced ({tally.bytes / 2**20:.1f} MiB)" if report.synced else "")
            + (", restarted" if report.restarted else "")
        )
        return True

    def record(self, outcome: StepOutcome) -> dict[str, Any]:
        """The step's metrics: the round's TP and statistics, the planner's decision,
        the regroups made."""
        if self._seen is None:
            raise RuntimeError(f"step {outcome.step}: record before after_round")
        load, decision, stats = self._seen
        r = outcome.round
        kept = r.tokens_generated - r.tokens_wasted
        record: dict[str, Any] = {
            "tokens_generated": load.tokens,
            # Wasted is what the round did not keep.
            "tokens_wasted": max(0, load.tokens - kept),
            "tokens_per_s": load.tokens / load.seconds if load.seconds > 0 else 0.0,
            "tp": load.tp,
            "replicas": len(stats),
            "preemptions": load.preemptions,
            "kv_usage_max": load.kv_usage_max,
            "tp_next": decision.tp,
            "tp_reason": decision.reason,
            "version_served": self.fleet.version,
            "regroups": len(self._regroups),
            "time_regroups_s": sum(report.seconds for _, report, _ in self._regroups),
        }
        for name, s in stats.items():
            record[f"preemptions/{name}"] = s.preemptions
            record[f"kv_usage_max/{name}"] = s.kv_usage_max
        if self._regroups:
            at, report, tally = self._regroups[-1]
            record.update({
                "regroup_at": at,
                "regroup_from_tp": report.from_tp,
                "regroup_to_tp": report.to_tp,
                "regroup_sync_bytes": tally.bytes,
                "regroup_sync_buckets": tally.buckets,
                "regroup_restarted": int(report.restarted),
            })
        return record
