"""The judge's two tables: RollPacker's streaming reward with an LLM judge on the real
CPU engine, and its colocated, layer-streamed judge on the simulator's GPU cost model.

Table 1, real CPU engine: the built-in task's rows all judged by a vLLM judge engine
(the tiny policy model serves as the judge: it judges at random, which does not change
what a verdict costs), in two variants that alternate step by step on the same engines
and trainer: `streaming`, each response sent to the judge the moment it finishes (rpk's
default), and `after`, nothing judged until generation is over. The figure is the
reward time exposed after the last response, and the step time; the paper reports
1.18-1.48x per step for its asynchronous reward over scoring after rollout.

Table 2, GPU cost model (`rpk.sim.judge`, its docstring states the assumptions): the
paper's judge (Qwen2.5-7B, 28 layers) beside the actor at 7B/8k, 14B/16k, 32B/32k.
Figure 13b: mean seconds per verdict at batch 1, resident against layers streamed
over PCIe unpipelined and pipelined (vLLM's prefetch offload), over the setting's
response lengths and at its longest; the paper: 1.1 / 1.1 / 1.4x. Figure 13a: a
node's step with a judge on each rollout GPU under MPS against a judge on a GPU of
its own; the paper: up to 1.25x at 7B/8k. Lengths are bench/paper_table's log-normal
(its median per setting, sigma 1.1, capped); the rollout seconds per round are veRL's
in the paper (one fifth of its period), training the share paper_table derives.

    .venv/bin/python -m bench.judge --steps 4 --out bench/results/judge.json
    .venv/bin/python -m bench.judge --dry      # Table 2 only (no engine), seconds

Arguments after `--` are config overrides for Table 1 (as for rpk.run). Each variant's
first step is left out of the medians (warm-up).
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from typing import Any

from bench import common
from bench.common import Col, split_passthrough, write_json
from bench.paper_table import PAPER_PERIOD, SETTINGS, SIGMA, other_share
from rpk.sim.judge import (
    QWEN25_7B,
    GpuCost,
    StepShape,
    colocated_step,
    dedicated_step,
    offload_times,
)

VARIANTS = ("streaming", "after")
PAPER_ASYNC = (1.18, 1.48)
PAPER_13B = {"7B/8k": 1.1, "14B/16k": 1.1, "32B/32k": 1.4}
PAPER_13A = {"7B/8k": 1.25}
# Digits are single tokens of the tiny model's tokenizer, whose context is 512 tokens:
# the built-in template and rules would not fit.
TEMPLATE = "Q {question} R {reference}\n<response>\n{response}\n</response>\n{yes} or {no}?"
# The judge sees a response's tail: the question, reference and template beside it must
# stay within the tiny model's 512 positions.
RESPONSE_CHARS = 256
PROMPT_TOKENS = 256  # question, reference and template around each response
RESPONSES = 512  # a node's share of 128 prompts x 8 responses over 16 GPUs
ROUNDS_PER_PERIOD = 5  # paper_table's period: 4 short rounds and 1 long


# -- Table 2: the cost model ---------------------------------------------------------------


def judge_lengths(setting: str, n: int, seed: int) -> tuple[int, ...]:
    s = SETTINGS[setting]
    rng = random.Random(seed)
    return tuple(
        min(s["max_tokens"], max(1, int(math.exp(math.log(s["median"]) + SIGMA * rng.gauss(0.0, 1.0)))))
        + PROMPT_TOKENS for _ in range(n)
    )


def fig13b(gpu: GpuCost, offloads: tuple[int, ...], n: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for setting in SETTINGS:
        lengths = judge_lengths(setting, n, seed)
        longest = SETTINGS[setting]["max_tokens"] + PROMPT_TOKENS
        for offloaded in offloads:
            mean = offload_times(QWEN25_7B, gpu, lengths, offloaded)
            top = offload_times(QWEN25_7B, gpu, [longest], offloaded)
            rows.append({
                "setting": setting, "offloaded": f"{offloaded}/{QWEN25_7B.layers}",
                "resident_ms": 1e3 * mean.resident, "unpipelined_ms": 1e3 * mean.unpipelined,
                "pipelined_ms": 1e3 * mean.pipelined, "speedup": mean.pipeline_speedup,
                "speedup_at_max": top.pipeline_speedup,
                "pipelined_over_resident": mean.pipelined_over_resident,
                "paper": PAPER_13B[setting],
            })
    return rows


def fig13a(gpu: GpuCost, colocated_gpu: GpuCost, offloaded: int, interference: float, gpus: int,
           n: int, seed: int) -> list[dict[str, Any]]:
    rows = []
    for setting in SETTINGS:
        rollout = PAPER_PERIOD[setting][0] / ROUNDS_PER_PERIOD
        share = other_share(setting)
        step = StepShape(gpus, rollout, rollout * share / (1 - share), judge_lengths(setting, n, seed))
        d = dedicated_step(step, QWEN25_7B, gpu)
        c = colocated_step(step, QWEN25_7B, colocated_gpu, offloaded, interference)
        for name, t in (("dedicated", d), ("colocated", c)):
            rows.append({
                "setting": setting, "judge": name, "rollout_s": t.rollout_s,
                "reward_exposed_s": t.reward_exposed_s, "train_s": t.train_s, "step_s": t.step_s,
                "speedup": d.step_s / t.step_s, "paper": PAPER_13A.get(setting) if name == "colocated" else None,
            })
    return rows


# -- Table 1: the real CPU engine ----------------------------------------------------------


def _cpu_row(variant: str, outcomes: list[Any]) -> dict[str, Any]:
    return {"variant": variant, **common.reward_step_medians(outcomes)}


async def _cpu_bench(cfg: Any, model_dir: Any, steps: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from rpk import assembly
    from rpk.loop.step import run_step
    from rpk.train.losses import advantage_fn

    prompts = await asyncio.to_thread(assembly.load_prompts, assembly.prompt_source(cfg), model_dir)
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), model_dir, prompts, print)
    policies = {v: assembly.build_round_policy(cfg.rollout, prompts, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
                for v in VARIANTS}
    outcomes: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    try:
        for step in range(1, steps + 1):
            for variant in VARIANTS:
                o = await run_step(
                    step, policies[variant], parts.engine, parts.scorer, parts.trainer,
                    advantage_fn(cfg.train.loss), version=parts.trainer.version,
                    overlap_reward=variant == "streaming",
                )
                outcomes[variant].append(o)
                print(f"step {step} {variant:<9} step {o.time_step_s:6.2f}s  rollout "
                      f"{o.time_rollout_s:6.2f}s  reward exposed {o.round.reward_exposed_s:5.2f}s",
                      flush=True)
        judge = parts.scorer.metrics()
    finally:
        await parts.aclose()
    return [_cpu_row(v, outcomes[v]) for v in VARIANTS], judge


def cpu_table(steps: int, passthrough: list[str]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    from rpk import assembly, config, run
    from rpk.tasks import arith, task

    run.quiet_libraries()
    base = config.from_argv(["--run.progress", "false", *passthrough])
    model_dir = assembly.resolve_model(base.model, task(base.data.task), print)
    cfg = config.from_argv([
        "--rollout.policy", "sync", "--run.progress", "false", "--model.path", str(model_dir),
        "--reward.judge.model", str(model_dir), "--reward.judge.data_sources", arith.DATA_SOURCE,
        "--reward.judge.template", TEMPLATE, "--reward.judge.system", "",
        "--reward.judge.yes", "1", "--reward.judge.no", "0",
        # The policy model as its own judge: its verdict words carry little probability,
        # and the bench times the path, not the verdicts.
        "--reward.judge.min_mass", "0",
        "--reward.judge.max_response_chars", str(RESPONSE_CHARS), *passthrough,
    ])
    rows, judge = run.run_async(_cpu_bench(cfg, model_dir, steps), use_uvloop=cfg.run.uvloop)
    after = next(r for r in rows if r["variant"] == "after")
    for r in rows:
        r["step_speedup"] = after["step_s"] / r["step_s"]
    return rows, judge


# -- the command line ----------------------------------------------------------------------


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__)
    ap.add_argument("--dry", action="store_true", help="the cost model's tables only (no engine)")
    ap.add_argument("--steps", type=int, default=4, help="Table 1: steps per variant")
    ap.add_argument("--pcie-gbs", type=float, default=50.0, help="pinned host-to-GPU GB/s")
    ap.add_argument("--mfu", type=float, default=0.4, help="of the GPU's bf16 peak, in a prefill")
    ap.add_argument("--sm-share", type=float, default=0.5, help="the colocated judge's share of the SMs")
    ap.add_argument("--interference", type=float, default=0.3,
                    help="rollout time lost per second the colocated judge runs on its GPU")
    ap.add_argument("--gpus", type=int, default=8, help="Figure 13a: GPUs of the node")
    ap.add_argument("--responses", type=int, default=RESPONSES, help="judged per node and step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    started = time.monotonic()
    result: dict[str, Any] = {"args": common.args_json(args), "passthrough": passthrough}
    if not args.dry:
        rows, judge = cpu_table(args.steps, passthrough)
        result["cpu"], result["cpu_judge_metrics"] = rows, judge
        print(f"\nTable 1, real CPU engine: medians over steps 2..{args.steps}; the paper's async "
              f"reward: {PAPER_ASYNC[0]}-{PAPER_ASYNC[1]}x per step")
        common.print_table(rows, [
            Col("variant", "variant", 10, "<"),
            *(Col(k, k, 17, ".2f", " s") for k in ("step_s", "rollout_s", "generation_s", "reward_exposed_s",
                                                    "reward_busy_s")),
            Col("step speedup", "step_speedup", 14, ".3f", "x"),
        ])
        print(f"judge: {judge.get('reward_judge_judged_total', 0):.0f} verdicts, mean latency "
              f"{judge.get('reward_judge_latency_s', 0):.2f} s")
    gpu = GpuCost(mfu=args.mfu, pcie_bytes_s=args.pcie_gbs * 1e9)
    shared = GpuCost(mfu=args.mfu, pcie_bytes_s=args.pcie_gbs * 1e9, sm_share=args.sm_share)
    result["fig13b"] = fig13b(shared, (QWEN25_7B.layers, QWEN25_7B.layers // 2), args.responses, args.seed)
    result["fig13a"] = fig13a(gpu, shared, QWEN25_7B.layers // 2, args.interference, args.gpus,
                              args.responses, args.seed)
    print(f"\nTable 2a, Figure 13b on the cost model: judge {QWEN25_7B.name}, PCIe {args.pcie_gbs:g} GB/s, "
          f"mfu {args.mfu:g}, SM share {args.sm_share:g}; ms per verdict at batch 1, mean over "
          f"{args.responses} responses")
    common.print_table(result["fig13b"], [
        Col("setting", "setting", 9, "<"), Col("offloaded", "offloaded", 9, "<"),
        *(Col(k.removesuffix("_ms"), k, 13, ".0f") for k in ("resident_ms", "unpipelined_ms", "pipelined_ms")),
        Col("speedup", "speedup", 9, ".2f", "x"), Col("at max len", "speedup_at_max", 12, ".2f", "x"),
        Col("paper", "paper", 7, ".1f", "x"),
    ])
    print(f"\nTable 2b, Figure 13a on the cost model: one node of {args.gpus} GPUs, judge half "
          f"offloaded when colocated, interference {args.interference:g}; seconds per step")
    common.print_table(result["fig13a"], [
        Col("setting", "setting", 9, "<"), Col("judge", "judge", 10, "<"),
        *(Col(k.removesuffix("_s"), k, 16, ".1f") for k in ("rollout_s", "reward_exposed_s", "train_s", "step_s")),
        Col("speedup", "speedup", 9, ".2f", "x"), Col("paper", "paper", 7, ".2f", "x"),
    ])
    print(f"wall {time.monotonic() - started:.0f}s")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
