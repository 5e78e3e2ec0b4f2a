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

Length models (`--length-model`):
- `task`: each prompt's reference solution length in tokens (the tiny model's
  tokenizer) with a deterministic per-response spread of +-25%, capped at max_tokens;
  prompts carry the task's real prompt token counts (what a length predictor may use).
  `--tail-power K` stretches the tail, L -> median * (L / median) ** K: K = 1.6 turns
  the task's max/median of 8.7x into the paper's ~30x (use a larger --max-tokens).
- `noisy`: a prompt predicts its length only partly. Log length = the prompt's own
  mean (sd `--sigma-prompt`) + a fresh draw per prompt and epoch (`--sigma-epoch`) + a
  fresh draw per response (`--sigma-response`), around `--median`; every prompt has
  the same token count, so only history can tell prompts apart. The defaults give a
  rank correlation of about 0.6 between a prompt's mean lengths in two epochs (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import common
from bench.common import sim_steps, write_json
from bench.rollout_policies import print_table, summarize_policy
from rpk.core.records import GenRequest, Prompt
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import step_record
from rpk.sched.policies import POLICIES, PolicyOptions, make_policy
from rpk.sched.policy import Sampling
from rpk.sched.predictor import spearman
from rpk.sim import CostModel, SimEngine
from rpk.sim.trainer import NullTrainer

COSTS = {
    # fitted by bench/engine_cost.py on this 2-core machine (vLLM CPU, tiny model):
    # 4.7 ms a step + 0.133 ms per sequence decoding
    "cpu": CostModel(base_s=0.0047, per_seq_s=1.33e-4),
    # a 7B model on one H100-class GPU: memory bound, ~15 ms a step, nearly flat
    "gpu": CostModel(base_s=0.015, per_seq_s=5e-5),
}


def task_lengths(n: int, seed: int) -> tuple[list[int], list[int]]:
    """(reference response lengths, prompt token counts) of the built-in task's first
    `n` prompts, as the run tokenises them: with the tiny model's tokenizer, which is
    built on its own (seconds), not with the model (minutes)."""
    from rpk.config import ModelConfig
    from rpk.data import numbered, to_prompts
    from rpk.tasks import arith
    from rpk.tasks.tiny import build_tokenizer

    spec = ModelConfig().tiny
    tokenizer = build_tokenizer(spec)
    prompts = to_prompts(numbered(arith.make_rows(n, seed, spec.task)), "sim", tokenizer, 10_000)
    lengths = arith.reference_lengths(tokenizer, n, seed, spec.task)
    return lengths, [len(p.token_ids) for p in prompts]


