"""Rollout policies on trajectories: the multi-turn task (`data.task tool_add`, long
additions through a 4-digit adder tool whose calls take the tool latency model's time,
`agent.tool_latency`) under sync, tail and length_aware, the same model, data and seed
for the same number of steps, on the real engine.

    .venv/bin/python -m bench.multi_turn --steps 10 --seeds 0 1 2 --val 128 --out bench/results/multi_turn_latency.json
    .venv/bin/python -m bench.multi_turn --policies sync tail -- --rollout.prompts_per_step 8

Arguments after `--` go to every run as config overrides (after the bench's own, which
size the runs for a CPU: see `COMMON`). Each run trains the same trajectories (P0 x R0 a
step); its row reports trajectories trained per wall-clock second (over every step's
time: rollout, training, weight sync) and against sync's of the same seed, the bubble
ratio of short and long rounds, the share of generated tokens thrown away (aborted
trajectories), the wall seconds the engine idled with trajectories in flight
(`engine_idle_s`: no model turn decoding anywhere) and of those the seconds some
trajectory waited on a tool (`tool_exposed_s`), and with `--val N` the greedy accuracy
on N held-out prompts after the last step (so at equal trajectories) with its distance
from sync's in standard errors of the difference. Over several seeds a row per policy
pools them. A second table gives the rollout detail: rollout seconds per trained
prompt, model turns per trajectory (mean and max), tool calls and failures, seconds in
tool calls (summed over calls) and their ratio to rollout time, and reward.

`--sim` runs the same policies on the simulator instead (virtual time, `rpk/sim/agent.py`),
at a GPU's cost curve: tool_add's prompts with their calls (one a 4-digit chunk),
`--turn-tokens` sampled per turn, each call the latency model's draw (a timeout's at
most), no model:

    .venv/bin/python -m bench.multi_turn --sim --steps 20
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench import common
from bench.common import Col, sim_steps, split_passthrough, table_line, write_json
from bench.rollout_policies import print_table, summarize_policy
from rpk.sim import CostModel, SimEngine

POLICIES = ("sync", "tail", "length_aware")

# A run a 2-core CPU finishes in minutes: 16 prompts x 8 trajectories a step, trajectory
# budget for a 20-digit sum with retries; validation (greedy only) after the last step.
COMMON = (
    "--data.task", "tool_add", "--rollout.prompts_per_step", "16",
    "--rollout.responses_per_prompt", "8", "--rollout.max_tokens", "640",
    "--run.eval_every", "0",
)


def _sum(records: Sequence[Mapping[str, Any]], key: str) -> float:
    return float(sum(r.get(key, 0.0) for r in records))


def summarize(policy: str, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """rollout_policies' row for `policy`, with the trajectories' turns and tools."""
    row = summarize_policy(policy, records)
    turns = [r["turns_mean"] for r in records if "turns_mean" in r]
    tool_s = _sum(records, "tool_seconds")
    rollout_s = row["rollout_s_total"]
    row.update({
        "turns_mean": statistics.fmean(turns) if turns else None,
        "turns_max": max((r["turns_max"] for r in records if "turns_max" in r), default=None),
        "tool_calls": int(_sum(records, "tool_calls")),
        "tool_failures": int(_sum(records, "tool_failures")),
        "tool_s": tool_s,
        "tool_s_per_rollout_s": tool_s / rollout_s if rollout_s else None,
        "tool_exposed_s": _sum(records, "tool_exposed_s"),
        "engine_idle_s": _sum(records, "engine_idle_s"),
        "masked_token_frac": statistics.fmean(
            [r["masked_token_frac"] for r in records if "masked_token_frac" in r]
        ) if turns else None,
    })
    return row


COLUMNS = (
    Col("policy", "policy", 13, "<"), Col("prompts", "prompts_trained", 8, "d"),
    Col("seed", "seed", 5, ">"), Col("s/prompt", "rollout_s_per_prompt", 9, ".3f"),
    Col("bubble sh", "bubble_ratio_short_mean", 10, ".3f"),
    Col("bubble lg", "bubble_ratio_long_mean", 10, ".3f"),
    Col("wasted", "tokens_wasted_frac", 8, ".1%"),
    Col("turns", "turns_mean", 7, ".2f"), Col("max", "turns_max", 5, ".0f"),
    Col("calls", "tool_calls", 7, "d"), Col("fails", "tool_failures", 6, "d"),
    Col("tool s", "tool_s", 9, ".1f"), Col("tool/roll", "tool_s_per_rollout_s", 10, ".3f"),
    Col("idle s", "engine_idle_s", 8, ".3f"), Col("exposed s", "tool_exposed_s", 10, ".3f"),
    Col("reward", "reward_mean", 8, ".3f"),
)


# A 7B model on one H100-class GPU, as bench.sim_policies has it: memory bound.
GPU_COST = CostModel(base_s=0.015, per_seq_s=5e-5)
SIM_COLUMNS = (
    Col("policy", "policy", 13, "<"), Col("trajectories", "trajectories", 13, "d"),
    Col("traj/s", "trajectories_per_s", 8, ".2f"), Col("vs sync", "vs_sync", 8, ".2f", "x"),
    Col("wasted", "tokens_wasted_frac", 8, ".1%"), Col("turns", "turns_mean", 7, ".2f"),
    Col("tool s p99", "tool_s_p99", 11, ".2f"), Col("idle s", "engine_idle_s", 8, ".1f"),
    Col("exposed s", "tool_exposed_s", 10, ".1f"), Col("rollout s", "rollout_s_total", 10, ".1f"),
)


async def _sim_policy(policy_name: str, args: Any) -> list[dict[str, Any]]:
    from rpk.agent.engine import AgentEngine
    from rpk.config.inputs import ToolLatencyConfig
    from rpk.core.records import Prompt
    from rpk.loop.trainer import AsyncTrainer
    from rpk.obs.metrics import step_record
    from rpk.sched.policies import PolicyOptions, make_policy
    from rpk.sched.policy import Sampling
    from rpk.sched.toolwait import LatencyModel
    from rpk.sim.agent import SimObservation, SimToolEnvs
    from rpk.sim.trainer import NullTrainer
    from rpk.tasks import tool_add

    rows = tool_add.make_rows(args.prompts, seed=10_000)
    calls = {f"p{i}": row["extra_info"]["calls"] for i, row in enumerate(rows)}
    prompts = [Prompt(f"p{i}", (7, i) + (0,) * 30, "sim", "") for i in range(len(rows))]
    lat = ToolLatencyConfig()
    engine = SimEngine(lambda r: args.turn_tokens, cost=GPU_COST, max_concurrency=args.concurrency)
    latency = LatencyModel(lat.median_s, lat.p99_s, lat.timeout_frac)
    envs = SimToolEnvs(engine.node, latency, lambda p: calls[p.uid], timeout_s=args.tool_timeout)
    agent = AgentEngine(engine, envs, SimObservation(16), {p.uid: p for p in prompts},
                        max_turns=16, clock=engine.clock)
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0, max_tokens=2000)
    options = PolicyOptions(
        eta_prompts=args.eta, eta_responses=args.eta, concurrency=args.concurrency,
        tool_latency=latency, tool_timeout_s=args.tool_timeout,
    )
    policy = make_policy(policy_name, prompts, sampling, options)
    records = await sim_steps(args.steps, policy, agent, AsyncTrainer(NullTrainer()),
                              lambda o: {**step_record(o), **policy.metrics(), **agent.lap()})
    return records


def _latency() -> str:
    from rpk.config.inputs import ToolLatencyConfig

    lat = ToolLatencyConfig()
    return f"median {lat.median_s} s, p99 {lat.p99_s} s, {lat.timeout_frac:.0%} never answer"


def sim_table(args: Any) -> list[dict[str, Any]]:
    """The policies on virtual time at a GPU setting, one row each."""
    import asyncio

    rows = []
    for policy in args.policies:
        records = asyncio.run(_sim_policy(policy, args))
        row = summarize(policy, records)
        row["trajectories"] = sum(r["responses"] for r in records)
        row["trajectories_per_s"] = row["trajectories"] / row["rollout_s_total"]
        row["tool_s_p99"] = max(r.get("tool_s_p99", 0.0) for r in records)
        rows.append(row)
    sync = next((r for r in rows if r["policy"] == "sync"), None)
    for row in rows:
        row["vs_sync"] = row["trajectories_per_s"] / sync["trajectories_per_s"] if sync else None
    return rows


def _with_val(row: dict[str, Any], records: Sequence[Mapping[str, Any]],
              evals: Sequence[Mapping[str, Any]], seed: int) -> dict[str, Any]:
    """`row` with its seed, trajectories trained per wall-clock second (every step's
    time: rollout, training and weight sync) and the last validation's greedy accuracy."""
    trajectories = int(_sum(records, "responses"))
    last = next((e for e in reversed(evals) if "val/acc_greedy" in e), None)
    return {
        **row, "seed": seed, "trajectories": trajectories,
        "trajectories_per_s": trajectories / row["step_s_total"] if row["step_s_total"] else None,
        "val_acc": last["val/acc_greedy"] if last else None,
        "val_se": last["val/acc_greedy_se"] if last else None,
    }


