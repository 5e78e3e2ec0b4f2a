"""Where does a step's time go? Runs the default job for a few steps and prints the
median time of each stage (rollout, reward exposed after rollout, train, weight sync).

    .venv/bin/python -m bench.step_breakdown --steps 6 --out bench/results/step_breakdown.json
    .venv/bin/python -m bench.step_breakdown --steps 4 -- --rollout.prompts_per_step 8

Arguments after `--` are passed to rpk.run as config overrides. The first step is left
out of the medians: it pays one-off warm-up costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import split_passthrough
from rpk import run
from rpk.obs.metrics import read_records

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        code = run.main(
            ["--run.steps", str(args.steps), "--run.out_dir", tmp, "--run.checkpoint_every", "0",
             "--run.progress", "false", *passthrough]
        )
        if code != 0:
            return code
        records = read_records(Path(tmp) / "latest" / "metrics.jsonl")
    measured = records[1:] if len(records) > 1 else records
    step_median = statistics.median(r["time_step_s"] for r in measured)
    rows = []
    print(f"\nstep breakdown: median over steps {measured[0]['step']}..{measured[-1]['step']}")
    print(f"{'stage':<28}{'median s':>10}{'of step':>10}")
    for label, key in STAGES:
        med = statistics.median(r[key] for r in measured)
        share = med / step_median if step_median else 0.0
        rows.append({"stage": label, "key": key, "median_s": med, "share_of_step": share})
        print(f"{label:<28}{med:>10.3f}{share:>10.1%}")
    tok = statistics.median(r["tokens_per_s"] for r in measured)
    print(f"rollout throughput (median): {tok:.0f} tokens/s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"steps": len(records), "measured_steps": len(measured), "stages": rows,
                  "tokens_per_s_median": tok, "records": records}
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
