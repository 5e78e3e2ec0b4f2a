"""Elastic rollout tensor parallelism against fixed TP 1 / 2 / 4, on virtual time.

    .venv/bin/python -m bench.elastic_tp --out bench/results/elastic_tp.json

The real loop (`run_step`, `TailPolicy`, the `Fleet` and its router, `RolloutTP` with
the paper's planner) drives simulated replicas (`rpk.sim.fleet`) over 8 devices of one
node. Each variant trains the same prompts in the same order of draws; only the TP
differs: fixed 1, 2 or 4 (one layout built), or elastic (layouts of 1, 2 and 4, the
planner picking per round kind, every regroup paying sleep, wake and a weight load).

What the setting takes from facts:

- the paper's 14B / 16k row (../shared/ROLLPACKER.md: Qwen2.5-14B, 16k budget, P0=128,
  R0=8, eta 1.25): lengths are bench/paper_table.py's model of it (median 430 tokens,
  log-sd 1.1, the longest of a step at the 16k cap, ~38x the median), with prompts of
  `--prompt-tokens` (the paper's math prompts: a few hundred tokens with the template);
- decode cost: bench/paper_table.py's 14B curve on one H800 (20 ms a step, memory
  bound, + 0.08 ms per running sequence), split over the TP group;
- KV memory: the RollPacker fork runs vLLM at `gpu_memory_utilization: 0.6`
  (examples/e2e_performance/*.yaml of github.com/Farrrrland/RollPacker, the trainer
  sharing the GPUs), i.e. 48 GB of an 80 GB H800. Qwen2.5-14B in bf16 is 29.5 GB of
  weights and 196 KB of KV per token (48 layers x 8 KV heads x 128 x 2 x 2 bytes), so
  the weights are worth ~150k KV tokens and a TP-1 replica keeps ~75k tokens of KV
  after ~3 GB of activations; a TP-2 replica holds ~300k, a TP-4 one ~760k
  (`CostModel.kv_capacity`);
- TP communication: two all-reduces per layer and decode step, 96 for 48 layers, of
  (sequences x 5120 x 2 bytes) each: ~1.5 ms a step of latency alone (~15 us each over
  NVLink), ~3.5 ms at a short round's 400 sequences per TP-2 replica (390 MB at H800's
  ~150 GB/s of NVLink bus bandwidth); 3 ms a step per extra device (`--tp-comm-ms`);
- preemption recomputes the preempted sequence's tokens at a prefill rate of ~20k
  tokens/s per device (compute bound: 28 GFLOP a token at ~60% of ~990 TFLOPS);
- a regroup: level-2 sleep of the old layout and wake of the new one, ~1 s each, and
  the new layout's weight load, ~3 s (colocated CUDA-IPC sync of 30 GB, cf. slime's 7 s
  for a 30B MoE in ../shared/SCALE-OUT.md); the same load follows every step (the
  per-step weight sync) in every variant. Elastic regroups in place of that sync
  (`rpk.loop.elastic`), so a regroup costs the sleep and the wake on top of it.

The metric is rollout time per trained prompt: the round's virtual seconds plus the
engine's time between rounds (a regroup before the round, the weight sync after it,
which may be a regroup for the next round), summed over the run, over the prompts
trained. Ratios are against the best fixed TP of the run. The last line printed is the
ceiling of any planner that picks a TP per round kind: every round at its kind's
fastest fixed TP, regroups free.
When one TP is fastest for both kinds, that ceiling is the best fixed TP itself, and
elastic can only lose (README.md, "Elastic TP", has the figures and why).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, args_json, sim_steps, write_json
from bench.paper_table import SETTINGS, lengths_for
from bench.sim_policies import LengthModel
from rpk.loop.elastic import RolloutTP
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import step_record
from rpk.sched.policy import Sampling, TailPolicy
from rpk.sched.tp_planner import PlannerConfig, TPPlanner
from rpk.sim import CostModel
from rpk.sim.fleet import sim_fleet
from rpk.sim.trainer import NullTrainer

SETTING = SETTINGS["14B/16k"]
TP_SIZES = (1, 2, 4)
VARIANTS = ("tp1", "tp2", "tp4", "elastic")


def cost_model(args: argparse.Namespace) -> CostModel:
    return CostModel(
        base_s=args.base_ms / 1e3, per_seq_s=args.per_seq_ms / 1e3,
        prefill_token_s=1.0 / args.prefill_tokens_per_s, kv_tokens=args.kv_tokens,
        weight_tokens=args.weight_tokens, tp_comm_s=args.tp_comm_ms / 1e3,
        tp_comm_per_seq_s=args.tp_comm_per_seq_us / 1e6,
        sync_s=args.sync_s, sleep_s=args.sleep_s, wake_s=args.wake_s,
    )


def paper_lengths(args: argparse.Namespace) -> LengthModel:
    lengths = lengths_for({"median": args.median}, args.prompts, args.p0, args.seed)
    ramp = math.log(args.ramp) / max(1, args.steps - 1)
    return dataclasses.replace(lengths, prompt_tokens=[args.prompt_tokens] * args.prompts, ramp=ramp)


async def run_variant(
    variant: str, cost: CostModel, lengths: LengthModel, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One variant's step records: the loop's own, the planner's, and the prompts trained."""
    elastic = variant == "elastic"
    sizes = TP_SIZES if elastic else (int(variant.removeprefix("tp")),)
    initial = args.elastic_initial if elastic else sizes[0]
    fleet = await sim_fleet(lengths, cost=cost, devices=args.devices, tp_sizes=sizes, tp=initial,
                            max_num_seqs=args.max_num_seqs, chunk=args.chunk)
    trainer = AsyncTrainer(NullTrainer())
    planner = TPPlanner(PlannerConfig("elastic" if elastic else "fixed", sizes, initial))
    rollout_tp = RolloutTP(planner, fleet, trainer, bucket_bytes=2**20, last_step=args.steps)
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0,
                        max_tokens=args.max_tokens, seed=args.seed)
    policy = TailPolicy(lengths.prompts(), sampling, eta_prompts=args.eta, eta_responses=args.eta)
    return await sim_steps(args.steps, policy, fleet, trainer, lambda o: {
        **step_record(o), **rollout_tp.record(o),
        "trained": sorted(g.prompt.uid for g in o.round.groups),
    }, between=rollout_tp)