def pooled(policy: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`policy`'s seeds together: trajectories per second over all their steps' time,
    the seeds' mean accuracy and its standard error (the seeds' validation passes are
    independent draws of the same size)."""
    mine = [r for r in rows if r["policy"] == policy]
    step_s = sum(r["step_s_total"] for r in mine)
    accs = [r["val_acc"] for r in mine if r["val_acc"] is not None]
    ses = [r["val_se"] for r in mine if r["val_se"] is not None]
    return {
        "policy": policy, "seed": "all", "trajectories": sum(r["trajectories"] for r in mine),
        "step_s_total": step_s,
        "trajectories_per_s": sum(r["trajectories"] for r in mine) / step_s if step_s else None,
        "engine_idle_s": sum(r["engine_idle_s"] for r in mine),
        "tool_exposed_s": sum(r["tool_exposed_s"] for r in mine),
        "tokens_wasted_frac": statistics.fmean(r["tokens_wasted_frac"] for r in mine),
        "bubble_ratio_short_mean": _mean_of(mine, "bubble_ratio_short_mean"),
        "bubble_ratio_long_mean": _mean_of(mine, "bubble_ratio_long_mean"),
        "val_acc": statistics.fmean(accs) if accs else None,
        "val_se": (sum(se * se for se in ses) ** 0.5) / len(ses) if ses else None,
    }


def _mean_of(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def against_sync(rows: list[dict[str, Any]]) -> None:
    """Each row's trajectories per second against sync's of its seed, and its accuracy's
    distance from sync's in standard errors of the difference."""
    sync = {r["seed"]: r for r in rows if r["policy"] == "sync"}
    for row in rows:
        base = sync.get(row["seed"])
        row["vs_sync"] = (row["trajectories_per_s"] / base["trajectories_per_s"]
                          if base and row["trajectories_per_s"] and base["trajectories_per_s"] else None)
        ok = base and row["val_acc"] is not None and base["val_acc"] is not None
        se = (row["val_se"] ** 2 + base["val_se"] ** 2) ** 0.5 if ok else 0.0
        row["val_z"] = (row["val_acc"] - base["val_acc"]) / se if ok and se > 0 else None