def stretch(lengths: Sequence[int], power: float) -> list[int]:
    median = sorted(lengths)[len(lengths) // 2]
    return [max(1, round(median * (n / median) ** power)) for n in lengths]


def _unit(*key: object) -> float:
    """A deterministic standard normal draw per key."""
    return random.Random(zlib.crc32(":".join(map(str, key)).encode())).gauss(0.0, 1.0)


@dataclass(frozen=True)
class LengthModel:
    """Response lengths of the simulated prompts (see the module docstring)."""

    kind: str  # task | noisy
    base: Sequence[float]  # task: reference length; noisy: the prompt's own log mean
    prompt_tokens: Sequence[int]
    sigma_epoch: float = 0.0
    sigma_response: float = 0.0
    p0: int = 32
    ramp: float = 0.0  # noisy: log-length growth per step (responses lengthening in training)

    def prompts(self) -> list[Prompt]:
        # token ids (7, i, 0, ...): the dataset index rides in the request
        return [Prompt(f"p{i}", (7, i) + (0,) * (n - 2), "sim", "")
                for i, n in enumerate(self.prompt_tokens)]

    def log_mean(self, i: int, epoch: int) -> float:
        return self.base[i] + self.sigma_epoch * _unit("epoch", i, epoch)

    def __call__(self, req: GenRequest) -> int:
        i = req.prompt_token_ids[1]
        already = len(req.prompt_token_ids) - self.prompt_tokens[i]  # partial rollout's prefix
        j = req.request_id.rsplit("-r", 1)[1]
        if self.kind == "task":
            spread = zlib.crc32(f"p{i}:{j}".encode()) % 51 - 25
            return max(1, round(self.base[i] * (1 + spread / 100)) - already)
        step = int(req.request_id.split("-", 1)[0][1:])
        # each step trains P0 prompts: the epoch a launch belongs to, near enough
        epoch = (step - 1) * self.p0 // len(self.base)
        log_len = (self.log_mean(i, epoch) + self.ramp * (step - 1)
                   + self.sigma_response * _unit("response", i, step, j))
        return max(1, round(math.exp(log_len)) - already)

    def epoch_rank_corr(self, responses: int) -> float:
        """Rank correlation of prompts' mean response lengths (`responses` each) between
        two epochs: how much one epoch tells about the next."""
        def means(epoch: int) -> list[float]:
            return [statistics.fmean(
                        math.exp(self.log_mean(i, epoch) + self.sigma_response * _unit("r", i, epoch, j))
                        for j in range(responses))
                    for i in range(len(self.base))]
        return spearman(list(zip(means(0), means(1))))


def build_lengths(args: argparse.Namespace) -> LengthModel:
    if args.length_model == "task":
        lengths, tokens = task_lengths(args.prompts, seed=10_000)
        return LengthModel("task", stretch(lengths, args.tail_power), tokens)
    rng = random.Random(args.seed)
    base = [math.log(args.median) + args.sigma_prompt * rng.gauss(0.0, 1.0) for _ in range(args.prompts)]
    return LengthModel("noisy", base, [16] * args.prompts, args.sigma_epoch, args.sigma_response, args.p0)


async def run_policy(
    policy_name: str, cost: CostModel, lengths: LengthModel, args: argparse.Namespace
) -> list[dict[str, Any]]:
    prompts = lengths.prompts()
    sampling = Sampling(prompts_per_step=args.p0, responses_per_prompt=args.r0, max_tokens=args.max_tokens)
    options = PolicyOptions(eta_prompts=args.eta, eta_responses=args.eta, concurrency=args.concurrency,
                            lookahead_rounds=args.lookahead)
    policy = make_policy(policy_name, prompts, sampling, options)
    engine = SimEngine(lengths, cost=cost, max_concurrency=args.concurrency, chunk=args.chunk)
    trainer = AsyncTrainer(NullTrainer())
    return await sim_steps(args.steps, policy, engine, trainer, lambda o: {**step_record(o), **policy.metrics()})


def main() -> int:
    ap = common.parser(__doc__)
    common.add_sampling_args(ap, 40, None, 4096, p0=32)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--length-model", choices=("task", "noisy"), default="task")
    ap.add_argument("--tail-power", type=float, default=1.0, help="task: stretch the length tail")
    ap.add_argument("--median", type=float, default=40.0, help="noisy: median response length")
    ap.add_argument("--sigma-prompt", type=float, default=0.8, help="noisy: sd of a prompt's own log mean")
    ap.add_argument("--sigma-epoch", type=float, default=0.6, help="noisy: sd of its per-epoch change")
    ap.add_argument("--sigma-response", type=float, default=0.5, help="noisy: sd per response")
    ap.add_argument("--seed", type=int, default=0, help="noisy: seed of the prompts' means")
    ap.add_argument("--lookahead", type=int, default=10, help="length_aware: rounds per draw")
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=8, help="decode steps per streamed delta")
    ap.add_argument("--costs", nargs="+", default=list(COSTS), choices=list(COSTS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    args = ap.parse_args()
    lengths = build_lengths(args)
    sample = sorted(min(args.max_tokens, lengths(GenRequest(f"s1-p{i}-r0", (7, i) + (0,) * (n - 2), args.max_tokens)))
                    for i, n in enumerate(lengths.prompt_tokens))
    median = sample[len(sample) // 2]
    print(f"{args.length_model} lengths: median {median}, p90 {sample[len(sample) * 9 // 10]}, "
          f"max {sample[-1]} ({sample[-1] / median:.1f}x the median)"
          + (f"; rank correlation between epochs {lengths.epoch_rank_corr(args.r0):.2f}"
             if args.length_model == "noisy" else ""))
    results = []
    for cost_name in args.costs:
        rows = []
        for name in args.policies:
            records = asyncio.run(run_policy(name, COSTS[cost_name], lengths, args))
            rows.append({**summarize_policy(name, records), "cost_model": cost_name,
                         "concurrency": args.concurrency, "length_model": args.length_model,
                         "tail_power": args.tail_power, "max_tokens": args.max_tokens})
        print(f"\n{cost_name} cost model ({COSTS[cost_name]}), concurrency {args.concurrency}, "
              f"{args.steps} steps, virtual seconds:")
        print_table(rows)
        results += rows
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
