"""Where does a step's time go? Runs the default job for a few steps and prints the
median time of each stage (rollout, reward exposed after rollout, train, weight sync).

    .venv/bin/python -m bench.step_breakdown --steps 6 --out bench/results/step_breakdown.json
    .venv/bin/python -m bench.step_breakdown --steps 4 -- --rollout.prompts_per_step 8

Arguments after `--` are passed to rpk.run as config overrides. The first step is left
out of the medians: it pays one-off warm-up costs.
"""

from __future__ import annotations

import statistics
import sys

from bench import common
from bench.common import Col, run_steps, split_passthrough, write_json

STAGES = (
    ("rollout", "time_rollout_s"),
    ("reward (busy, overlapped)", "time_reward_s"),
    ("reward (exposed)", "time_reward_exposed_s"),
    ("train", "time_train_s"),
    ("sync", "time_sync_s"),
    ("step", "time_step_s"),
)


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    code, records = run_steps(["--run.steps", str(args.steps), *passthrough])
    if code != 0:
        return code
    measured = records[1:] if len(records) > 1 else records
    step_median = statistics.median(r["time_step_s"] for r in measured)
    rows = []
    for label, key in STAGES:
        med = statistics.median(r[key] for r in measured)
        share = med / step_median if step_median else 0.0
        rows.append({"stage": label, "key": key, "median_s": med, "share_of_step": share})
    print(f"\nstep breakdown: median over steps {measured[0]['step']}..{measured[-1]['step']}")
    common.print_table(rows, [Col("stage", "stage", 28, "<"), Col("median s", "median_s", 10, ".3f"),
                              Col("of step", "share_of_step", 10, ".1%")])
    tok = statistics.median(r["tokens_per_s"] for r in measured)
    print(f"rollout throughput (median): {tok:.0f} tokens/s")
    write_json(args.out, {"steps": len(records), "measured_steps": len(measured), "stages": rows,
                          "tokens_per_s_median": tok, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
