"""The stream trainer at paper scale, on virtual time: no streaming, today's thread
streaming, and borrowing (the paper's: half the rollout replicas hand their requests to
the others and train).

    .venv/bin/python -m bench.stream_borrow --out bench/results/stream_borrow.json

The real loop (`run_step`, `TailPolicy`, the `Fleet` with its router and `lend`, the
borrow trigger of `rpk.sched.borrow`) drives simulated replicas (`rpk.sim.fleet`) over 4
nodes x 8 devices, TP 2 (16 replicas), and a simulated trainer (`sim_trainer`)
whose calls cost virtual time on the devices it has. Every variant runs the same
prompts, lengths and costs; only the streaming mode differs.

What the setting takes from facts, and what is assumed:

- lengths, prompt sizes, decode cost, KV memory, TP communication, prefill rate, sleep,
  wake and weight load: bench/elastic_tp.py's model of the paper's 14B / 16k row
  (P0=128, R0=8, eta 1.25; median 430 tokens, the longest at the 16k cap);
- training: 14B at 6 x 14e9 FLOP per token for forward and backward plus 2 x 14e9 for
  the old log-probs, at ~35% of ~990 TFLOPS: ~3,000 trained tokens per second per
  device (`--train-tokens-per-s`); the optimizer step and the deferred gradient
  reduction, 1 s (`--finish-s`). Assumed, not measured;
- thread streaming trains on all devices while they decode: assumed to get half their
  compute (`--thread-train-speed 0.5`) and to slow decode steps 1.5x while it works
  (`--thread-decode-slowdown`); the paper names this contention as the reason to
  borrow devices instead;
- borrowing: the trainer gets the lent replicas' devices (half); a moved request
  recomputes its prompt and tokens so far on its new replica at the prefill rate; a
  replica off the first node pays the engine host's round trip per call
  (`--host-latency-ms`, assumed 2 ms); the lent replicas sleep and wake (1 s each) and
  load the weights with the others after the step.

Reported per variant: rollout seconds per step, training exposed after the round,
weight sync, step seconds, step speedup over none (per trained prompt), the trigger's
fraction, migration seconds (the `lend` call) and the share of trainer time hidden
behind the round. The paper reports 1.08x for its adaptive trigger over none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, args_json, sim_steps, write_json
from bench.elastic_tp import add_setting_args, cost_model
from bench.paper_table import lengths_for
from bench.sim_policies import LengthModel
from rpk.loop.feed import Streaming
from rpk.obs.metrics import step_record
from rpk.sched.borrow import BorrowRule
from rpk.sched.policy import Sampling, TailPolicy
from rpk.sim import CostModel
from rpk.sim.fleet import sim_fleet
from rpk.sim.trainer import TrainCost, sim_trainer

VARIANTS = ("none", "thread", "borrow")


def paper_lengths(args: argparse.Namespace) -> LengthModel:
    lengths = lengths_for({"median": args.median}, args.prompts, args.p0, args.seed)
    return dataclasses.replace(lengths, prompt_tokens=[args.prompt_tokens] * args.prompts)


async def run_variant(
    variant: str, cost: CostModel, lengths: LengthModel, args: argparse.Namespace
) -> list[dict[str, Any]]:
    devices = args.nodes * args.devices_per_node
    fleet = await sim_fleet(lengths, cost=cost, devices=devices, tp_sizes=(args.tp,), tp=args.tp,
                            max_num_seqs=args.max_num_seqs, chunk=args.chunk, nodes=args.nodes,
                            host_latency_s=args.host_latency_ms / 1e3)
    node = fleet.replicas[0].node
    slowed = dataclasses.replace(cost, base_s=cost.base_s * args.thread_decode_slowdown,
                                 per_seq_s=cost.per_seq_s * args.thread_decode_slowdown)

    def generating() -> bool:
        return sum(fleet.in_flight) > 0

    def share() -> float:
        if variant == "borrow" and fleet.lent and generating():
            return len(fleet.lent) / len(fleet.replicas)
        if variant == "thread" and generating():
            return args.thread_train_speed
        return 1.0

    def on_busy(busy: bool) -> None:
        if variant == "thread" and (generating() or not busy):
            for r in fleet.replicas:
                r.set_cost(slowed if busy else cost)

    train_cost = TrainCost(token_s=1.0 / (args.train_tokens_per_s * devices), finish_s=args.finish_s)
    trainer = sim_trainer(node, train_cost, share, on_busy)
    streaming = Streaming(
        mode=variant, start_frac=args.start_frac, chunk_tokens=args.chunk_tokens,
        borrow=BorrowRule(min_frac=args.borrow_min, max_frac=args.borrow_max, check_s=args.check_s),
    )
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0,
                        max_tokens=args.max_tokens, seed=args.seed)
    policy = TailPolicy(lengths.prompts(), sampling, eta_prompts=args.eta, eta_responses=args.eta)
    return await sim_steps(args.steps, policy, fleet, trainer, step_record, streaming=streaming,
                           lending_fleet=fleet)


def summarize(variant: str, records: Sequence[Mapping[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in records)

    busy = sum(r["time_train_busy_s"] for r in records)
    fired = [r["borrow_frac"] for r in records if r["borrow_frac"] is not None]
    kept = args.nodes * args.devices_per_node // args.tp // 2
    return {
        "variant": variant,
        "steps": len(records),
        "prompts_trained": sum(r["prompts"] for r in records),
        "rollout_s": mean("time_rollout_s"),
        "train_exposed_s": mean("time_train_s"),
        "sync_s": mean("time_sync_s"),
        "step_s": mean("time_step_s"),
        "step_s_total": sum(r["time_step_s"] for r in records),
        "train_busy_s": busy / len(records),
        "hidden_share": sum(r["time_train_hidden_s"] for r in records) / busy if busy else 0.0,
        "loans": len(fired),
        "trigger_frac_mean": statistics.fmean(fired) if fired else None,
        "migrate_s": mean("time_migrate_s"),
        "migrated_requests": mean("migrated_requests"),
        "migrated_tokens": mean("migrated_tokens"),
        # the moved tokens' recomputation, spread over the kept replicas
        "reprefill_s_est": mean("migrated_tokens") / kept / (args.prefill_tokens_per_s * args.tp),
        "kinds": [r["round_kind"] for r in records],
        "step_s_per_step": [r["time_step_s"] for r in records],
    }


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    cost = cost_model(args)
    lengths = paper_lengths(args)
    rows = [summarize(v, await run_variant(v, cost, lengths, args), args) for v in args.variants]
    base = next((r for r in rows if r["variant"] == "none"), None)
    for r in rows:
        r["speedup_vs_none"] = (
            (base["step_s_total"] / base["prompts_trained"]) / (r["step_s_total"] / r["prompts_trained"])
            if base else None
        )
    return {"cost": dataclasses.asdict(cost), "rows": rows,
            "args": args_json(args)}


COLUMNS = (
    Col("variant", "variant", 8, "<"), Col("rollout s", "rollout_s", 10, ".1f"),
    Col("train exp s", "train_exposed_s", 12, ".1f"), Col("sync s", "sync_s", 8, ".1f"),
    Col("step s", "step_s", 8, ".1f"), Col("vs none", "speedup_vs_none", 9, ".3f", "x"),
    Col("trigger", "trigger_frac_mean", 8, ".2f"), Col("migrate ms", "migrate_ms", 11, ".1f"),
    Col("moved req", "migrated_requests", 10, ".0f"), Col("re-prefill s", "reprefill_s_est", 13, ".2f"),
    Col("hidden", "hidden_share", 8, ".0%"),
)


def print_table(result: Mapping[str, Any]) -> None:
    common.print_table([{**r, "migrate_ms": r["migrate_s"] * 1e3} for r in result["rows"]], COLUMNS)


def parser() -> argparse.ArgumentParser:
    ap = common.parser(__doc__)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_setting_args(ap, steps=10, steps_help="2 periods of 4 short + 1 long round", prompts=1280)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--host-latency-ms", type=float, default=2.0, help="per call, remote nodes")
    ap.add_argument("--train-tokens-per-s", type=float, default=3000.0, help="per device")
    ap.add_argument("--finish-s", type=float, default=1.0, help="optimizer step + reduction")
    ap.add_argument("--thread-train-speed", type=float, default=0.5)
    ap.add_argument("--thread-decode-slowdown", type=float, default=1.5)
    ap.add_argument("--start-frac", type=float, default=0.0, help="thread: groups done first")
    ap.add_argument("--chunk-tokens", type=int, default=65_536, help="trainer call size")
    ap.add_argument("--borrow-min", type=float, default=0.2)
    ap.add_argument("--borrow-max", type=float, default=0.5)
    ap.add_argument("--check-s", type=float, default=1.0, help="trigger's rate window")
    return ap


def main() -> int:
    args = parser().parse_args()
    result = asyncio.run(compare(args))
    print(f"\n{args.nodes} nodes x {args.devices_per_node} devices, TP {args.tp}, P0={args.p0} x "
          f"R0={args.r0}, {args.max_tokens} max tokens, {args.steps} steps, virtual seconds "
          f"(means per step)")
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
