"""Full fine-tuning against LoRA: sync seconds and bytes into a real CPU vLLM replica,
trainer step time and trainer peak RSS, at rpk's tiny shape and Qwen2.5-0.5B's.

    .venv/bin/python -m bench.lora --out bench/results/lora.json

Each shape is a model directory built here (`bench.common.model_dir`: random
float32 weights, tied head, the tiny model's tokenizer; the 0.5B shape is
tests/fixtures/models/qwen2.5-0.5b's config). Per shape and mode:

- sync: `Fleet.update_weights` into one TP-1 vLLM replica, as a run's sync is. Full
  fine-tuning sends every weight over `cpu_ipc` (the CPU default: handles to the trainer's
  parameters in /dev/shm, vLLM's load and CPU re-pack included); LoRA sends the adapter
  (rank `--rank`, all-linear, PEFT-named) through `rpk.sync.adapter.AdapterTransport`:
  PEFT files written once, `add_lora` under a new name, the old adapter retired. The first
  sync apart, the median of the others.
- step: a `TorchTrainer` (float32, on torch's threads) taking `--samples` samples of
  `--tokens` tokens each (half prompt, half response) through `begin_step`, `accumulate`,
  `finish_step`; the first step apart (AdamW allocates its state), the median of the
  others. Peak RSS is the trainer process's own (`ru_maxrss`): each mode runs in a fresh
  process, so the other mode's memory is not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import abuckets, bucket_list, model_dir, nbytes, qwen2_weights, shared, tiny_dir, write_json

SHAPES = ("tiny", "qwen2.5-0.5b")
MODES = ("full", "lora")


def adapter_weights(shape: str, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named all-linear adapter tensors for a model of `shape`: per linear weight
    (out, in) an A (rank, in) and a B (out, rank)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in qwen2_weights(shape).items():
        if t.dim() == 2 and name != "model.embed_tokens.weight":
            stem = "base_model.model." + name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = torch.randn((rank, t.shape[1]), generator=gen) * 0.01
            out[f"{stem}.lora_B.weight"] = torch.randn((t.shape[0], rank), generator=gen) * 0.01
    return out


async def measure_sync(mode: str, directory: Path, shape: str, rank: int, reps: int) -> tuple[list[float], int]:
    """Seconds of each `Fleet.update_weights` into one vLLM replica, and the bytes a sync
    carries."""
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.sync.adapter import max_lora_rank
    from rpk.sync.backends import Backend
    from rpk.train.lora import LoraSettings, adapter_config

    settings = VLLMSettings(model=directory, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=16 * 2**20)
    holder = None
    if mode == "full":
        holder, weights = shared(qwen2_weights(shape))
        fleet = await launch_fleet(settings, fleet_plan((), (), 1, False), platform="cpu", backend=Backend.CPU_IPC)
        versions = [weights] * reps
    else:
        settings = VLLMSettings(**{**_fields(settings), "max_lora_rank": max_lora_rank(rank)})
        config = adapter_config(LoraSettings(rank=rank, alpha=2.0 * rank), directory)
        fleet = await launch_fleet(settings, fleet_plan((), (), 1, False), platform="cpu",
                                   backend=Backend.ADAPTER, adapter=config)
        versions = [adapter_weights(shape, rank, seed) for seed in range(reps)]
    try:
        times = []
        for version, weights in enumerate(versions, start=1):
            buckets = bucket_list(weights)
            t0 = time.perf_counter()
            await fleet.update_weights(abuckets(buckets), version)
            times.append(time.perf_counter() - t0)
        return times, nbytes(versions[0])
    finally:
        await fleet.shutdown()
        del holder


def _fields(settings: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def trainer_child(directory: Path, mode: str, rank: int, samples: int, tokens: int, steps: int) -> dict[str, Any]:
    """In a fresh process: a trainer's step times and the process's peak RSS."""
    from rpk.core.records import TrainSample
    from rpk.train.lora import LoraSettings
    from rpk.train.trainer import TorchTrainer, TrainerSettings

    adapters = LoraSettings(rank=rank, alpha=2.0 * rank) if mode == "lora" else None
    trainer = TorchTrainer(directory, TrainerSettings(lr=1e-5, micro_batch_tokens=samples * tokens),
                           max_response_tokens=tokens, adapters=adapters)
    vocab = trainer.model.config.vocab_size
    rng = random.Random(0)
    half = tokens // 2
    batch = [TrainSample(prompt_ids=tuple(rng.randrange(3, vocab) for _ in range(half)),
                         response_ids=tuple(rng.randrange(3, vocab) for _ in range(half)),
                         old_logprobs=(-5.0,) * half, advantage=rng.choice((-1.0, 1.0)))
             for _ in range(samples)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.begin_step()
        trainer.accumulate(batch)
        trainer.finish_step()
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"step_s": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "trainable_params": trainable}


def measure_trainer(directory: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.lora", "--trainer-child", str(directory), mode,
           "--rank", str(args.rank), "--samples", str(args.samples), "--tokens", str(args.tokens),
           "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} trainer failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--reps", type=int, default=4, help="syncs per mode: the first, and the median of the others")
    ap.add_argument("--samples", type=int, default=8, help="samples per trainer step")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sample (half prompt, half response)")
    ap.add_argument("--steps", type=int, default=3, help="trainer steps: the first, and the median of the others")
    ap.add_argument("--no-trainer", action="store_true", help="syncs only")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="a model directory whose tokenizer to use (default: the built tiny model)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--trainer-child", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trainer_child:
        directory, mode = args.trainer_child
        print(json.dumps(trainer_child(Path(directory), mode, args.rank, args.samples, args.tokens, args.steps)))
        return 0

    rows = []
    source = args.tokenizer_from or tiny_dir()
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            directory = model_dir(shape, source, Path(tmp) / shape)
            for mode in args.modes.split(","):
                times, size = asyncio.run(measure_sync(mode, directory, shape, args.rank, args.reps))
                row: dict[str, Any] = {"shape": shape, "mode": mode, "sync_bytes": size, "sync_s": times,
                                       "sync_first_s": times[0], "sync_median_s": statistics.median(times[1:] or times)}
                if not args.no_trainer:
                    trained = measure_trainer(directory, mode, args)
                    row |= trained | {"step_first_s": trained["step_s"][0],
                                      "step_median_s": statistics.median(trained["step_s"][1:] or trained["step_s"])}
                rows.append(row)
                print(f"{shape:13s} {mode:4s} sync {row['sync_median_s']:8.4f} s ({size / 1e6:9.2f} MB)"
                      + (f"  step {row['step_median_s']:7.3f} s  peak RSS {row['peak_rss_mb']:7.0f} MB"
                         if "step_median_s" in row else ""), flush=True)
        full = next((r for r in rows if r["shape"] == shape and r["mode"] == "full"), None)
        lora = next((r for r in rows if r["shape"] == shape and r["mode"] == "lora"), None)
        if full and lora:
            lora["sync_speedup"] = full["sync_median_s"] / lora["sync_median_s"]
            print(f"{shape:13s} LoRA sync {lora['sync_speedup']:.1f}x faster, "
                  f"{full['sync_bytes'] / lora['sync_bytes']:.0f}x fewer bytes", flush=True)
    write_json(args.out, {"rank": args.rank, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
