"""`--run.dry_run true`: what a run of a config would start, as JSON, starting nothing.

The layout, the memory plan, the trainer's choices, and every engine the run would start
with the exact `vllm.AsyncEngineArgs` keywords and environment it gets: each replica of
each layout (with its weight-transfer engine, as `rpk.engine.vllm_fleet.launch_fleet`
starts it) and each judge engine of each engine node. Everything comes from the same
resolution a run makes (`rpk.assembly.box`); `tests/test_vllm_contract.py` hands these
arguments to vLLM's own config validation.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rpk.assembly import box as boxes
from rpk.assembly.box import (
    Box,
    context_length,
    engine_settings,
    host_memory,
    judge_config,
    judge_plan,
    model_config,
    resolve_box,
    target_of,
    trainer_choices,
    weight_path,
)
from rpk.config import Config
from rpk.engine.placement import device_env
from rpk.engine.vllm_fleet import replica_names, replica_settings, twins
from rpk.engine.vllm_settings import VLLMSettings, engine_kwargs
from rpk.gpu.plan import explain
from rpk.judge.pool import JudgePlan
from rpk.judge.vllm import judge_engine_args
from rpk.sync.backends import Backend, for_replica


def dry_run(cfg: Config, model_dir: Path | None, cuda: tuple[int, int] | None = None) -> dict[str, Any]:
    """What a run of `cfg` would start, as JSON-able data. `model_dir` None: the tiny
    model, not built; `cuda`: what CUDA shows (a test's), else this machine's."""
    hf = model_config(cfg, model_dir)
    # The RAM read here only where the GPUs are read here too (`cuda` given: a test's).
    seen = cuda if cuda is not None else boxes._cuda_seen()
    target = target_of(cfg, seen, host_memory() if cuda is None and seen[0] else 0)
    box = resolve_box(cfg, hf, target, judge_config(cfg) if target is not None else None)
    choices = trainer_choices(cfg, box)
    settings = engine_settings(cfg, str(model_dir) if model_dir else "<tiny model, built at start>",
                               context_length(cfg, hf), box)
    fleet = box.fleet
    rollout_gpus = sorted({d for ps in fleet.layouts().values() for p in ps for d in p.devices})
    nodes = target.nodes if target is not None else 1
    ranks = (len(box.trainer_devices) * nodes if box.trainer_devices else
             target.gpus if target is not None else (cfg.dist.nproc or 1))
    path = weight_path(cfg, box, ranks)
    judges = judge_plan(cfg, box)
    return {
        "platform": box.platform,
        "model": str(model_dir) if model_dir else "tiny",
        "layout": {
            "nodes": nodes,
            "trainer_devices": list(box.trainer_devices) or (list(range(target.gpus_per_node))
                                                             if target is not None else []),
            "rollout_devices": rollout_gpus,
            "rollout_gpus": len(rollout_gpus) * nodes if box.platform == "cuda" else 0,
            "disaggregated": bool(box.trainer_devices),
            "weight_transfer": str(path.local),
            **({"weight_transfer_fallback": path.note} if path.note else {}),
            "tp": fleet.tp,
            "tp_sizes": list(fleet.tp_sizes),
            "trainer_ranks": ranks,
            "fsdp": box.memory.fsdp if box.memory is not None else None,
            "stream_mode": str(box.stream_mode or cfg.train.stream_mode),
        },
        "plan": explain.as_dict(box.memory) if box.memory is not None else None,
        "trainer": {**dataclasses.asdict(choices), "offload": choices.offload.value},
        "replicas": replicas(settings, box, path.local),
        **({"judges": judge_engines(cfg, judges, nodes)} if judges is not None and judges.device is not None else {}),
    }


def replicas(settings: VLLMSettings, box: Box, backend: Backend) -> list[dict[str, Any]]:
    """Each replica of each layout: where it runs, whether it starts awake, and the
    exact `vllm.AsyncEngineArgs` keyword arguments it gets (`launch_fleet`'s)."""
    cuda = box.platform == "cuda"
    out = []
    for tp, places in box.fleet.layouts().items():
        for place in places:
            each = replica_settings(settings, tp, for_replica(backend, place.devices), place.devices)
            # With speculating twins a place runs two replicas: a plain one and its twin.
            for name, s in zip(replica_names(place.name, each), twins(each)):
                out.append({
                    "name": name,
                    "devices": list(place.devices),
                    "awake": tp == box.fleet.tp,
                    "env": dict(device_env(place, box.platform, os.environ.get("CUDA_VISIBLE_DEVICES")))
                    if box.fleet.pinned else {},
                    "engine_args": engine_kwargs(s, cuda),
                })
    return out


def judge_engines(cfg: Config, plan: JudgePlan, nodes: int) -> list[dict[str, Any]]:
    """Each judge engine the run starts on the GPUs of each of its engine nodes (of
    `nodes`): its node, GPU, what pins it there (by this machine's CUDA_VISIBLE_DEVICES:
    each node applies its own) and the exact `vllm.AsyncEngineArgs` keyword arguments."""
    places = plan.places(os.environ.get("CUDA_VISIBLE_DEVICES"))
    engine_nodes = [n for n in (cfg.dist.engine_nodes or range(nodes)) if n < nodes]
    path = Path(str(plan.settings.model))
    return [{"node": n, "gpu": p.gpu, "env": dict(p.env),
             "engine_args": judge_engine_args(plan.settings, path, plan.seed, p.device, True)}
            for n in engine_nodes for p in places]
