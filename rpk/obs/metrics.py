"""Metrics are data: one flat record per step (and one per validation), written as a
JSON line and handed to the configured trackers; the console summary reads the same
records."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rpk.core.outcomes import StepOutcome
from rpk.core.records import FinishReason, Response, RoundKind, Scored
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


class HostCpu:
    """The host's CPU use between two laps, machine-wide, from /proc/stat: how much of
    all its cores were busy. On a CPU run rollout and training share the cores, so it
    says whether a policy left any idle; on a GPU box, how loaded the host is (reward
    workers, data). Where /proc/stat is absent (not Linux) a lap records nothing."""

    def __init__(self, path: Path = Path("/proc/stat")) -> None:
        self.path = path
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        """(busy, busy + idle) in clock ticks since boot; steal time, which the
        hypervisor gave to others, is neither."""
        try:
            with self.path.open() as f:
                fields = f.readline().split()
        except OSError:
            return None
        if len(fields) < 8 or fields[0] != "cpu":
            return None
        user, nice, system, idle, iowait, irq, softirq = (int(x) for x in fields[1:8])
        busy = user + nice + system + irq + softirq
        return busy, busy + idle + iowait

    def lap(self) -> dict[str, float]:
        """`host_cpu_busy_frac` since the last lap (or since this meter was made)."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return {}
        return {"host_cpu_busy_frac": (now[0] - last[0]) / (now[1] - last[1])}


def step_record(outcome: StepOutcome) -> dict[str, Any]:
    r, capacity, moved = outcome.round, outcome.capacity, outcome.migration
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
        "sync_bytes": outcome.sync_bytes,
        "sync_buckets": outcome.sync_buckets,
        "time_regroup_s": outcome.time_regroup_s,
        "borrow_frac": outcome.borrow_frac,
        # from the first abort to every moved request re-added
        "time_migrate_s": moved.move_s if moved else 0.0,
        "migrated_requests": moved.requests if moved else 0,
        "migrated_tokens": moved.tokens if moved else 0,
        "time_step_s": outcome.time_step_s,
        "tokens_per_s": (
            r.tokens_generated / outcome.time_rollout_s if outcome.time_rollout_s > 0 else 0.0
        ),
    }
    record.update(turn_metrics([m.response for m in members]))
    record.update(multi_call_reward(members))
    record.update({f"train_{k}": float(v) for k, v in outcome.train.items()})
    return record


def turn_metrics(responses: Sequence[Response]) -> dict[str, float]:
    """Multi-turn trajectories' turns and tool calls, and the share of their tokens out
    of the loss (observations); {} when no response is a trajectory (single-turn runs
    keep their record as it was)."""
    stats = [r.turns for r in responses if r.turns is not None]
    if not stats:
        return {}
    turns = [t.turns for t in stats]
    tokens = sum(len(r.token_ids) for r in responses)
    return {
        "turns_mean": statistics.fmean(turns),
        "turns_p50": percentile(turns, 50),
        "turns_max": float(max(turns)),
        "tool_calls": float(sum(t.tools.calls for t in stats)),
        "tool_failures": float(sum(t.tools.failures for t in stats)),
        "tool_seconds": sum(t.tools.seconds for t in stats),
        # Per trajectory, its calls' seconds together: the tail the scheduler plans for.
        "tool_s_p50": percentile([t.tools.seconds for t in stats], 50),
        "tool_s_p99": percentile([t.tools.seconds for t in stats], 99),
        "tool_queued_s": sum(t.tools.queued_s for t in stats),
        "masked_token_frac": (tokens - sum(r.trained() for r in responses)) / tokens if tokens else 0.0,
    }


def multi_call_reward(members: Sequence[Scored]) -> dict[str, float]:
    """The trajectories that called tools twice or more (a long sum's chunks, or a
    call made again after a failure) and their reward together: the part of an agentic
    task that single calls cannot show. The summary compares it over thirds of the run
    (`call_thirds`). {} for single-turn runs."""
    if not any(m.response.turns is not None for m in members):
        return {}
    multi = [m for m in members if m.response.turns is not None and m.response.turns.tools.calls >= 2]
    return {"multi_call_trajectories": float(len(multi)),
            "multi_call_reward_sum": float(sum(m.reward for m in multi))}


