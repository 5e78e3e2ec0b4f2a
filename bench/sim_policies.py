"""Rollout policies on the virtual-time engine: what tail batching buys under a given
engine cost curve, with the built-in task's length distribution.

    .venv/bin/python -m bench.sim_policies --steps 40 --out bench/results/sim_policies.json

The real-engine comparison (bench/rollout_policies.py) measures this CPU, whose decode
step costs about as much per sequence as the whole step is worth (throughput bound), so
a half-empty engine wastes little. A GPU's decode step is memory bound and nearly flat
in the batch: a step with 3 sequences costs almost what one with 300 does, and that is
the bubble tail batching removes. This benchmark runs the real loop and policies on the
simulator under both cost curves (the CPU one fitted to measurements on this machine)
to show where the speedup comes from and what it takes.

Response lengths: each prompt's reference solution length in tokens (the tiny model's
tokenizer) with a deterministic per-response spread of +-25%, capped at max_tokens.
`--tail-power K` stretches the tail, L -> median * (L / median) ** K: K = 1.6 turns the
task's max/median of 8.7x into the paper's ~30x (use a larger --max-tokens with it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.common import write_json
from rpk.sched.policy import POLICIES, PolicyOptions, Sampling, make_policy
from rpk.core.records import GenRequest, Prompt, Response, Scored, TrainSample
from rpk.loop.step import AsyncTrainer, run_step
from rpk.obs.metrics import step_record
from rpk.sim import CostModel, SimEngine
from rpk.sim.trainer import NullTrainer
from bench.rollout_policies import print_table, summarize_policy

COSTS = {
    # fitted by bench/engine_cost.py on this 2-core machine (vLLM CPU, tiny model):
    # 4.7 ms a step + 0.133 ms per sequence decoding
    "cpu": CostModel(base_s=0.0047, per_seq_s=1.33e-4),
    # a 7B model on one H100-class GPU: memory bound, ~15 ms a step, nearly flat
    "gpu": CostModel(base_s=0.015, per_seq_s=5e-5),
}


class _LengthScorer:
    """Reward 1 below the prompt's reference length: the sim has no text to check."""

    def __init__(self, base: Mapping[str, int]) -> None:
        self.base = base

    async def score(self, response: Response) -> Scored:
        ok = len(response.token_ids) <= self.base[response.prompt.uid]
        return Scored(response, float(ok), ok)

    async def aclose(self) -> None:
        return None


def task_lengths(n: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    from rpk.config import ModelConfig
    from rpk.tasks import arith
    from rpk.tiny import build_tiny_model

    cfg = ModelConfig()
    model_dir = build_tiny_model(cfg.tiny, Path(cfg.cache_dir), print)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return arith.reference_lengths(tokenizer, n, seed, cfg.tiny.task)


def stretch(lengths: Sequence[int], power: float) -> list[int]:
    median = sorted(lengths)[len(lengths) // 2]
    return [max(1, round(median * (n / median) ** power)) for n in lengths]


def length_model(base: Mapping[str, int], prompt_len: int):
    def length_of(req: GenRequest) -> int:
        uid = f"p{req.prompt_token_ids[1]}"
        already = len(req.prompt_token_ids) - prompt_len  # partial rollout's prefix
        spread = zlib.crc32(f"{uid}:{req.request_id.rsplit('-r', 1)[1]}".encode()) % 51 - 25
        return max(1, round(base[uid] * (1 + spread / 100)) - already)
    return length_of


async def run_policy(policy_name: str, cost: CostModel, lengths: Sequence[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = [Prompt(f"p{i}", (7, i), "sim", "") for i in range(len(lengths))]
    base = {p.uid: n for p, n in zip(prompts, lengths)}
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0, max_tokens=args.max_tokens)
    policy = make_policy(policy_name, prompts, sampling, PolicyOptions(eta_prompts=args.eta, eta_responses=args.eta))
    engine = SimEngine(length_model(base, 2), cost=cost, max_concurrency=args.concurrency, chunk=8)
    trainer = AsyncTrainer(NullTrainer())
    scorer = _LengthScorer(base)
    records = []
    try:
        for step in range(1, args.steps + 1):
            o = await run_step(step, policy, engine, scorer, trainer, lambda r: [x - sum(r) / len(r) for x in r],
                               version=trainer.version, clock=engine.clock)
            records.append(step_record(o, engine.max_concurrency))
    finally:
        await trainer.aclose()
        await engine.shutdown()
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--p0", type=int, default=32)
    ap.add_argument("--r0", type=int, default=8)
    ap.add_argument("--eta", type=float, default=1.25)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--tail-power", type=float, default=1.0, help="stretch the length tail")
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--costs", nargs="+", default=list(COSTS), choices=list(COSTS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lengths = stretch(task_lengths(args.prompts, seed=10_000), args.tail_power)
    ordered = sorted(lengths)
    print(f"lengths: median {ordered[len(ordered) // 2]}, p90 {ordered[len(ordered) * 9 // 10]}, "
          f"max {ordered[-1]} ({ordered[-1] / ordered[len(ordered) // 2]:.1f}x the median)")
    results = []
    for cost_name in args.costs:
        rows = []
        for name in args.policies:
            records = asyncio.run(run_policy(name, COSTS[cost_name], lengths, args))
            rows.append({**summarize_policy(name, records), "cost_model": cost_name,
                         "concurrency": args.concurrency, "tail_power": args.tail_power,
                         "max_tokens": args.max_tokens})
        print(f"\n{cost_name} cost model ({COSTS[cost_name]}), concurrency {args.concurrency}, "
              f"{args.steps} steps, virtual seconds:")
        print_table(rows)
        results += rows
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
