"""The sharded trainer against the unsharded one: trainer seconds per step and seconds to
gather the weights for the engine, on 1 rank and on 2 gloo ranks of this CPU machine.

    .venv/bin/python -m bench.dist_trainer --out bench/results/dist_trainer.json

A step is what the loop gives the trainer: `begin_step`, the round's groups in chunks
(`--chunks`), `finish_step`. The 2-rank variant runs this process as rank 0 (the
`DistTrainer` of a real run) and a second copy of it as the follower. The model is the
default tiny model (`rpk.tasks.tiny`, built on a cache miss). Medians over `--steps` after one
warm-up step; on 2 shared cores the two ranks also share the cores, so this measures
the sharding's overheads (commands, all-gathers, the deferred reduce-scatter), not a
speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import Col, write_json
from rpk.config import Config
from rpk.core.records import TrainSample

WORLD = 2


def samples(n: int, vocab: int, seed: int) -> list[TrainSample]:
    """Prompt ~30 and response 20..240 tokens: the default task's shape."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(20, 40), rng.randint(20, 240)
        out.append(TrainSample(
            prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(p)),
            response_ids=tuple(rng.randrange(3, vocab) for _ in range(r)),
            old_logprobs=tuple(-5.0 + rng.uniform(-0.5, 0.5) for _ in range(r)),
            advantage=rng.choice([-1.0, -0.3, 0.3, 1.0]),
        ))
    return out


def make_trainer(model_dir: str, sharding: Any, budget: int) -> Any:
    from rpk.train.trainer import TorchTrainer, TrainerSettings

    cfg = TrainerSettings(micro_batch_tokens=budget, torch_threads=max(1, (os.cpu_count() or 1) // WORLD))
    return TorchTrainer(model_dir, cfg, max_response_tokens=320, sharding=sharding)


def measure(trainer: Any, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    step_s, gather_s = [], []
    for step in range(args.steps + 1):
        batch = samples(args.samples, vocab, seed=step)
        size = -(-len(batch) // args.chunks)
        started = time.perf_counter()
        trainer.begin_step()
        for i in range(0, len(batch), size):
            trainer.accumulate(batch[i:i + size])
        trainer.finish_step()
        took = time.perf_counter() - started
        started = time.perf_counter()
        n = sum(len(bucket) for bucket in trainer.weight_buckets(args.bucket_mb << 20))
        gathered = time.perf_counter() - started
        if step:  # the first step pays one-off costs
            step_s.append(took)
            gather_s.append(gathered)
    return {
        "train_s_per_step": statistics.median(step_s),
        "gather_s": statistics.median(gather_s),
        "tensors": float(n),
    }


def follower(port: int, model_dir: str, budget: int) -> None:
    from rpk.gpu.launch import join
    from rpk.gpu.layout import ParallelLayout
    from rpk.train.dist import follow

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    joined = join(ParallelLayout(nproc_per_node=WORLD, rank=1), timeout_s=600)
    try:
        follow(joined.channel, lambda d: make_trainer(d, joined.sharding, budget))
    finally:
        joined.close()


def two_ranks(args: argparse.Namespace, model_dir: str, vocab: int) -> dict[str, float]:
    import socket

    from rpk.gpu.launch import join
    from rpk.gpu.layout import ParallelLayout
    from rpk.train.dist import DistTrainer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = subprocess.Popen([
        sys.executable, "-m", "bench.dist_trainer", "--follower", str(port),
        "--model", model_dir, "--budget", str(args.budget),
    ])
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        joined = join(ParallelLayout(nproc_per_node=WORLD, rank=0), timeout_s=600)
        trainer = DistTrainer(
            joined.channel, lambda d: make_trainer(d, joined.sharding, args.budget), model_dir
        )
        try:
            return measure(trainer, args, vocab)
        finally:
            trainer.close()
            joined.close()
    finally:
        peer.wait(timeout=120)


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=256, help="responses per step (P0 x R0)")
    ap.add_argument("--chunks", type=int, default=8, help="accumulate calls per step (streaming)")
    ap.add_argument("--budget", type=int, default=8192, help="micro-batch token budget")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--follower", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.follower is not None:
        follower(args.follower, args.model, args.budget)
        return 0

    from rpk.tasks.tiny import build_tiny_model

    cfg = Config()
    model_dir = str(build_tiny_model(cfg.model.tiny, Path(cfg.model.cache_dir), print))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rows = [
        {"ranks": 1, **measure(make_trainer(model_dir, None, args.budget), args, vocab)},
        {"ranks": WORLD, **two_ranks(args, model_dir, vocab)},
    ]
    print()
    common.print_table(
        [{**row, "ratio": row["train_s_per_step"] / rows[0]["train_s_per_step"]} for row in rows],
        [Col("ranks", "ranks", 6), Col("train s/step", "train_s_per_step", 14, ".3f"),
         Col("gather s", "gather_s", 10, ".3f"), Col("vs 1 rank", "ratio", 11, ".2f", "x")])
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
