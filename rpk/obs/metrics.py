"""Metrics are data: one flat record per step (and one per validation), written as a
JSON line and handed to the configured trackers; the console summary reads the same
records."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from rpk.core.records import FinishReason, RoundKind
from rpk.loop.step import StepOutcome
from rpk.obs.trackers import Note, Tracker, close_all, describe


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[rank - 1])


def bubble_ratio(
    timeline: Sequence[tuple[float, int]], start: float, end: float, capacity: int
) -> float:
    """1 - (time-averaged requests in flight, capped at the engine's concurrency) /
    concurrency over [start, end]: the share of decode slots left idle while the round
    waited for its last responses."""
    span = end - start
    if span <= 0 or capacity <= 0:
        return 0.0
    busy = 0.0
    prev_t, prev_n = start, 0
    for t, n in timeline:
        busy += min(prev_n, capacity) * (t - prev_t)
        prev_t, prev_n = t, n
    busy += min(prev_n, capacity) * (end - prev_t)
    return max(0.0, 1.0 - busy / (capacity * span))


def step_record(outcome: StepOutcome, capacity: int) -> dict[str, Any]:
    r = outcome.round
    members = [m for g in r.groups for m in g.members]
    rewards = [m.reward for m in members]
    lengths = [len(m.response.token_ids) for m in members]
    record: dict[str, Any] = {
        "step": outcome.step,
        "round_kind": r.plan.kind,
        "version": outcome.version,
        "prompts": len(r.groups),
        "responses": len(members),
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "accuracy": statistics.fmean(float(m.correct) for m in members) if members else 0.0,
        "reward_errors": sum(1 for m in members if m.error),
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_len_p50": percentile(lengths, 50),
        "response_len_p90": percentile(lengths, 90),
        "response_len_max": max(lengths, default=0),
        "truncated_frac": (
            sum(1 for m in members if m.response.finish_reason is FinishReason.LENGTH) / len(members)
            if members
            else 0.0
        ),
        "requests_launched": r.launched,
        "requests_aborted": r.aborted,
        "tokens_generated": r.tokens_generated,
        "tokens_wasted": r.tokens_wasted,
        "tokens_carried": r.tokens_carried,
        "tokens_off_policy": r.tokens_off_policy,
        "groups_dropped": len(r.dropped),
        "prompts_incomplete": len(r.incomplete),
        # A round that launches fewer requests than the engine's limit could never fill
        # it: the bubble is what the round's own tail leaves idle.
        "bubble_ratio": bubble_ratio(
            r.timeline, r.started_at, r.last_response_at, min(capacity, r.launched)
        ),
        "time_rollout_s": outcome.time_rollout_s,
        "time_reward_s": r.reward_busy_s,
        "time_reward_exposed_s": r.reward_exposed_s,
        "time_train_s": outcome.time_train_s,  # exposed: after rollout ended
        "time_train_busy_s": outcome.time_train_busy_s,
        "time_train_hidden_s": outcome.time_train_hidden_s,
        "train_hidden_frac": (
            outcome.time_train_hidden_s / outcome.time_train_busy_s
            if outcome.time_train_busy_s > 0
            else 0.0
        ),
        "time_sync_s": outcome.time_sync_s,
        "time_step_s": outcome.time_step_s,
        "tokens_per_s": (
            r.tokens_generated / outcome.time_rollout_s if outcome.time_rollout_s > 0 else 0.0
        ),
    }
    record.update({f"train_{k}": float(v) for k, v in outcome.train.items()})
    return record


class MetricsWriter:
    """Appends records to `metrics.jsonl` (flushed per line, so a crash loses at most
    the step in progress) and hands their scalars, the config and sample texts to every
    tracker (`rpk.obs.trackers`). A tracker that fails mid-run is reported once through
    `note` and dropped; the file goes on."""

    def __init__(
        self, run_dir: Path, trackers: Sequence[Tracker] = (), note: Note = print
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._trackers = list(trackers)
        self._note = note

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._trackers):
            try:
                call(tracker)
            except Exception as e:  # a tracker's failure must not stop training
                self._trackers.remove(tracker)
                self._note(f"tracker {tracker.name} failed ({describe(e)}); dropped")
                close_all([tracker], self._note)

    def write(self, record: Mapping[str, Any]) -> None:
        """One line of `metrics.jsonl`; its numbers go to the trackers at its step."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {
            k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
        }
        self._each(lambda t: t.log_scalars(record["step"], scalars))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each(lambda t: t.log_config(config))

    def log_texts(self, step: int, rows: Sequence[Mapping[str, Any]], tag: str = "samples") -> None:
        """A table of texts at `step` (prompts, responses, verdicts), to the trackers."""
        if rows:
            self._each(lambda t: t.log_texts(step, rows, tag))

    def write_timeline(self, outcome: StepOutcome, capacity: int) -> None:
        """Requests in flight over the round (seconds from its start), one line per
        round in `timeline.jsonl`: what the plots draw the bubble from."""
        r = outcome.round
        line = {
            "step": outcome.step,
            "round_kind": r.plan.kind,
            "capacity": capacity,
            "slots": min(capacity, r.launched),  # what bubble_ratio measures against
            "t": [round(t - r.started_at, 4) for t, _ in r.timeline],
            "in_flight": [n for _, n in r.timeline],
        }
        with (self.path.parent / "timeline.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
        trackers, self._trackers = self._trackers, []
        close_all(trackers, self._note)


def read_records(path: Path, phase: str = "train") -> list[dict[str, Any]]:
    """The records of one phase: "train" (the step records) or "eval" (validation,
    `rpk.obs.validation`), which share `metrics.jsonl`."""
    with path.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("phase", "train") == phase]


def summarize(records: Iterable[Mapping[str, Any]], window: int = 3) -> dict[str, float]:
    """First-vs-last reward and time totals: what the end-of-run table shows.

    Reward compares like with like: long rounds hold only the hardest prompts (tail
    batching's queue), so they are left out of the first/last windows when the run has
    other rounds."""
    recs = list(records)
    if not recs:
        return {}
    comparable = [r for r in recs if r.get("round_kind") != RoundKind.LONG] or recs
    first = comparable[:window]
    last = comparable[-window:]
    return {
        "steps": float(len(recs)),
        "reward_first": statistics.fmean(r["reward_mean"] for r in first),
        "reward_last": statistics.fmean(r["reward_mean"] for r in last),
        "accuracy_first": statistics.fmean(r["accuracy"] for r in first),
        "accuracy_last": statistics.fmean(r["accuracy"] for r in last),
        "time_step_s_median": statistics.median(r["time_step_s"] for r in recs),
        "time_rollout_s_total": sum(r["time_rollout_s"] for r in recs),
        "time_train_s_total": sum(r["time_train_s"] for r in recs),
        "time_sync_s_total": sum(r["time_sync_s"] for r in recs),
        "tokens_generated_total": float(sum(r["tokens_generated"] for r in recs)),
    }
