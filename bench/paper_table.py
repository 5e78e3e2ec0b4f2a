"""The paper's Table 2 row "tail batching" on virtual time, with the length-aware
variant beside it.

    .venv/bin/python -m bench.paper_table --out bench/results/paper_table.json

RollPacker (arXiv 2509.21009, Table 2) reports end-to-end step speedups over veRL's
synchronous step from tail batching alone of 1.30x / 1.48x / 2.21x for Qwen2.5-7B at
8k, 14B at 16k and 32B at 32k max length (P0=128 prompts x R0=8 responses, eta 1.25
for prompts and responses). This benchmark runs the real loop and policies on the
simulator in that setup. What each setting takes from the paper, and what is fitted:

- lengths: the `noisy` model of bench/sim_policies.py (a prompt's own log-normal mean,
  a per-epoch change, per-response noise; rank correlation ~0.6 between epochs; total
  log-sd 1.1, so the longest of a step is ~25-30x the median when the budget does not
  cut it), capped at the length budget. Only the median differs per setting:
  - 16k: 430 tokens, from the paper's statistics (p75 0.75-1.1k, the max at the cap);
  - 8k and 32k: the paper gives no length statistics, so the median is fitted to its
    rollout time per period of 4 short + 1 long round (82 -> 47 s at 8k, 673 -> 170 s
    at 32k). The 16k figure (277 -> 88 s) is left as a check.
- decode cost: memory bound, `base_s` per step growing with the model (15 / 20 / 30 ms)
  and a small per-sequence term, over 16 / 32 / 64 GPUs (16 data-parallel replicas;
  one engine here whose per-sequence cost is a replica's divided by 16). The whole
  short round fits in the engine at once.
- the rest of a step (training, and reward, synchronous in this row): every policy is
  charged the same seconds per trained token, set so that they make the share of the
  synchronous step that the paper's own figures imply (Table 2's speedup against its
  rollout speedup per period): 46% / 52% / 27%.

Every policy trains 3 epochs of `--prompts` prompts (10 steps each by default), so
the length-aware variant has a history to learn from after the first.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, write_json
from bench.sim_policies import LengthModel, run_policy
from rpk.sim import CostModel

PAPER = {"7B/8k": 1.30, "14B/16k": 1.48, "32B/32k": 2.21}
# rollout seconds per period (4 short + 1 long round), without and with tail batching
PAPER_PERIOD = {"7B/8k": (82, 47), "14B/16k": (277, 88), "32B/32k": (673, 170)}
REPLICAS = 16
SETTINGS: dict[str, dict[str, Any]] = {
    "7B/8k": {"max_tokens": 8192, "median": 1024, "cost": CostModel(0.015, 5e-5 / REPLICAS)},
    "14B/16k": {"max_tokens": 16384, "median": 430, "cost": CostModel(0.020, 8e-5 / REPLICAS)},
    "32B/32k": {"max_tokens": 32768, "median": 550, "cost": CostModel(0.030, 1.2e-4 / REPLICAS)},
}
# sd of a prompt's own log mean : of its per-epoch change : per response (rank
# correlation ~0.6 between epochs), scaled to a total log-sd of SIGMA
SHAPE = (0.8, 0.6, 0.5)
SIGMA = 1.1


def other_share(name: str) -> float:
    """Training + reward as a share of the synchronous step, as the paper's figures
    imply: Table 2's end-to-end speedup S and the rollout speedup per period R give
    the rollout share s from 1/S = (1 - s) + s/R."""
    without, with_tail = PAPER_PERIOD[name]
    rollout_share = (1 - 1 / PAPER[name]) / (1 - with_tail / without)
    return 1 - rollout_share


def lengths_for(setting: Mapping[str, Any], prompts: int, p0: int, seed: int) -> LengthModel:
    scale = SIGMA / math.sqrt(sum(v * v for v in SHAPE))
    sp, se, sr = (v * scale for v in SHAPE)
    rng = random.Random(seed)
    base = [math.log(setting["median"]) + sp * rng.gauss(0.0, 1.0) for _ in range(prompts)]
    return LengthModel("noisy", base, [16] * prompts, se, sr, p0)


def _totals(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {
        "rollout_s": sum(r["time_rollout_s"] for r in records),
        "prompts": sum(r["prompts"] for r in records),
        "tokens_trained": sum(r["response_len_mean"] * r["responses"] for r in records),
        "tokens_generated": sum(r["tokens_generated"] for r in records),
        "tokens_wasted": sum(r["tokens_wasted"] for r in records),
    }


def run_setting(name: str, args: argparse.Namespace) -> dict[str, Any]:
    setting = SETTINGS[name]
    lengths = lengths_for(setting, args.prompts, args.p0, args.seed)
    sim_args = argparse.Namespace(
        steps=args.steps, p0=args.p0, r0=args.r0, eta=args.eta, max_tokens=setting["max_tokens"],
        concurrency=args.concurrency, lookahead=args.lookahead,
        chunk=max(1, setting["max_tokens"] // 128),
    )
    totals = {p: _totals(asyncio.run(run_policy(p, setting["cost"], lengths, sim_args)))
              for p in ("sync", "tail", "length_aware")}
    sync = totals["sync"]
    # the rest of the step, per trained token: other_share of sync's step
    other = other_share(name)
    other_per_token = other / (1 - other) * sync["rollout_s"] / sync["tokens_trained"]
    without, with_tail = PAPER_PERIOD[name]
    row: dict[str, Any] = {"setting": name, "paper_tail": PAPER[name], "other_share": other,
                           "paper_tail_rollout": without / with_tail,
                           "median": setting["median"], "max_tokens": setting["max_tokens"],
                           "rank_corr_between_epochs": lengths.epoch_rank_corr(args.r0)}
    per_prompt = {}
    for p, t in totals.items():
        step = t["rollout_s"] + other_per_token * t["tokens_trained"]
        per_prompt[p] = (t["rollout_s"] / t["prompts"], step / t["prompts"])
        row[p] = {**t, "step_s_per_prompt": step / t["prompts"],
                  "wasted_frac": t["tokens_wasted"] / t["tokens_generated"]}
    for p in ("tail", "length_aware"):
        row[f"{p}_speedup"] = per_prompt["sync"][1] / per_prompt[p][1]
        row[f"{p}_rollout_speedup"] = per_prompt["sync"][0] / per_prompt[p][0]
    row["tail_vs_paper"] = row["tail_speedup"] / PAPER[name] - 1
    return row


COLUMNS = (
    Col("setting", "setting", 9, "<"), Col("median", "median", 7), Col("other", "other_share", 7, ".0%"),
    Col("paper tail", "paper_tail", 11, ".2f", "x"), Col("tail", "tail_speedup", 7, ".2f", "x"),
    Col("vs paper", "tail_vs_paper", 9, "+.1%"), Col("length_aware", "length_aware_speedup", 13, ".2f", "x"),
    Col("| rollout: paper tail", "paper_tail_rollout", 21, ".2f", "x"),
    Col("tail", "tail_rollout_speedup", 7, ".2f", "x"),
    Col("l_a", "length_aware_rollout_speedup", 7, ".2f", "x"),
    Col("| waste: tail", "tail_wasted_frac", 14, ".1%"), Col("l_a", "length_aware_wasted_frac", 7, ".1%"),
)


def print_table(rows: Sequence[Mapping[str, Any]]) -> None:
    shown = [{**r, "tail_wasted_frac": r["tail"]["wasted_frac"],
              "length_aware_wasted_frac": r["length_aware"]["wasted_frac"]} for r in rows]
    common.print_table(shown, COLUMNS)


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    common.add_sampling_args(ap, steps=30, steps_help=None, prompts=1280)
    ap.add_argument("--lookahead", type=int, default=10, help="length_aware: rounds per draw")
    ap.add_argument("--concurrency", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for name in args.settings:
        print(f"== {name}", flush=True)
        rows.append(run_setting(name, args))
    print("\nspeedup over sync per trained prompt, end to end (rollout + the same training and "
          "reward seconds per token), and of rollout alone:")
    print_table(rows)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
