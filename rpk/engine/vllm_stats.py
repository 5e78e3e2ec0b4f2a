"""Per-replica scheduler statistics out of vLLM: a stat logger (vLLM calls it in rpk's
process, after every engine step) feeding counters that the fleet reads once per round.

vLLM reports, per step, the requests it preempted for want of KV cache
(`IterationStats.num_preempted_reqs`), the tokens it generated
(`IterationStats.num_generation_tokens`) and the share of KV cache in use
(`SchedulerStats.kv_cache_usage`), and with speculative decoding the drafts it
verified (`SchedulerStats.spec_decoding_stats`: rows, draft tokens, accepted ones by
draft position). Passing a logger turns vLLM's statistics on even with its default
loggers off (`disable_log_stats`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rpk.core.drafts import SpecStats
from rpk.core.records import ReplicaStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ReplicaCounters:
    """Running totals of one replica (a vLLM engine's, fed by its stat logger, or a
    simulated one's); `take` reads them since its last call."""

    def __init__(self) -> None:
        self.preemptions = 0
        self.generated = 0
        self.kv_usage = 0.0  # the last step's
        self._kv_peak = 0.0
        self._taken_preemptions = 0
        self._taken_generated = 0
        self.spec = SpecStats()  # since `take_spec` was last called

    def record(self, preempted: int, kv_usage: float | None, generated: int = 0,
               spec: SpecStats | None = None) -> None:
        self.preemptions += preempted
        self.generated += generated
        if kv_usage is not None:
            self.kv_usage = kv_usage
            self._kv_peak = max(self._kv_peak, kv_usage)
        if spec is not None:
            self.spec = self.spec.plus(spec)

    def take_spec(self) -> SpecStats:
        """Speculative decoding's counts since the last call (a reader of its own: the
        round statistics `take` gives are read by another)."""
        spec, self.spec = self.spec, SpecStats()
        return spec

    def take(self) -> ReplicaStats:
        stats = ReplicaStats(
            self.preemptions - self._taken_preemptions, self._kv_peak,
            self.generated - self._taken_generated,
        )
        self._taken_preemptions = self.preemptions
        self._taken_generated = self.generated
        self._kv_peak = self.kv_usage
        return stats


def stat_logger_factory(counters: ReplicaCounters) -> Callable[[VllmConfig, int], Any]:
    """What `AsyncLLM.from_engine_args(stat_loggers=[...])` takes: called with
    (vllm_config, engine_index), it returns a logger that feeds `counters`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CountingLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self.clock = StepClock()

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            generated = iteration_stats.num_generation_tokens if iteration_stats is not None else 0
            spec = spec_step(scheduler_stats, generated)
            if spec is not None:
                ran = scheduler_stats.num_running_reqs + spec.draft_tokens + (
                    iteration_stats.num_prompt_tokens if iteration_stats is not None else 0)
                spec = self.clock.step(time.monotonic(), ran, spec)
            else:
                self.clock.idle()
            counters.record(
                iteration_stats.num_preempted_reqs if iteration_stats is not None else 0,
                scheduler_stats.kv_cache_usage if scheduler_stats is not None else None,
                generated, spec,
            )

        def log_engine_initialized(self) -> None:
            return None

    return _CountingLogger


def spec_step(scheduler_stats: Any, generated: int) -> SpecStats | None:
    """One engine step's speculative decoding as a `SpecStats` (None: no step ran)."""
    if scheduler_stats is None or not generated:
        return None
    sd = scheduler_stats.spec_decoding_stats
    if sd is None or not sd.num_drafts:
        return SpecStats(steps=1)
    return SpecStats(
        drafts=sd.num_drafts, draft_tokens=sd.num_draft_tokens, accepted=sd.num_accepted_tokens,
        drafted_by_pos=tuple(sd.num_draft_tokens_per_pos), accepted_by_pos=tuple(sd.num_accepted_tokens_per_pos),
        spec_steps=1, spec_step_tokens=generated, spec_step_rows=scheduler_stats.num_running_reqs, steps=1,
    )


# A gap between two steps' outputs longer than this is the engine idling, not a step.
_MAX_STEP_S = 0.5


class StepClock:
    """Each engine step's seconds, read as the time between two consecutive steps'
    outputs (the engine starts a step as soon as it has emitted the last one), against
    the tokens the step ran: what the speculative tail's plan fits its step cost on
    (`rpk.sched.speculate`), the steps that verified drafts apart from the others."""

    def __init__(self) -> None:
        self.last: float | None = None

    def idle(self) -> None:
        self.last = None

    def step(self, now: float, ran: int, spec: SpecStats) -> SpecStats:
        last, self.last = self.last, now
        if last is None or not 0 < now - last <= _MAX_STEP_S or ran <= 0:
            return spec
        x, y = float(ran), now - last
        if spec.spec_steps:
            # A verifying step pays more than its tokens (vLLM's rejection sampler and
            # its spec bookkeeping): kept apart, it is the plan's verify cost.
            return dataclasses.replace(spec, verify_fit=(1.0, x, y))
        return dataclasses.replace(spec, step_fit=(1.0, x, y, x * x, x * y))
