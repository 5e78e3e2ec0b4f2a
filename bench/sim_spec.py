"""The speculative tail on virtual time: each policy with and without speculative
decoding, in the paper's Table 2 settings (bench/paper_table.py), over several seeds.

    .venv/bin/python -m bench.sim_spec --out bench/results/sim_spec.json

Every figure is virtual time: the real loop, policies and speculation planner
(`rpk.sched.speculate`, the code the real engine path runs) on the simulator, whose
replica verifies drafts at the cost of a decode step over the tokens it runs
(`CostModel.verify_s`) and accepts them as the published acceptance says
(`rpk.sim.accept`: tau 2.05 at k = 3, acceptance falling with the position). Drafts
come from the prompt's finished siblings, its aborted partial responses and its earlier
epochs' responses; the planner decides the draft length by batch size each round from
what the replica measured. Speculation changes when a response's tokens arrive, never
which tokens: each response keeps the length the length model gives it.

Two tables: length_aware with speculation against without, per setting (medians over
`--seeds` seeds of the rollout seconds per trained prompt, and the ratio of medians); and
Table 2 style rows, each policy off and on, end to end over sync without speculation
(the same training and reward seconds per trained token as bench/paper_table.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench import common
from bench.common import Col, sim_steps, write_json
from bench.paper_table import SETTINGS, lengths_for, other_share
from rpk.core.drafts import DraftSource
from rpk.loop.speculate import SpecTail
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import step_record
from rpk.sched.policies import PolicyOptions, make_policy
from rpk.sched.policy import Sampling
from rpk.sched.speculate import SpecRule
from rpk.sim import SimEngine, SimSpec, SoloFleet
from rpk.sim.accept import FALL, NEMO_RL_TAU, calibrated
from rpk.sim.trainer import NullTrainer

POLICIES = ("sync", "tail", "length_aware")
# The sources copied from another response of the prompt (the calibrated ones).
SOURCES = frozenset({DraftSource.SIBLING, DraftSource.PARTIAL, DraftSource.EPOCH})


async def run_one(policy_name: str, setting: Mapping[str, Any], seed: int, speculate: bool,
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    lengths = lengths_for(setting, args.prompts, args.p0, seed)
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0,
                        max_tokens=setting["max_tokens"])
    options = PolicyOptions(
        eta_prompts=args.eta, eta_responses=args.eta, concurrency=args.concurrency,
        lookahead_rounds=args.lookahead,
        spec_sources=SOURCES if speculate else frozenset(),
        spec_rule=SpecRule(max_k=args.max_k) if speculate else None)
    policy = make_policy(policy_name, lengths.prompts(), sampling, options)
    sim_spec = SimSpec(calibrated(args.tau, args.fall), seed) if speculate else None
    engine = SimEngine(lengths, cost=setting["cost"], max_concurrency=args.concurrency,
                       chunk=max(1, setting["max_tokens"] // 128), spec=sim_spec)
    tail = SpecTail(policy.speculation, SoloFleet(engine)) if speculate else None
    trainer = AsyncTrainer(NullTrainer())

    def record(o: Any) -> dict[str, Any]:
        return {**step_record(o), **policy.metrics(), **(tail.record() if tail else {})}

    return await sim_steps(args.steps, policy, engine, trainer, record, spec=tail)


def totals(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    drafts = sum(r.get("spec_drafts", 0.0) for r in records)
    accepted = sum(r.get("spec_accepted", 0.0) for r in records)
    long = [r["time_rollout_s"] for r in records if r["round_kind"] == "long"]
    return {
        "rollout_s": sum(r["time_rollout_s"] for r in records),
        "long_round_rollout_s": sum(long),
        "prompts": sum(r["prompts"] for r in records),
        "tokens_trained": sum(r["response_len_mean"] * r["responses"] for r in records),
        "tokens_off_policy": sum(r.get("tokens_off_policy", 0) for r in records),
        "tokens_per_verify": 1 + accepted / drafts if drafts else None,
        "spec_steps": sum(r.get("spec_steps", 0.0) for r in records),
        "spec_k_max": max((r.get("spec_k_max", 0.0) for r in records), default=0.0),
    }


def run_setting(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    setting = SETTINGS[name]
    other = other_share(name)
    runs: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        # the Table 2 rows' other policies over the first `table2_seeds` seeds only
        policies = [p for p in args.policies if p == "length_aware" or seed < args.table2_seeds]
        got = {(p, on): totals(asyncio.run(run_one(p, setting, seed, on, args)))
               for p in policies for on in (False, True)}
        base = got.get(("sync", False))
        # training + reward per trained token, as bench/paper_table.py charges it
        per_token = (other / (1 - other) * base["rollout_s"] / base["tokens_trained"]) if base else None
        for (p, on), t in got.items():
            step = t["rollout_s"] + (per_token or 0.0) * t["tokens_trained"]
            runs.append({"setting": name, "policy": p, "speculative": "copy" if on else "off", "seed": seed,
                         **t, "rollout_s_per_prompt": t["rollout_s"] / t["prompts"],
                         "step_s_per_prompt": step / t["prompts"] if per_token is not None else None})
            print(f"  {name} seed {seed} {p:<12} {'on ' if on else 'off'} rollout/prompt "
                  f"{t['rollout_s'] / t['prompts']:.3f} s  tau {t['tokens_per_verify'] or 0:.2f}", flush=True)
    return runs


def _median(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: Sequence[Mapping[str, Any]], settings: Sequence[str], policies: Sequence[str]
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(speculation on against off per setting and policy, Table 2 style rows)."""
    pairs, table2 = [], []
    for name in settings:
        def of(p: str, spec: str, name: str = name) -> list[Mapping[str, Any]]:
            return [r for r in runs if r["setting"] == name and r["policy"] == p and r["speculative"] == spec]

        for p in policies:
            off, on = of(p, "off"), of(p, "copy")
            if not off or not on:
                continue
            ratios = [a["rollout_s_per_prompt"] / b["rollout_s_per_prompt"]
                      for a, b in zip(sorted(off, key=lambda r: r["seed"]), sorted(on, key=lambda r: r["seed"]))]
            pairs.append({
                "setting": name, "policy": p, "seeds": len(ratios),
                "off_rollout_s_per_prompt": _median(off, "rollout_s_per_prompt"),
                "on_rollout_s_per_prompt": _median(on, "rollout_s_per_prompt"),
                "speedup": _median(off, "rollout_s_per_prompt") / _median(on, "rollout_s_per_prompt"),
                "speedup_min": min(ratios), "speedup_max": max(ratios),
                "long_speedup": (_median(off, "long_round_rollout_s") / _median(on, "long_round_rollout_s")
                                 if _median(on, "long_round_rollout_s") else None),
                # end to end (the seeds that ran sync, whose step prices the training)
                "e2e_speedup": (_median(off, "step_s_per_prompt") / _median(on, "step_s_per_prompt")
                                if _median(on, "step_s_per_prompt") else None),
                "tokens_per_verify": _median(on, "tokens_per_verify"),
                "tokens_off_policy": sum(r["tokens_off_policy"] for r in on),
            })
        sync = _median(of("sync", "off"), "step_s_per_prompt")
        if sync is None:
            continue
        row: dict[str, Any] = {"setting": name}
        for p in policies:
            for spec in ("off", "copy"):
                s = _median(of(p, spec), "step_s_per_prompt")
                row[f"{p}_{spec}"] = sync / s if s else None
        table2.append(row)
    return pairs, table2


