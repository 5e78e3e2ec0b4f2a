"""Elastic rollout TP on the real CPU fleet: fixed TP 1, fixed TP 2 and elastic, each a
short `rpk.run` over the same two cores, model, data and seed.

    .venv/bin/python -m bench.elastic_tp_cpu --steps 10 --out bench/results/elastic_tp_cpu.json
    .venv/bin/python -m bench.elastic_tp_cpu --variants tp1 elastic -- --rollout.kv_cache_mb 2

The fleet is vLLM's CPU engine on cores 0 and 1: two TP-1 replicas, or one TP-2 replica
(its two workers one per core), or both layouts with the planner choosing per round
kind. The KV cache is kept small (`--rollout.kv_cache_mb 4` per worker: ~1.5k tokens of the
tiny model) so that a short round preempts at TP 1, as the paper's short rounds do on
GPUs; arguments after `--` go to every run. The table is `bench.elastic_tp`'s, on wall
seconds: the rollout time per trained prompt (regroups included), round times by kind,
preemptions, regroups and the TP of every step. The machine is shared and noisy: compare
the rows of one run, not runs.
"""

from __future__ import annotations

import sys

from bench import common
from bench.common import run_variants, split_passthrough, write_json
from bench.elastic_tp import against_best_fixed, print_table, summarize

VARIANTS = {
    "tp1": ["--rollout.tp", "fixed", "--rollout.tp_size", "1"],
    "tp2": ["--rollout.tp", "fixed", "--rollout.tp_size", "2"],
    "elastic": ["--rollout.tp", "elastic", "--rollout.tp_sizes", "1,2", "--rollout.tp_size", "1"],
}
COMMON = [
    "--rollout.devices", "0,1", "--rollout.kv_cache_mb", "4", "--rollout.max_tokens", "200",
    "--rollout.max_model_len", "384",
    "--data.val_size", "0", "--run.trackers", "",
]


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=10, help="steps per variant (tail: a long round every 5th)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    code, rows = run_variants({v: VARIANTS[v] for v in args.variants}, args.steps, summarize,
                              common=COMMON, passthrough=passthrough)
    if code != 0:
        return code
    result = {**against_best_fixed(rows), "steps": args.steps, "overrides": passthrough}
    print(f"\nreal CPU fleet on cores 0,1, {args.steps} steps, wall seconds; best fixed: {result['best_fixed']}")
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
