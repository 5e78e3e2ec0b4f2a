"""Stream-based training: the trainer on a round's completed groups while its tail
still generates, against training after rollout, on the default task under tail
batching (long rounds are where the tail is).

    .venv/bin/python -m bench.stream_train --steps 10 --out bench/results/stream_train.json

Each variant is one run of the same steps, seed and data (a long round every fifth
step with the defaults). Reported per variant: median step time of long and short
rounds, and the share of the trainer's busy time that ran while the round was still
generating (`trainer_hidden_frac`, summed over long rounds).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, run_variants, split_passthrough, write_json

VARIANTS = {
    "off": ["--train.stream_mode", "none"],
    "on": ["--train.stream_mode", "thread"],  # the defaults: from the first group, 1024 tokens
    # the paper's trigger (20% of the round done) and bigger chunks
    "on-late": ["--train.stream_mode", "thread", "--train.stream_start_frac", "0.2",
                "--train.stream_chunk_tokens", "2048"],
}


def summarize(name: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def med(kind: str, key: str) -> float | None:
        values = [r[key] for r in records[1:] if r["round_kind"] == kind]  # step 1 warms up
        return statistics.median(values) if values else None

    long_recs = [r for r in records if r["round_kind"] == "long"]
    busy = sum(r["time_train_busy_s"] for r in long_recs)
    hidden = sum(r["time_train_hidden_s"] for r in long_recs)
    return {
        "variant": name,
        "stream_mode": VARIANTS[name][1],
        "steps": len(records),
        "long_rounds": len(long_recs),
        "long_step_s_median": med("long", "time_step_s"),
        "long_rollout_s_median": med("long", "time_rollout_s"),
        "long_train_exposed_s_median": med("long", "time_train_s"),
        "short_step_s_median": med("short", "time_step_s"),
        "trainer_busy_s_long": busy,
        "trainer_hidden_frac": hidden / busy if busy else 0.0,
        "reward_mean": statistics.fmean(r["reward_mean"] for r in records),
    }


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    code, rows = run_variants({name: VARIANTS[name] for name in args.variants}, args.steps, summarize,
                              common=["--rollout.policy", "tail"], passthrough=passthrough)
    if code != 0:
        return code
    cols = ("long_step_s_median", "long_rollout_s_median", "long_train_exposed_s_median",
            "short_step_s_median", "trainer_hidden_frac")
    print()
    common.print_table(rows, [Col("variant", "variant", 12, "<"),
                              *(Col(c.removesuffix("_median"), c, 24, ".3f") for c in cols)])
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
