"""Elastic rollout TP between rounds: the planner (`rpk.sched.tp_planner`, pure) told
what each round saw, and the fleet regrouped to the TP it picks for the next round.

`RolloutTP.before_round` is `run_step`'s hook: the round is planned, so its kind is
known; if the planner wants another TP for that kind, the fleet regroups (the woken
layout gets the trainer's current weights) before the round starts. `after_round`
reads the fleet's per-replica statistics for the round, feeds the planner, and returns
the step's metrics. With `rollout.tp fixed` the planner never moves, and the metrics
are the same.
"""

from __future__ import annotations

from typing import Any, AsyncIterable, Callable, Mapping, Protocol

from rpk.core.protocols import WeightBucket
from rpk.core.records import ReplicaStats
from rpk.loop.step import AsyncTrainer, StepOutcome, WeightTally
from rpk.sched.round import RoundPlan
from rpk.sched.tp_planner import RoundLoad, TPPlanner


class Regrouped(Protocol):
    from_tp: int
    to_tp: int
    seconds: float
    synced: int
    restarted: bool


class ElasticEngine(Protocol):
    """What elastic TP needs of the engine (`rpk.engine.fleet.Fleet` has it)."""

    @property
    def tp(self) -> int: ...

    @property
    def version(self) -> int: ...

    async def regroup(
        self, tp: int, weights: Callable[[], AsyncIterable[WeightBucket]]
    ) -> Regrouped: ...

    def take_round_stats(self) -> Mapping[str, ReplicaStats]: ...


class RolloutTP:
    def __init__(
        self,
        planner: TPPlanner,
        fleet: ElasticEngine,
        trainer: AsyncTrainer,
        bucket_bytes: int,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.planner = planner
        self.fleet = fleet
        self.trainer = trainer
        self.bucket_bytes = bucket_bytes
        self.say = say
        self._regroup: tuple[Regrouped, WeightTally] | None = None

    async def before_round(self, plan: RoundPlan) -> None:
        # What the engine did between rounds (a validation pass) is not the round's.
        self.fleet.take_round_stats()
        tp = self.planner.decide(plan.kind)
        self._regroup = None
        if tp == self.fleet.tp:
            return
        tally = WeightTally()
        report = await self.fleet.regroup(
            tp, lambda: tally.count(self.trainer.weight_buckets(self.bucket_bytes))
        )
        self._regroup = (report, tally)
        self.say(
            f"step {plan.step} ({plan.kind.value} round): regrouped tp {report.from_tp} -> "
            f"{report.to_tp} in {report.seconds:.2f}s"
            + (f", {report.synced} replica(s) synced ({tally.bytes / 2**20:.1f} MiB)" if report.synced else "")
            + (", restarted" if report.restarted else "")
        )

    def after_round(self, outcome: StepOutcome) -> dict[str, Any]:
        """The round's per-replica statistics into the planner; the step's metrics."""
        stats = self.fleet.take_round_stats()
        # The engine's own count: the loop sees no tokens of a request aborted before
        # its single final output. Wasted is what the round did not keep.
        generated = sum(s.tokens_generated for s in stats.values())
        load = RoundLoad(
            kind=outcome.round.plan.kind,
            tp=self.fleet.tp,
            preemptions=sum(s.preemptions for s in stats.values()),
            kv_usage_max=max((s.kv_usage_max for s in stats.values()), default=0.0),
            requests=outcome.round.launched,
            seconds=outcome.time_rollout_s,
            tokens=generated,
        )
        decision = self.planner.observe(load)
        if decision.changed or "slower" in decision.reason:
            self.say(f"step {outcome.step}: {decision.reason}")
        r = outcome.round
        kept = r.tokens_generated - r.tokens_wasted
        record: dict[str, Any] = {
            "tokens_generated": generated,
            "tokens_wasted": max(0, generated - kept),
            "tokens_per_s": generated / outcome.time_rollout_s if outcome.time_rollout_s > 0 else 0.0,
            "tp": load.tp,
            "replicas": len(stats),
            "preemptions": load.preemptions,
            "kv_usage_max": load.kv_usage_max,
            "tp_next": decision.tp,
            "tp_reason": decision.reason,
            "version_served": self.fleet.version,
        }
        for name, s in stats.items():
            record[f"preemptions/{name}"] = s.preemptions
            record[f"kv_usage_max/{name}"] = s.kv_usage_max
        if self._regroup is not None:
            report, tally = self._regroup
            record.update({
                "regroup_from_tp": report.from_tp,
                "regroup_sync_bytes": tally.bytes,
                "regroup_sync_buckets": tally.buckets,
                "regroup_restarted": int(report.restarted),
            })
        return record
