"""Rollout scheduling policies side by side: the same model, data and seed under each
policy for the same number of steps (P0 trained prompts each), on the real engine.

    .venv/bin/python -m bench.rollout_policies --steps 10 --out bench/results/rollout_policies.json
    .venv/bin/python -m bench.rollout_policies --policies sync tail -- --rollout.max_num_seqs 256

Arguments after `--` go to every run as config overrides. The table reports, per
policy: rollout seconds per trained prompt (total rollout time over every step, long
rounds included, / prompts trained), the median rollout time per step (short and long
rounds apart), the bubble ratio, the share of generated tokens thrown away, reward, the
steps' whole time (rollout, training after it, weight sync) and the share of the host's
cores busy over the steps (`host_cpu_busy_frac`, weighted by step time): on a CPU
machine, whether a policy left any core idle for another to use.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, run_variants, split_passthrough, write_json
from rpk.sched.policies import POLICIES


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_policy(policy: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One table row / JSON entry from a run's step records."""
    def of_kind(kind: str, key: str) -> list[float]:
        return [r[key] for r in records if r["round_kind"] == kind]

    trained = sum(r["prompts"] for r in records)
    rollout = sum(r["time_rollout_s"] for r in records)
    generated = sum(r["tokens_generated"] for r in records)
    wasted = sum(r["tokens_wasted"] for r in records)
    short_kind = "sync" if policy == "sync" else "short"
    return {
        "policy": policy,
        "steps": len(records),
        "prompts_trained": trained,
        "rollout_s_total": rollout,
        "rollout_s_per_prompt": rollout / trained if trained else None,
        "rollout_s_per_step_median": _median([r["time_rollout_s"] for r in records]),
        "rollout_s_short_median": _median(of_kind(short_kind, "time_rollout_s")),
        "rollout_s_long_median": _median(of_kind("long", "time_rollout_s")),
        "long_rounds": len(of_kind("long", "time_rollout_s")),
        "bubble_ratio_short_mean": _mean(of_kind(short_kind, "bubble_ratio")),
        "bubble_ratio_long_mean": _mean(of_kind("long", "bubble_ratio")),
        "tokens_generated": generated,
        "tokens_wasted_frac": wasted / generated if generated else 0.0,
        "tokens_off_policy": sum(r.get("tokens_off_policy", 0) for r in records),
        "prompts_dropped": int(records[-1].get("prompts_dropped_total", 0)) if records else 0,
        "reward_mean": _mean([r["reward_mean"] for r in records]),
        # length_aware: the predictor's last calibration, the speculation it chose
        "pred_rank_corr": records[-1].get("pred_rank_corr") if records else None,
        "eta_prompts_mean": _mean([r["eta_prompts"] for r in records if "eta_prompts" in r]),
        "step_s_median": _median([r["time_step_s"] for r in records]),
        "step_s_total": sum(r["time_step_s"] for r in records),
        "train_hidden_s_total": sum(r["time_train_hidden_s"] for r in records),
        "host_cpu_busy": _time_weighted(records, "host_cpu_busy_frac"),
    }


def _time_weighted(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """`key`'s mean over the steps that have it, each weighted by its step time."""
    timed = [(r[key], r["time_step_s"]) for r in records if key in r]
    total = sum(t for _, t in timed)
    return sum(v * t for v, t in timed) / total if total else None


COLUMNS = (
    Col("policy", "policy", 11, "<"), Col("prompts", "prompts_trained", 8, "d"),
    Col("s/prompt", "rollout_s_per_prompt", 9, ".4f"),
    Col("step med", "rollout_s_per_step_median", 9, ".2f"),
    Col("short med", "rollout_s_short_median", 10, ".2f"),
    Col("long med", "rollout_s_long_median", 9, ".2f"),
    Col("bubble sh", "bubble_ratio_short_mean", 10, ".3f"),
    Col("bubble lg", "bubble_ratio_long_mean", 10, ".3f"),
    Col("wasted", "tokens_wasted_frac", 8, ".1%"), Col("reward", "reward_mean", 8, ".3f"),
    Col("vs sync", "vs_sync", 9, ".2f", "x"),
    Col("steps s", "step_s_total", 9, ".1f"), Col("cpu busy", "host_cpu_busy", 10, ".1%"),
)


def print_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[Col] = COLUMNS) -> None:
    """The rows, each policy's rollout time per prompt also as a speedup over sync's."""
    base = next((r["rollout_s_per_prompt"] for r in rows if r["policy"] == "sync"), None)
    common.print_table([{**r, "vs_sync": base / r["rollout_s_per_prompt"]
                         if base and r["rollout_s_per_prompt"] else None} for r in rows], cols)


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__, "write the JSON list here")
    ap.add_argument("--steps", type=int, default=10, help="steps per policy (P0 prompts each)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    args = ap.parse_args(argv)
    variants = {policy: ["--rollout.policy", policy] for policy in args.policies}
    code, rows = run_variants(variants, args.steps, summarize_policy, passthrough=passthrough)
    if code != 0:
        return code
    print()
    print_table(rows)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
