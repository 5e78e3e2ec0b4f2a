"""The checks a lent GPU adds where vLLM's CUDA build is installed (`bench.gpu_check`
runs them after its own; each skips without vLLM or without a GPU):

- `vllm_configs`: every engine of the 14B/16k elastic judged run's dry run (each layout's
  replicas, the tiny judge on every GPU) through vLLM's `create_engine_config` on the
  real CUDA platform, the check the CPU suite makes under a stand-in
  (`tests/test_vllm_contract.py`): the two must agree;
- `asleep_residue`: a replica started with sleep mode and CUDA graphs, put to sleep at
  level 2 as a waiting layout is: the GPU memory it still holds against what the plan
  prices an asleep layout (`rpk.gpu.plan.pricing.ASLEEP_LAYOUT_BYTES`), and its awake
  share against `gpu_memory_utilization` x total and its context;
- `judge_wake`: a judge-like engine streaming layers from host (vLLM's prefetch
  offload), greedy log-probs of one prompt before a rest and after the wake, at level 1
  and at level 2 with the weights reloaded: level 1 must give the same numbers; level 2
  is reported (the second GPU reading's M1 reads it as wrong until the prefetch buffers
  are primed again).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import random_qwen2
from rpk.core.modes import RestLevel

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


class Skipped(Exception):
    """The check cannot run here (its row says skip, with why)."""


def _need_vllm_on_gpu(dry: bool) -> None:
    if dry or not torch.cuda.is_available():
        raise Skipped("needs vLLM's CUDA build on a GPU")
    if importlib.util.find_spec("vllm") is None:
        raise Skipped("no vLLM here")


def check_vllm_configs(dry: bool) -> str:
    _need_vllm_on_gpu(dry)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rpk.assembly.box import judge_config
    from rpk.assembly.dry_run import dry_run
    from rpk.config import from_argv

    model = ROOT / "tests" / "fixtures" / "models" / "qwen2.5-14b"
    cfg = from_argv(["--run.dry_run", "true", "--model.path", str(model), "--dist.gpus", "8", "--dist.gpu_mem_gb",
                     "80", "--rollout.max_tokens", "16384", "--rollout.tp", "elastic", "--data.task", "arith_judged"])
    d = dry_run(cfg, model, cuda=(0, 0))
    seen, failed = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        judge_dir = Path(tmp)
        (judge_dir / "config.json").write_text(json.dumps(judge_config(cfg)))
        for e in [*d["replicas"], *d["judges"]]:
            args = dict(e["engine_args"])
            if not (Path(str(args["model"])) / "config.json").is_file():
                args["model"] = str(judge_dir)  # the tiny judge, built at start
            try:
                config = AsyncEngineArgs(**args).create_engine_config(UsageContext.ENGINE_CONTEXT)
                assert config.scheduler_config.max_num_batched_tokens == args["max_num_batched_tokens"]
                seen += 1
            except Exception as err:  # vLLM's refusal is the finding
                failed.append(f"{e.get('name', 'judge')}: {type(err).__name__}: {' '.join(str(err).split())[:200]}")
    if failed:
        raise AssertionError(f"{len(failed)} of {seen + len(failed)} engines refused: {failed[:3]}")
    return f"{seen} engines of the 14B/16k elastic judged dry run validated on the CUDA platform"


def _vllm_model(directory: Path) -> Path:
    """A small Qwen2 with a head size vLLM's CUDA attention backends all take (64)."""
    return random_qwen2(directory, hidden=512, layers=4, vocab=4096)


async def _residue(model: Path) -> tuple[int, int, int, float]:
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings

    util = 0.2
    settings = VLLMSettings(model=model, dtype="bfloat16", kv_cache_memory_bytes=None, gpu_memory_utilization=util,
                            enable_sleep_mode=True, enforce_eager=False, max_model_len=1024, max_num_seqs=64,
                            max_num_batched_tokens=8192)
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    engine = await VLLMEngine.launch(settings, env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})
    try:
        awake = torch.cuda.mem_get_info()[0]
        await engine.sleep(RestLevel.DROP_WEIGHTS)
        asleep = torch.cuda.mem_get_info()[0]
    finally:
        await engine.shutdown()
    return before, awake, asleep, util


def check_asleep_residue(dry: bool) -> str:
    _need_vllm_on_gpu(dry)
    from rpk.gpu.plan.pricing import ASLEEP_LAYOUT_BYTES, PROCESS_BYTES

    with tempfile.TemporaryDirectory() as tmp:
        before, awake, asleep, util = asyncio.run(_residue(_vllm_model(Path(tmp) / "m")))
    total = torch.cuda.mem_get_info()[1]
    held, left = before - awake, before - asleep
    detail = (f"awake {held / GiB:.2f} GiB (utilization {util} x total = {util * total / GiB:.2f} + its context); "
              f"asleep at level 2 it leaves {left / GiB:.2f} GiB, the plan prices {ASLEEP_LAYOUT_BYTES / GiB:.2f}")
    if left > ASLEEP_LAYOUT_BYTES or held > util * total + PROCESS_BYTES:
        raise AssertionError(detail)
    return detail


async def _wake_logprobs(model: Path) -> dict[str, float]:
    from rpk.core.records import GenRequest
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import PrefetchOffload, VLLMSettings

    settings = VLLMSettings(model=model, dtype="bfloat16", kv_cache_memory_bytes=None, gpu_memory_utilization=0.15,
                            enable_sleep_mode=True, enforce_eager=True, max_model_len=512, max_num_seqs=4,
                            prefetch_offload=PrefetchOffload(group_size=2, num_in_group=1, prefetch_step=1))
    engine = await VLLMEngine.launch(settings, env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})

    async def greedy(tag: str) -> list[float]:
        request = GenRequest(f"wake-{tag}", tuple(range(1, 65)), max_tokens=8, temperature=0.0, ignore_eos=True)
        out: list[float] = []
        async for delta in (await engine.start([request]))[request.request_id]:
            out.extend(delta.logprobs)
        return out

    try:
        first = await greedy("before")
        await engine.sleep(RestLevel.KEEP_WEIGHTS)
        await engine.wake()
        level1 = await greedy("level1")
        await engine.sleep(RestLevel.DROP_WEIGHTS)
        await engine.wake()
        await engine.llm.collective_rpc("reload_weights")  # what a judge woken from level 2 runs
        level2 = await greedy("level2")
    finally:
        await engine.shutdown()
    return {"level1": max(abs(a - b) for a, b in zip(first, level1, strict=True)),
            "level2": max(abs(a - b) for a, b in zip(first, level2, strict=True))}


def check_judge_wake(dry: bool) -> str:
    _need_vllm_on_gpu(dry)
    with tempfile.TemporaryDirectory() as tmp:
        diffs = asyncio.run(_wake_logprobs(_vllm_model(Path(tmp) / "m")))
    detail = (f"2 of 4 layers streamed; greedy log-probs after a level-1 rest differ by {diffs['level1']:.2e}, "
              f"after level 2 and reload_weights by {diffs['level2']:.2e}")
    if diffs["level1"] > 1e-3:
        raise AssertionError(detail)
    return detail + ("" if diffs["level2"] <= 1e-3 else ": level 2 changes the outputs, the judge must rest at level 1")


CHECKS: dict[str, Any] = {"vllm_configs": check_vllm_configs, "asleep_residue": check_asleep_residue,
                          "judge_wake": check_judge_wake}