PAIR_COLUMNS = (
    Col("setting", "setting", 9, "<"), Col("policy", "policy", 12, "<"), Col("seeds", "seeds", 5),
    Col("off s/prompt", "off_rollout_s_per_prompt", 13, ".3f"),
    Col("on s/prompt", "on_rollout_s_per_prompt", 12, ".3f"),
    Col("on/off", "speedup", 7, ".3f", "x"), Col("min", "speedup_min", 7, ".3f", "x"),
    Col("max", "speedup_max", 7, ".3f", "x"), Col("long rounds", "long_speedup", 12, ".3f", "x"),
    Col("end to end", "e2e_speedup", 11, ".3f", "x"),
    Col("tau", "tokens_per_verify", 6, ".2f"), Col("off-policy", "tokens_off_policy", 11),
)


def table2_columns(policies: Sequence[str]) -> tuple[Col, ...]:
    return (Col("setting", "setting", 9, "<"),
            *(Col(f"{p} {s}", f"{p}_{k}", max(9, len(p) + 5), ".2f", "x")
              for p in policies for s, k in (("off", "off"), ("on", "copy"))))


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    common.add_sampling_args(ap, steps=30, steps_help=None, prompts=1280)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="settings run at once, one process each")
    ap.add_argument("--table2-seeds", type=int, default=1, help="seeds of the policies besides length_aware")
    ap.add_argument("--lookahead", type=int, default=10, help="length_aware: rounds per draw")
    ap.add_argument("--concurrency", type=int, default=4096)
    ap.add_argument("--max-k", type=int, default=8, help="the longest draft (vLLM's num_speculative_tokens)")
    ap.add_argument("--tau", type=float, default=NEMO_RL_TAU[0], help="tokens per verify at k = 3")
    ap.add_argument("--fall", type=float, default=FALL, help="acceptance at position i+1 over that at i")
    args = ap.parse_args()
    # settings are independent: one process each, `--jobs` at a time (virtual time does
    # not depend on how the host shares its cores)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = [r for got in pool.map(run_setting, args.settings, [args] * len(args.settings)) for r in got]
    pairs, table2 = summarize(runs, args.settings, args.policies)
    print(f"\nrollout seconds per trained prompt (virtual), median of the seeds, speculation "
          f"off and on (tau {args.tau} at k = 3, fall {args.fall}):")
    common.print_table(pairs, PAIR_COLUMNS)
    if table2:
        print("\nend to end over sync without speculation (virtual; Table 2's row), median of seeds:")
        common.print_table(table2, table2_columns(args.policies))
    acceptance = calibrated(args.tau, args.fall).acceptance(DraftSource.SIBLING)
    write_json(args.out, {"args": common.args_json(args), "pairs": pairs, "table2": table2, "runs": runs,
                          "acceptance_by_position": list(acceptance.by_position),
                          "tau_by_k": {k: acceptance.tokens_per_verify(k) for k in range(1, args.max_k + 1)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
