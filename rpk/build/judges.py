"""The judge's engines, from the memory plan: assembly, where the plan's judge rows
(`rpk.gpu.plan.judge`) become the engines' settings (`rpk.reward.judge_vllm.JudgeDevice`).

On CUDA with a colocated judge, one judge engine runs on every rollout GPU of this node,
each pinned to its GPU as the rollout replicas are (`rpk.engine.placement.device_env`),
each with the plan's share of the GPU, its streamed layers and its per-GPU concurrency;
the scorer asks them through one `rpk.reward.judge_pool.JudgePool`. On CPU, or without
a judge in the plan, one engine with `reward.judge`'s settings, as before.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from rpk.build.box import Box
from rpk.config import Config
from rpk.engine.placement import ReplicaPlace, device_env
from rpk.gpu.plan import MemoryPlan, judge
from rpk.reward.judge import JudgeEngine, JudgeSettings
from rpk.reward.judge_vllm import JudgeDevice


@dataclass(frozen=True, slots=True)
class JudgePlace:
    """One judge engine's GPU: the device id (this process's index), what pins it there,
    and its settings."""

    gpu: int
    env: Mapping[str, str | None]
    device: JudgeDevice

    @property
    def name(self) -> str:
        return f"GPU {self.gpu}"


def judge_device(memory: MemoryPlan) -> JudgeDevice | None:
    """The plan's judge on one GPU as its engine's settings; None: the plan has none."""
    j, layout = memory.knobs.judge, memory.judge
    if j is None or layout is None:
        return None
    layers = j.shape.num_layers
    return JudgeDevice(
        gpu_memory_utilization=judge.gpu_memory_utilization(j, layout, memory.target.gpu_bytes),
        layers=layers, offloaded=layout.offloaded(layers), prefetch_step=judge.PREFETCH_STEP,
        max_num_seqs=j.max_num_seqs, max_model_len=j.max_model_len,
    )


def judge_places(box: Box, visible: str | None) -> list[JudgePlace]:
    """A judge engine on each of this node's rollout GPUs (`visible`: the launcher's
    CUDA_VISIBLE_DEVICES), as the plan prices them; empty on CPU or without a judge."""
    device = judge_device(box.memory) if box.memory is not None else None
    if device is None:
        return []
    return [JudgePlace(d, device_env(ReplicaPlace(1, i, (d,)), "cuda", visible), device)
            for i, d in enumerate(box.fleet.devices)]


def judge_launcher(cfg: Config, box: Box) -> Callable[[JudgeSettings], Awaitable[JudgeEngine]]:
    """What `JudgeScorer.start` calls: one engine per rollout GPU where the plan places
    the judge there, else one engine with the config's settings."""
    from rpk.reward.judge_pool import start_pool
    from rpk.reward.judge_vllm import VLLMJudge, VLLMRewardModel

    kind = VLLMRewardModel if cfg.reward.judge.verdict == "classify" else VLLMJudge
    launch = functools.partial(kind.launch, hub_cache=cfg.model.hub_cache, seed=cfg.run.seed)
    places = judge_places(box, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not places:
        return launch

    async def on_every_gpu(settings: JudgeSettings) -> JudgeEngine:
        return await start_pool(
            [functools.partial(launch, settings, device=p.device, env=p.env) for p in places],
            [p.name for p in places],
        )

    return on_every_gpu


def describe(cfg: Config, box: Box) -> str:
    """The judge's line in the run's log."""
    j = cfg.reward.judge
    places = judge_places(box, os.environ.get("CUDA_VISIBLE_DEVICES"))
    where = ""
    if places:
        d = places[0].device
        where = (f"; an engine on each of GPUs {[p.gpu for p in places]} (gpu_memory_utilization "
                 f"{d.gpu_memory_utilization}, {d.offloaded} of {d.layers} layers streamed from host, "
                 f"max_num_seqs {d.max_num_seqs})")
    return f"judge: {j.model} ({j.verdict} verdicts){where}"