def pick_samples(outcome: StepOutcome, n: int) -> list[dict[str, Any]]:
    """Up to `n` of the step's trained responses, for a person to read: the shortest
    and the longest first (a short and a long one where the round has both), then
    others spread evenly over the rest by length."""
    members = sorted(
        (m for g in outcome.round.groups for m in g.members),
        key=lambda m: (len(m.response.token_ids), m.response.prompt.uid, m.response.index),
    )
    if not members or n <= 0:
        return []
    chosen = [0, len(members) - 1][: min(n, len(members))]
    rest = [i for i in range(1, len(members) - 1)]
    extra = min(n - len(chosen), len(rest))
    chosen += [rest[(k * len(rest)) // extra] for k in range(extra)] if extra > 0 else []
    rows = []
    for i in dict.fromkeys(chosen):
        m = members[i]
        rows.append({
            "step": outcome.step,
            "round_kind": outcome.round.plan.kind,
            "prompt": m.response.prompt.text,
            "response": m.response.text,
            "reward": m.reward,
            "correct": m.correct,
            "tokens": len(m.response.token_ids),
            "finish_reason": m.response.finish_reason,
            "data_source": m.response.prompt.data_source,
        })
    return rows


def keep_steps_up_to(path: Path, last_step: int) -> None:
    """Drop the lines of a run file written for steps after `last_step`: a resumed run
    redoes them from its checkpoint, so each step appears once, as the run that goes on
    produced it."""
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
        if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


RUN_FILES = ("metrics.jsonl", "timeline.jsonl", "samples.jsonl")


class MetricsWriter:
    """Appends records to `metrics.jsonl` (flushed per line, so a crash loses at most
    the step in progress), round timelines to `timeline.jsonl` and sampled responses to
    `samples.jsonl`, and hands scalars, the config and sample texts to every tracker
    (`rpk.obs.trackers`). A tracker that fails mid-run is reported once through `note`
    and dropped; the files go on. `resume_after`: a resumed run's checkpoint step; what
    the files hold past it is dropped (the trackers were opened with the same step)."""

    def __init__(
        self, run_dir: Path, trackers: Sequence[Tracker] = (), note: Note = print,
        resume_after: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        if resume_after is not None:
            for name in RUN_FILES:
                keep_steps_up_to(run_dir / name, resume_after)
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

    def write_timeline(
        self, outcome: StepOutcome, *, tp: int | None = None,
        preemptions: int | None = None, spec_batch: int | None = None,
    ) -> None:
        """Requests in flight over the round (seconds from its start), one line per
        round in `timeline.jsonl`: what the plots draw the bubble from. With the rollout
        TP the round ran at and the preemptions its replicas saw, when known, and with
        speculative decoding the largest batch its replicas drafted at (`spec_batch`:
        the round speculated while no more requests than that were in flight)."""
        r = outcome.round
        line: dict[str, Any] = {
            "step": outcome.step,
            "round_kind": r.plan.kind,
            "capacity": outcome.capacity,
            "slots": min(outcome.capacity, r.launched),  # what bubble_ratio measures against
            "t": [round(t - r.started_at, 4) for t, _ in r.timeline],
            "in_flight": [n for _, n in r.timeline],
        }
        if tp is not None:
            line["tp"] = tp
        if preemptions is not None:
            line["preemptions"] = preemptions
        if spec_batch:
            line["spec_batch"] = int(spec_batch)
        self._append("timeline.jsonl", [line])

    def write_samples(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._append("samples.jsonl", rows)
        if rows:
            self.log_texts(rows[0]["step"], rows)

    def _append(self, name: str, lines: Sequence[Mapping[str, Any]]) -> None:
        with (self.run_dir / name).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)

    def close(self) -> None:
        self._file.close()
        trackers, self._trackers = self._trackers, []
        close_all(trackers, self._note)


def step_failures(record: Mapping[str, Any]) -> dict[str, int]:
    """A step's reward failures by kind (its `reward_failed_<kind>` columns; the
    `_total` columns count since the process started)."""
    prefix = "reward_failed_"
    return {
        k[len(prefix):]: int(v)
        for k, v in record.items()
        if k.startswith(prefix) and not k.endswith("_total") and v
    }


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
    failed: Counter[str] = Counter()
    for r in recs:
        failed.update(step_failures(r))
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
        "reward_failed": float(sum(r.get("reward_failed", 0) for r in recs)),
        **{f"reward_failed_{kind}": float(n) for kind, n in sorted(failed.items())},
        **judge_quality(recs, window),
        **call_thirds(recs, window),
    }


def _thirds(steps: Sequence[Mapping[str, Any]], window: int) -> tuple[Sequence[Mapping[str, Any]], ...]:
    """The first and last third of `steps`, at least `window` steps each."""
    span = max(window, len(steps) // 3)
    return steps[:span], steps[-span:]


def call_thirds(records: Sequence[Mapping[str, Any]], window: int = 3) -> dict[str, float]:
    """Multi-call trajectories' mean reward over the run and over its first and last
    third of the steps that had any (per trajectory, not per step: a long round holds
    many). Empty for single-turn runs."""
    steps = [r for r in records if r.get("multi_call_trajectories")]
    if not steps:
        return {}

    def mean(rs: Sequence[Mapping[str, Any]]) -> float:
        return sum(r["multi_call_reward_sum"] for r in rs) / sum(r["multi_call_trajectories"] for r in rs)

    first, last = _thirds(steps, window)
    return {
        "multi_call_trajectories": float(sum(r["multi_call_trajectories"] for r in steps)),
        "multi_call_reward": mean(steps),
        "multi_call_reward_first": mean(first),
        "multi_call_reward_last": mean(last),
    }


def judge_quality(records: Sequence[Mapping[str, Any]], window: int = 3) -> dict[str, float]:
    """The judge measured over the run, and over the first and last third of the steps
    that measured it (at least `window` steps each: a few steps' figures swing with what
    their rounds held, a long round of hard prompts most). Each rate pools its steps'
    counts. Empty without a judge.

    - Against the rule, where both scored a row (`rpk.reward.hybrid`): the agreement,
      `judge_fp_rate` (of the answers the rule failed, the share the judge passed: what
      a policy that learns to fool the judge drives up) and `judge_fn_rate` (of those the
      rule passed, the share the judge failed).
    - The canaries (`rpk.reward.canary`: known-wrong answers, asked outside training):
      `judge_canary_fp_rate`, by family over the run, and the steps the alarm was up.
    - A cascade: the share of rows sent to the judge and its rescues (rule no, judge
      yes) among the rule's no."""
    out: dict[str, float] = {}

    def pooled(rs: Sequence[Mapping[str, Any]], num: Sequence[str], den: Sequence[str]) -> float | None:
        d = sum(r.get(k, 0) for r in rs for k in den)
        return sum(r.get(k, 0) for r in rs for k in num) / d if d else None

    def by_thirds(name: str, steps: Sequence[Mapping[str, Any]], num: Sequence[str], den: Sequence[str]) -> None:
        first, last = _thirds(steps, window)
        for suffix, rs in (("", steps), ("_first", first), ("_last", last)):
            value = pooled(rs, num, den)
            if value is not None:
                out[f"{name}{suffix}"] = value

    compared = [r for r in records if r.get("reward_judge_rule_compared")]
    if compared:
        cell = "reward_judge_rule_"
        out["judge_rule_compared"] = float(sum(r["reward_judge_rule_compared"] for r in compared))
        by_thirds("judge_rule_agreement", compared, [cell + "agreed"], [cell + "compared"])
        by_thirds("judge_fp_rate", compared, [cell + "fp"], [cell + "fp", cell + "tn"])
        by_thirds("judge_fn_rate", compared, [cell + "fn"], [cell + "fn", cell + "tp"])
    canaries = [r for r in records if r.get("reward_judge_canary_answered")]
    if canaries:
        c = "reward_judge_canary_"
        out["judge_canary_answered"] = float(sum(r[c + "answered"] for r in canaries))
        by_thirds("judge_canary_fp_rate", canaries, [c + "fp"], [c + "answered"])
        out["judge_canary_alarm_steps"] = float(sum(r.get(c + "alarm", 0) for r in records))
        families = sorted({k[len(c):-len("_answered")] for r in canaries for k in r
                           if k.startswith(c) and k.endswith("_answered") and k != c + "answered"})
        for family in families:
            value = pooled(canaries, [f"{c}{family}_fp"], [f"{c}{family}_answered"])
            if value is not None:
                out[f"judge_canary_fp_rate_{family}"] = value
    cascade = [r for r in records if r.get("reward_cascade_rows")]
    if cascade:
        out["cascade_rows"] = float(sum(r["reward_cascade_rows"] for r in cascade))
        out["cascade_rescued"] = float(sum(r.get("reward_cascade_rescued", 0) for r in cascade))
        by_thirds("cascade_judge_frac", cascade, ["reward_cascade_to_judge"], ["reward_cascade_rows"])
        by_thirds("cascade_rescue_rate", cascade, ["reward_cascade_rescued"], ["reward_cascade_rule_no"])
    return out