REAL_COLUMNS = (
    Col("policy", "policy", 13, "<"), Col("seed", "seed", 5, ">"),
    Col("traj", "trajectories", 6, "d"), Col("traj/s", "trajectories_per_s", 8, ".2f"),
    Col("vs sync", "vs_sync", 8, ".2f", "x"),
    Col("bubble sh", "bubble_ratio_short_mean", 10, ".3f"),
    Col("bubble lg", "bubble_ratio_long_mean", 10, ".3f"),
    Col("wasted", "tokens_wasted_frac", 8, ".1%"),
    Col("idle s", "engine_idle_s", 8, ".1f"), Col("exposed s", "tool_exposed_s", 10, ".1f"),
    Col("steps s", "step_s_total", 9, ".1f"),
    Col("val acc", "val_acc", 8, ".3f"), Col("+-se", "val_se", 6, ".3f"),
    Col("z vs sync", "val_z", 10, ".2f"),
)


def real_table(args: Any, passthrough: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """Every policy on every seed on the real engine (one policy after another within a
    seed): a row per run, then a row per policy over its seeds."""
    val = ("--data.val_size", str(args.val), "--run.eval_k", "0",
           "--run.eval_before_train", "false")
    rows = []
    for seed in args.seeds:
        for policy in args.policies:
            print(f"== {policy}, seed {seed}: {args.steps} steps", flush=True)
            code, records, evals = common.run_phases([
                *COMMON, *val, "--rollout.policy", policy, "--run.seed", str(seed),
                "--run.steps", str(args.steps), *passthrough,
            ])
            if code != 0:
                return code, rows
            rows.append(_with_val(summarize(policy, records), records, evals, seed))
            against_sync(rows)
            print(table_line(rows[-1], REAL_COLUMNS), flush=True)
    if len(args.seeds) > 1:
        rows += [pooled(policy, rows) for policy in args.policies]
    against_sync(rows)
    return 0, rows


def main(argv: Sequence[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    ap = common.parser(__doc__, "write the JSON list here")
    common.add_sampling_args(ap, 10, "steps per policy (P0 prompts each)", 512, p0=32)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="run.seed of each run")
    ap.add_argument("--val", type=int, default=0,
                    help="held-out prompts, validated greedily after the last step (0: none)")
    ap.add_argument("--sim", action="store_true", help="on the simulator, at a GPU setting")
    ap.add_argument("--turn-tokens", type=int, default=40, help="sim: tokens sampled per turn")
    ap.add_argument("--concurrency", type=int, default=512, help="sim: the engine's sequences")
    ap.add_argument("--tool-timeout", type=float, default=10.0, help="sim: agent.tool_timeout_s")
    args = ap.parse_args(own)
    if args.sim:
        rows = sim_table(args)
        print(f"\nsimulator, GPU cost model ({GPU_COST}), tool latency {_latency()}, "
              f"{args.steps} steps, virtual seconds:")
        print_table(rows, SIM_COLUMNS)
        write_json(args.out, rows)
        return 0
    code, rows = real_table(args, passthrough)
    if code != 0:
        return code
    print(f"\ntool latency {_latency()}:")
    common.print_table([r for r in rows if r["seed"] != "all"], COLUMNS)
    print()
    common.print_table(rows, REAL_COLUMNS)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