def summarize(variant: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    def of_kind(kind: str, key: str) -> list[float]:
        return [r[key] for r in records if r["round_kind"] == kind]

    prompts = sum(r["prompts"] for r in records)
    rollout = sum(r["time_rollout_s"] for r in records)
    between = [r["time_regroup_s"] + r["time_sync_s"] for r in records]
    return {
        "variant": variant,
        "steps": len(records),
        "prompts_trained": prompts,
        "rollout_s": rollout,
        "between_s": sum(between),
        "regroup_s": sum(r["time_regroups_s"] for r in records),
        "rollout_s_per_prompt": (rollout + sum(between)) / prompts,
        "short_round_s_mean": _mean(of_kind("short", "time_rollout_s")),
        "long_round_s_mean": _mean(of_kind("long", "time_rollout_s")),
        "preemptions_per_step": sum(r["preemptions"] for r in records) / len(records),
        "preemptions_short_mean": _mean(of_kind("short", "preemptions")),
        "preemptions_long_mean": _mean(of_kind("long", "preemptions")),
        "regroups": sum(r["regroups"] for r in records),
        "tp_per_step": [r["tp"] for r in records],
        "rollout_s_per_step": [r["time_rollout_s"] + b for r, b in zip(records, between)],
        "kinds": [r["round_kind"] for r in records],
        "tokens_generated": sum(r["tokens_generated"] for r in records),
    }


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant of `args.variants` on the same prompts, lengths and costs."""
    cost = cost_model(args)
    lengths = paper_lengths(args)
    rows, trained = [], {}
    for variant in args.variants:
        records = await run_variant(variant, cost, lengths, args)
        rows.append(summarize(variant, records))
        trained[variant] = [r["trained"] for r in records]
    return {"cost": dataclasses.asdict(cost), **against_best_fixed(rows), "trained": trained,
            "args": args_json(args)}


def against_best_fixed(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each row's `vs_best_fixed` (its rollout time per prompt over the fastest fixed
    TP's), the best fixed variant, the per-kind ceiling, and the rows."""
    fixed = [r for r in rows if r["variant"] != "elastic"]
    best = min(fixed, key=lambda r: r["rollout_s_per_prompt"]) if fixed else None
    for r in rows:
        r["vs_best_fixed"] = r["rollout_s_per_prompt"] / best["rollout_s_per_prompt"] if best else None
    return {"best_fixed": best["variant"] if best else None, "per_kind_best": per_kind_best(fixed),
            "rows": list(rows)}


def per_kind_best(fixed: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Per round kind, the fixed TP whose rounds were fastest on average, and the
    rollout time per prompt of running every round at its kind's best, regroups free:
    the most any planner that picks a TP per round kind could reach."""
    if not fixed:
        return None
    kinds: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(k for r in fixed for k in r["kinds"]):
        means = {r["variant"]: statistics.fmean(t for k, t in zip(r["kinds"], r["rollout_s_per_step"]) if k == kind)
                 for r in fixed if kind in r["kinds"]}
        best = min(means, key=means.__getitem__)
        kinds[kind] = {"variant": best, "round_s_mean": means[best], "rounds": fixed[0]["kinds"].count(kind)}
    seconds = sum(k["round_s_mean"] * k["rounds"] for k in kinds.values())
    return {"kinds": kinds, "rollout_s_per_prompt": seconds / fixed[0]["prompts_trained"]}


COLUMNS = (
    Col("variant", "variant", 9, "<"), Col("prompts", "prompts_trained", 8),
    Col("rollout s/prompt", "rollout_s_per_prompt", 17, ".3f"),
    Col("vs best fixed", "vs_best_fixed", 14, ".3f", "x"),
    Col("short s", "short_round_s_mean", 9, ".1f"), Col("long s", "long_round_s_mean", 9, ".1f"),
    Col("preempt/step", "preemptions_per_step", 13, ".0f"),
    Col("short", "preemptions_short_mean", 8, ".0f"), Col("long", "preemptions_long_mean", 8, ".0f"),
    Col("regroups", "regroups", 9), Col("regroup s", "regroup_s", 10, ".1f"),
    Col("tp per step", "tps", 0, "<"),
)


def print_table(result: Mapping[str, Any]) -> None:
    shown = [{**r, "tps": "".join(str(t) for t in r["tp_per_step"])} for r in result["rows"]]
    common.print_table(shown, COLUMNS)
    ceiling = result["per_kind_best"]
    if ceiling is not None:
        kinds = ", ".join(f"{kind} rounds {k['variant']} ({k['round_s_mean']:.1f} s)"
                          for kind, k in ceiling["kinds"].items())
        print(f"fastest fixed TP per round kind: {kinds}; every round at its kind's best, "
              f"regroups free: {ceiling['rollout_s_per_prompt']:.3f} s/prompt")


def add_setting_args(ap: argparse.ArgumentParser, steps: int, steps_help: str, prompts: int) -> None:
    """The paper's 14B / 16k setting and the H800 costs of the module docstring, as
    flags (`paper_lengths`, `cost_model`)."""
    common.add_sampling_args(ap, steps, steps_help, prompts)
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="per device (KV is the limit)")
    ap.add_argument("--median", type=float, default=SETTING["median"], help="response length")
    ap.add_argument("--max-tokens", type=int, default=SETTING["max_tokens"])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=128, help="decode steps per streamed delta")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-ms", type=float, default=20.0, help="decode step at TP 1")
    ap.add_argument("--per-seq-ms", type=float, default=0.08, help="per running sequence")
    ap.add_argument("--tp-comm-ms", type=float, default=3.0, help="per step, per extra device")
    ap.add_argument("--tp-comm-per-seq-us", type=float, default=0.0,
                    help="per step and running sequence, at TP 2 (its all-reduce bytes)")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0, help="per device")
    ap.add_argument("--kv-tokens", type=int, default=75_000, help="KV cache of one device at TP 1")
    ap.add_argument("--weight-tokens", type=int, default=150_000, help="the weights, in KV tokens")
    ap.add_argument("--sync-s", type=float, default=3.0, help="a replica loading the weights")
    ap.add_argument("--sleep-s", type=float, default=1.0)
    ap.add_argument("--wake-s", type=float, default=1.0)


def parser() -> argparse.ArgumentParser:
    ap = common.parser(__doc__)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_setting_args(ap, steps=20, steps_help="4 periods of 4 short + 1 long round", prompts=2560)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--elastic-initial", type=int, default=1, choices=TP_SIZES)
    ap.add_argument("--ramp", type=float, default=1.0,
                    help="response lengths grow this many times from the first step to the last")
    return ap


def main() -> int:
    args = parser().parse_args()
    result = asyncio.run(compare(args))
    print(f"\n{args.devices} devices, P0={args.p0} x R0={args.r0}, {args.steps} steps, "
          f"virtual seconds; best fixed: {result['best_fixed']}")
    print_table(result)
    trained = result.pop("trained")
    result["same_prompts_trained"] = len({frozenset(p for s in t for p in s) for t in trained.values()}) == 1
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
