"""Rollout scheduling policies side by side: the same model, data and seed under each
policy for the same number of steps (P0 trained prompts each), on the real engine.

    .venv/bin/python -m bench.rollout_policies --steps 10 --out bench/results/rollout_policies.json
    .venv/bin/python -m bench.rollout_policies --policies sync tail -- --rollout.max_num_seqs 256

Arguments after `--` go to every run as config overrides. The table reports, per
policy: rollout seconds per trained prompt (total rollout time over every step, long
rounds included, / prompts trained), the median rollout time per step (short and long
rounds apart), the bubble ratio, the share of generated tokens thrown away, and reward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.common import run_steps, split_passthrough, write_json
from rpk.sched.policy import POLICIES



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
    }


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: Sequence[Mapping[str, Any]]) -> None:
    base = next((r for r in rows if r["policy"] == "sync"), None)
    cols = (  # header, key, width, format
        ("policy", "policy", 11, "<11"), ("prompts", "prompts_trained", 8, ">8d"),
        ("s/prompt", "rollout_s_per_prompt", 9, ">9.4f"),
        ("step med", "rollout_s_per_step_median", 9, ">9.2f"),
        ("short med", "rollout_s_short_median", 10, ">10.2f"),
        ("long med", "rollout_s_long_median", 9, ">9.2f"),
        ("bubble sh", "bubble_ratio_short_mean", 10, ">10.3f"),
        ("bubble lg", "bubble_ratio_long_mean", 10, ">10.3f"),
        ("wasted", "tokens_wasted_frac", 8, ">8.1%"), ("reward", "reward_mean", 8, ">8.3f"),
    )
    print("".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, _, w, _) in enumerate(cols)) + "  vs sync")
    for r in rows:
        line = "".join(_fmt(r[key], spec).rjust(w) for _, key, w, spec in cols)
        if base and r["rollout_s_per_prompt"] and base["rollout_s_per_prompt"]:
            line += f"  {base['rollout_s_per_prompt'] / r['rollout_s_per_prompt']:.2f}x"
        print(line)


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps per policy (P0 prompts each)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--out", type=Path, help="write the JSON list here")
    args = ap.parse_args(argv)
    rows = []
    for policy in args.policies:
        print(f"== {policy}: {args.steps} steps", flush=True)
        code, records = run_steps(
            ["--rollout.policy", policy, "--run.steps", str(args.steps),
             "--run.checkpoint_every", "0", "--run.progress", "false", *passthrough]
        )
        if code != 0:
            return code
        rows.append(summarize_policy(policy, records))
    print()
    print_table(rows)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
