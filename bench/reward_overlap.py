"""Does scoring hide under generation? Runs the default job's components (tiny model,
built-in task, vLLM CPU engine, trainer) with a reward that costs a real 50-200 ms per
sample, in two variants that alternate step by step on the same engine and trainer:

- `overlapped`: the default loop, each response scored the moment it is accepted;
- `after`: nothing scored until generation is over (`run_step(overlap_reward=False)`).

The reward's cost is a `time.sleep` inside the process-pool worker (deterministic per
response text, uniform in --cost-ms), on top of the built-in exact-answer check: it
stands for a verifier that waits (a sandbox, a judge service) without loading the two
CPU cores the engine and trainer share. The target: overlapped rollout time (generation
plus the scoring still exposed after it) within 10% of generation alone.

    .venv/bin/python -m bench.reward_overlap --steps 4 --out bench/results/reward_overlap.json
    .venv/bin/python -m bench.reward_overlap --steps 3 -- --rollout.prompts_per_step 16

Arguments after `--` are config overrides (as for rpk.run). Each variant's first step is
left out of the medians: it pays one-off warm-up costs (engine, worker start).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import zlib
from typing import Any

from bench import common
from bench.common import Col, split_passthrough, write_json
from rpk import config
from rpk.core.outcomes import StepOutcome
from rpk.loop.step import run_step
from rpk.tasks import arith, task

VARIANTS = ("overlapped", "after")
COST_MS = (50.0, 200.0)


def slow_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """The built-in check plus a sleep of 50-200 ms, fixed by the response text."""
    lo, hi = COST_MS
    u = zlib.crc32(str(solution_str).encode()) / 2**32
    time.sleep((lo + (hi - lo) * u) / 1000)
    return arith.compute_score(data_source, solution_str, ground_truth)


def _row(variant: str, outcomes: list[StepOutcome]) -> dict[str, Any]:
    measured = common.measured(outcomes)
    return {
        "variant": variant,
        "steps": len(outcomes),
        **common.reward_step_medians(outcomes, "_median"),
        "train_s_median": statistics.median(o.time_train_s for o in measured),
        "reward_mean": statistics.fmean(
            m.reward for o in measured for g in o.round.groups for m in g.members
        ),
    }


async def _bench(
    cfg: config.Config, steps: int, variants: tuple[str, ...]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from rpk import assembly
    from rpk.train.losses import advantage_fn

    model_dir = await asyncio.to_thread(assembly.resolve_model, cfg.model, task(cfg.data.task), print)
    prompts = await asyncio.to_thread(assembly.load_prompts, assembly.prompt_source(cfg), model_dir)
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), model_dir, prompts, print)
    policies = {v: assembly.build_round_policy(cfg.rollout, prompts, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
                for v in variants}
    engine, scorer, trainer = parts.engine, parts.scorer, parts.trainer
    outcomes: dict[str, list[StepOutcome]] = {v: [] for v in variants}
    try:
        for step in range(1, steps + 1):
            for variant in variants:
                outcome = await run_step(
                    step, policies[variant], engine, scorer, trainer,
                    advantage_fn(cfg.train.loss), version=trainer.version,
                    overlap_reward=variant == "overlapped",
                )
                outcomes[variant].append(outcome)
                print(
                    f"step {step} {variant:<10} step {outcome.time_step_s:6.2f}s  rollout "
                    f"{outcome.time_rollout_s:6.2f}s  reward exposed "
                    f"{outcome.round.reward_exposed_s:5.2f}s", flush=True,
                )
        pool = scorer.metrics()
    finally:
        await parts.aclose()
    return [_row(v, outcomes[v]) for v in variants], pool


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__, "write the result rows as a JSON list here")
    ap.add_argument("--steps", type=int, default=4, help="steps per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, run in turn")
    ap.add_argument("--workers", type=int, default=16, help="reward.max_workers (sleeping workers cost no CPU)")
    args = ap.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = set(variants) - set(VARIANTS)
    if unknown or args.steps < 1:
        ap.error(f"variants must be among {VARIANTS} and steps >= 1, got {args.variants!r}, {args.steps}")
    # Imported here, not at the top: pool workers import this module for slow_score
    # and must not pay for the vLLM stack that rpk.run pulls in.
    from rpk import run

    run.quiet_libraries()
    cfg = config.from_argv([
        "--rollout.policy", "sync", "--reward.function", "bench.reward_overlap:slow_score",
        "--reward.max_workers", str(args.workers), "--run.progress", "false", *passthrough,
    ])
    started = time.monotonic()
    rows, pool = run.run_async(_bench(cfg, args.steps, variants), use_uvloop=cfg.run.uvloop)
    print(f"\nreward overlap: {cfg.rollout.prompts_per_step} x {cfg.rollout.responses_per_prompt} "
          f"responses/step, reward {COST_MS[0]:.0f}-{COST_MS[1]:.0f} ms each (sleep in the worker), "
          f"medians over steps 2..{args.steps}")
    cols = ("step_s_median", "rollout_s_median", "generation_s_median", "reward_exposed_s_median",
            "reward_busy_s_median", "train_s_median")
    common.print_table(rows, [Col("variant", "variant", 12, "<"),
                              *(Col(c.removesuffix("_median"), c, 18, ".3f") for c in cols)])
    for r in rows:
        r["rollout_over_generation"] = r["rollout_s_median"] / r["generation_s_median"]
        print(f"{r['variant']}: rollout / generation = {r['rollout_over_generation']:.3f}")
    print(f"pool at the end: {json.dumps(pool)}; wall {time.monotonic() - started:.0f}s")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
