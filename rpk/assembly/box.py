"""The GPU box: a run's rollout layout, engine settings and trainer choices resolved
from the config and the memory plan (`rpk.gpu.plan`), and the dry run that prints
them. Assembly: the one place the plan meets the config, so `rpk.gpu` reads none.

On CUDA with N GPUs per node, rollout and training share all N: the rollout's replicas
cover every GPU at the TP the plan picks (the smallest whose weights and a useful KV
cache fit), the trainer is FSDP over every rank, and vLLM gets the plan's
`gpu_memory_utilization` (never an explicit KV size: that would override it) with its
sleep mode on. On CPU nothing changes: the config's devices and TP sizes, and its KV
size. The same resolution answers a dry run for a target this machine does not have
(`--dist.gpus 8 --dist.gpu_mem_gb 80`, and `--dist.host_mem_gb` for its nodes' RAM).

A judge in the plan (`rpk.gpu.plan.judge`) becomes one judge engine on every rollout GPU
of every engine node (`judge_places`; `judge_launch`, what the other nodes' engine hosts
start theirs from), each pinned to its GPU as the rollout replicas are (`device_env`),
each with the plan's share of the GPU, its streamed layers and its per-GPU concurrency
(`judge_device`); the scorer asks them all through one `rpk.judge.pool.JudgePool`.
On CPU, or without a judge in the plan, one engine with `reward.judge`'s settings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from rpk.config import Config, ConfigError
from rpk.engine.placement import FleetPlan, Platform, device_env, fleet_plan
from rpk.core.modes import Offload, RestLevel, StreamMode
from rpk.gpu.plan import explain
from rpk.gpu.plan import Knobs, MemoryPlan, ModelShape, Stream, Target, plan_memory, plan_split, split_gpus
from rpk.gpu.plan import judge
from rpk.gpu.plan.judge import TEMPLATE_TOKENS
from rpk.gpu.plan.pricing import JudgeKnobs
from rpk.reward.judge import JudgeEngine, JudgeSettings
from rpk.judge.pool import JudgeLaunch, JudgePlace, places_on
from rpk.judge.tier import start_tier
from rpk.judge.vllm import JudgeDevice


@dataclass(frozen=True, slots=True)
class Box:
    platform: Platform
    fleet: FleetPlan
    memory: MemoryPlan | None  # None on CPU
    # The GPUs (local ids) the trainer's ranks use, when they are not every GPU (a
    # disaggregated layout); empty: every rank shares its GPU with the rollout.
    trainer_devices: tuple[int, ...] = ()

    @property
    def stream_mode(self) -> StreamMode | None:
        """The streaming the plan allows in place of the config's; None: the config's."""
        if self.memory is not None and self.memory.stream is Stream.AFTER:
            return StreamMode.NONE
        return None


def model_config(cfg: Config, model_dir: Path | None) -> dict[str, Any]:
    """The model's config.json, or for the tiny model not built yet, its shape from
    `model.tiny` (the tokenizer may end up a little smaller than vocab_size)."""
    if model_dir is not None:
        return json.loads((model_dir / "config.json").read_text())
    t = cfg.model.tiny
    return {
        "model_type": "qwen2", "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads, "vocab_size": t.vocab_size,
        "tie_word_embeddings": True, "max_position_embeddings": t.max_position_embeddings,
    }


def judge_config(cfg: Config) -> dict[str, Any] | None:
    """The judge's config.json (`reward.judge.model`: a directory, or a Hub id whose
    config alone is fetched), or None without a judge of rpk's to place (none, or an
    external one: `reward.judge.url`)."""
    model = cfg.reward.judge.model
    if model is None or cfg.reward.judge.url is not None:
        return None
    from rpk import hub

    path = Path(model)
    if hub.is_hub_id(model) and not path.exists():
        path = hub.fetch(model, cfg.model.hub_cache, config_only=True)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{model!r} has no config.json for the memory plan to read", "reward.judge.model")
    return json.loads((path / "config.json").read_text())


def judge_knobs(cfg: Config, hf: dict[str, Any], target: Target) -> JudgeKnobs:
    """The judge the plan places beside the rollout on every GPU: its longest input is the
    prompt, the tail of the longest response it sees, its template and its verdict."""
    j, r = cfg.reward.judge, cfg.rollout
    verdict = j.max_tokens if j.verdict == "score" else 1
    longest = cfg.data.max_prompt_tokens + min(r.max_tokens, j.max_response_chars) + TEMPLATE_TOKENS + verdict
    context = int(hf.get("max_position_embeddings") or longest)
    return JudgeKnobs(ModelShape.from_hf(hf), j.max_model_len or min(context, longest),
                      -(-j.max_concurrency // target.gpus))


def context_length(cfg: Config, hf: dict[str, Any]) -> int:
    """The engine's context length, as `rpk.assembly.check_lengths` sets it."""
    return cfg.rollout.max_model_len or int(
        hf.get("max_position_embeddings") or hf.get("max_sequence_length") or 2048
    )


def target_of(cfg: Config, cuda: tuple[int, int], host: int = 0) -> Target | None:
    """The GPUs planned for: `dist.gpus` x `dist.nodes` when set (a dry run's target),
    else what CUDA shows here (`cuda`: device count, bytes of one); None on CPU. Each
    node's RAM: `dist.host_mem_gb`, else `host` (this machine's) where the GPUs are
    this machine's, else unknown (0)."""
    d = cfg.dist
    gpus = d.gpus or cuda[0]
    if not gpus:
        return None
    memory = int(d.gpu_mem_gb * 1e9) or cuda[1]
    if not memory:
        raise ConfigError(f"dist.gpus={gpus}: no GPU here to read its memory from; set dist.gpu_mem_gb")
    ram = int(d.host_mem_gb * 1e9) or (0 if d.gpus else host)
    return Target(nodes=d.nodes if d.gpus else 1, gpus_per_node=gpus, gpu_bytes=memory, host_bytes=ram)


def host_memory() -> int:
    """This machine's RAM in bytes, or its container's limit where that is lower
    (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`); 0 where neither is readable."""
    try:
        limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (OSError, ValueError):
        limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits, default=0)


def knobs_of(cfg: Config, context: int) -> Knobs:
    r, t, rank = cfg.rollout, cfg.train, cfg.model.lora_rank
    return Knobs(
        # The longest sequence a step makes: the longest prompt and a whole response.
        max_model_len=min(context, cfg.data.max_prompt_tokens + r.max_tokens),
        max_num_seqs=r.max_num_seqs,
        micro_batch_tokens=t.micro_batch_tokens,
        weight_bucket_bytes=r.weight_bucket_mb * 2**20,
        tp_sizes=r.tp_sizes,
        tp=r.tp_size if r.tp_size > 1 else 0,  # 1 is the default: the plan picks
        dp_replicate=cfg.dist.dp_replicate,
        offload=None if t.offload == "auto" else Offload(t.offload),
        activation_checkpointing=t.activation_checkpointing is not False,
        defer_reduction=t.defer_reduction,
        stream_mode=StreamMode(t.stream_mode),
        kl_reference=t.kl_coef > 0 and not rank,  # LoRA's reference: the base, adapters off
        lora_rank=rank,
        lora_targets=cfg.model.lora_targets,
        lora_slot_rank=_lora_slot_rank(rank),
    )


def _lora_slot_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank` (0: no LoRA)."""
    if not rank:
        return 0
    from rpk.sync.adapter import max_lora_rank

    return max_lora_rank(rank)


def resolve(cfg: Config, hf: dict[str, Any], target: Target | None, judge_hf: dict[str, Any] | None = None) -> Box:
    """The box for `cfg` (pure; `judge_hf`: the judge's config.json, where it has one).
    Raises `PlanRefused` when the plan does not fit."""
    r, split = cfg.rollout, cfg.dist.trainer_gpus
    if target is None:
        if split:
            raise ConfigError(f"{split}: a disaggregated layout splits GPUs; this run has none",
                              "dist.trainer_gpus")
        return Box("cpu", fleet_plan(r.devices, r.tp_sizes, r.tp_size, r.tp == "elastic"), None)
    wanted, nproc = split or target.gpus_per_node, cfg.dist.nproc
    if nproc and nproc < wanted:
        # The plan shards the trainer over every trainer GPU; fewer ranks hold more each.
        raise ConfigError(f"{nproc}: fewer ranks than the trainer's {wanted} GPUs the memory plan "
                          f"shards it over; leave it unset or set it to {wanted}", "dist.nproc")
    shape, knobs = ModelShape.from_hf(hf), knobs_of(cfg, context_length(cfg, hf))
    if judge_hf is not None:
        knobs = dataclasses.replace(knobs, judge=judge_knobs(cfg, judge_hf, target))
    if split:
        if r.colocate:
            raise ConfigError(f"true with dist.trainer_gpus={split}: the trainer has GPUs of its own",
                              "rollout.colocate")
        memory = plan_split(shape, target, knobs, split, r.devices)
        devices = split_gpus(target.gpus_per_node, split, r.devices)
    else:
        memory = plan_memory(shape, target, knobs)
        devices = r.devices or tuple(range(target.gpus_per_node))
    if r.tp_sizes:
        sizes = tuple(sorted(r.tp_sizes))
    elif r.tp == "elastic":
        sizes = tuple(t for t in (memory.tp << i for i in range(8)) if t <= len(devices))
        if len(sizes) < 2:
            raise ConfigError(
                f"rollout.tp=elastic: the plan's TP {memory.tp} leaves no larger layout over "
                f"{len(devices)} GPUs; use rollout.tp fixed"
            )
    else:
        sizes = (memory.tp,)
    try:
        fleet = fleet_plan(devices, sizes, memory.tp, r.tp == "elastic")
    except ValueError as e:
        raise ConfigError(f"rollout over GPUs {list(devices)} at the plan's TP {memory.tp}: {e}") from None
    return Box("cuda", dataclasses.replace(fleet, pinned=True), memory, tuple(range(split)))


def _cuda_seen() -> tuple[int, int]:
    import torch

    if not torch.cuda.is_available():
        return (0, 0)
    return (torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory)


def box_for(cfg: Config, model_dir: Path | None) -> Box:
    """This machine's box for a run, worked out once (`rpk.assembly.parts.plan_parts`) and
    handed to the builders that need it. A dry-run target (`dist.gpus`) is never applied
    to a real run."""
    seen = _cuda_seen()
    real = dataclasses.replace(cfg.dist, gpus=0, host_mem_gb=0.0)
    target = target_of(dataclasses.replace(cfg, dist=real), seen, host_memory() if seen[0] else 0)
    if target is None:
        return resolve(cfg, {}, None)  # CPU: the config's layout, no model read
    # Under torchrun (which sets WORLD_SIZE) the trainer's FSDP spans every node's GPUs.
    # LOCAL_WORLD_SIZE alone is no launcher's: vLLM's CPU platform sets it to its TP.
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        target = dataclasses.replace(target, nodes=max(1, world // max(local, 1)))
    return resolve(cfg, model_config(cfg, model_dir), target, judge_config(cfg))


def engine_settings(cfg: Config, model: str, max_model_len: int, box: Box) -> Any:
    """The `VLLMSettings` every replica starts from (`rpk.engine.vllm_fleet` scales
    them per TP)."""
    from rpk.engine.vllm_engine import VLLMSettings

    r = cfg.rollout
    base = VLLMSettings(
        model=model, max_model_len=max_model_len, max_num_seqs=r.max_num_seqs, seed=cfg.run.seed,
        max_lora_rank=_lora_slot_rank(cfg.model.lora_rank),
    )
    if box.memory is None:
        from rpk.gpu.device import engine_dtype

        return dataclasses.replace(
            base, dtype=engine_dtype(r.dtype), kv_cache_memory_bytes=r.kv_cache_mb * 2**20,
            gpu_memory_utilization=r.gpu_memory_utilization,
        )
    return dataclasses.replace(
        base, dtype="bfloat16" if r.dtype == "auto" else r.dtype, kv_cache_memory_bytes=None,
        gpu_memory_utilization=box.memory.gpu_memory_utilization, enable_sleep_mode=True,
        enforce_eager=False,  # the plan reserves vLLM's CUDA graphs
    )


def replicas(settings: Any, box: Box) -> list[dict[str, Any]]:
    """Each replica of each layout: where it runs, whether it starts awake, and the
    exact `vllm.AsyncEngineArgs` keyword arguments it gets."""
    from rpk.engine.vllm_engine import engine_kwargs
    from rpk.engine.vllm_fleet import replica_settings

    cuda = box.platform == "cuda"
    out = []
    for tp, places in box.fleet.layouts().items():
        for place in places:
            out.append({
                "name": place.name,
                "devices": list(place.devices),
                "awake": tp == box.fleet.tp,
                "env": dict(device_env(place, box.platform, os.environ.get("CUDA_VISIBLE_DEVICES")))
                if box.fleet.pinned else {},
                "engine_args": engine_kwargs(replica_settings(settings, tp), cuda),
            })
    return out


def dry_run(cfg: Config, model_dir: Path | None, cuda: tuple[int, int] | None = None) -> dict[str, Any]:
    """What a run of `cfg` would start, as JSON-able data; starts nothing. `model_dir`
    None: the tiny model, not built."""
    hf = model_config(cfg, model_dir)
    # The RAM read here only where the GPUs are read here too (`cuda` given: a test's).
    seen = cuda if cuda is not None else _cuda_seen()
    target = target_of(cfg, seen, host_memory() if cuda is None and seen[0] else 0)
    box = resolve(cfg, hf, target, judge_config(cfg) if target is not None else None)
    choices = trainer_choices(cfg, box)
    context = context_length(cfg, hf)
    settings = engine_settings(cfg, str(model_dir) if model_dir else "<tiny model, built at start>", context, box)
    fleet = box.fleet
    rollout_gpus = sorted({d for ps in fleet.layouts().values() for p in ps for d in p.devices})
    nodes = target.nodes if target is not None else 1
    ranks = (len(box.trainer_devices) * nodes if box.trainer_devices else
             target.gpus if target is not None else (cfg.dist.nproc or 1))
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
            "weight_transfer": weight_path(cfg, box, ranks),
            "tp": fleet.tp,
            "tp_sizes": list(fleet.tp_sizes),
            "trainer_ranks": ranks,
            "fsdp": box.memory.fsdp if box.memory is not None else None,
            "stream_mode": str(box.stream_mode or cfg.train.stream_mode),
        },
        "plan": explain.as_dict(box.memory) if box.memory is not None else None,
        "trainer": {**dataclasses.asdict(choices), "offload": choices.offload.value},
        "replicas": replicas(settings, box),
        **({"judges": judge_engines(cfg, box, nodes)} if box.platform == "cuda" and cfg.reward.judge.model
           and cfg.reward.judge.url is None else {}),
    }


def judge_engines(cfg: Config, box: Box, nodes: int) -> list[dict[str, Any]]:
    """Each judge engine a run of `cfg` starts on the GPUs of each of its engine nodes (of
    `nodes`): its node, GPU, what pins it there (by this machine's CUDA_VISIBLE_DEVICES:
    each node applies its own) and the exact `vllm.AsyncEngineArgs` keyword arguments."""
    from rpk.assembly.settings import judge_settings
    from rpk.engine.vllm_engine import engine_kwargs
    from rpk.judge.vllm import judge_vllm_settings

    settings = judge_settings(cfg)
    places = judge_places(box, os.environ.get("CUDA_VISIBLE_DEVICES"))
    engine_nodes = [n for n in (cfg.dist.engine_nodes or range(nodes)) if n < nodes]
    return [{"node": n, "gpu": p.gpu, "env": dict(p.env),
             "engine_args": engine_kwargs(judge_vllm_settings(settings, Path(str(cfg.reward.judge.model)),
                                                              cfg.run.seed, p.device), True)}
            for n in engine_nodes for p in places]


@dataclass(frozen=True, slots=True)
class Colocation:
    """How rollout and training share the devices (`rpk.engine.fleet.Fleet.rest`)."""

    level: RestLevel  # vLLM's sleep while the trainer trains
    offload: Offload  # the trainer state moved to host while vLLM generates
    # The trainer loads and moves its state out before vLLM starts: vLLM sizes its KV
    # cache from the memory free when it starts (GPU).
    trainer_first: bool


def weight_path(cfg: Config, box: Box, ranks: int) -> str:
    """The backend the run's weights take (`rpk.engine.vllm_fleet.transfer_backend`;
    `cuda`: each replica by where it sits, IPC on the trainer's GPU, else NCCL)."""
    from rpk.engine.vllm_fleet import transfer_backend

    trainer = box.trainer_devices if ranks > 1 else box.trainer_devices[:1]
    return transfer_backend(cfg.rollout.weight_transfer, box.fleet, box.platform, 0, trainer)


def colocation(cfg: Config, box: Box) -> Colocation | None:
    """On by default on CUDA where rollout and training share the GPUs."""
    shared = box.platform == "cuda" and not box.trainer_devices
    on = cfg.rollout.colocate if cfg.rollout.colocate is not None else shared
    if not on:
        return None
    if box.memory is not None and box.memory.rest_level is not None:
        level = box.memory.rest_level
    else:  # a LoRA sync is the adapter alone: resting replicas keep the base
        level = RestLevel.KEEP_WEIGHTS if cfg.model.lora_rank else RestLevel.DROP_WEIGHTS
    return Colocation(level, trainer_choices(cfg, box).offload, trainer_first=box.platform == "cuda")


@dataclass(frozen=True, slots=True)
class TrainerChoices:
    """What the trainer is told beside its config: the plan's deferral and offload."""

    defer_reduction: bool
    offload: Offload
    activation_checkpointing: bool
    dtype: str  # the trainer's: float32, or on a GPU plan a LoRA run's frozen base in bf16


def trainer_choices(cfg: Config, box: Box) -> TrainerChoices:
    t = cfg.train
    m = box.memory
    return TrainerChoices(
        defer_reduction=m.defer_reduction if m is not None else t.defer_reduction is not False,
        offload=m.offload if m is not None else Offload.NONE if t.offload == "auto" else Offload(t.offload),
        activation_checkpointing=(
            t.activation_checkpointing if t.activation_checkpointing is not None else m is not None
        ),
        dtype="bfloat16" if m is not None and m.knobs.lora_rank else "float32",
    )


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


def judge_places(box: Box, visible: str | None, node: int | None = None) -> list[JudgePlace]:
    """A judge engine on each of this node's rollout GPUs (`visible`: the launcher's
    CUDA_VISIBLE_DEVICES; `node`: named in what the engines say, in a run over several
    nodes), as the plan prices them; empty on CPU or without a judge."""
    device = judge_device(box.memory) if box.memory is not None else None
    if device is None:
        return []
    return places_on(box.fleet.devices, device, visible, node)


def judge_launch(cfg: Config, settings: JudgeSettings, box: Box) -> JudgeLaunch | None:
    """What the other engine nodes start their judges from (`rpk.cluster.nodes.EngineSpec`):
    the placement worked out here once; None on CPU or without a judge in the plan."""
    device = judge_device(box.memory) if box.memory is not None else None
    if device is None:
        return None
    return JudgeLaunch(settings, device, box.fleet.devices, cfg.model.hub_cache, cfg.run.seed)


def judge_launcher(cfg: Config, box: Box, node: int | None = None,
                   log: Callable[[str], None] = print) -> Callable[[JudgeSettings], Awaitable[JudgeEngine]]:
    """What `JudgeScorer.start` calls (`rpk.judge.tier.start_tier`): the external
    endpoint where `reward.judge.url` is set, else one engine per rollout GPU where the
    plan places the judge there, else one engine with the config's settings; the verdict
    cache in front unless it is off."""
    from rpk.assembly.settings import judge_tier

    places = judge_places(box, os.environ.get("CUDA_VISIBLE_DEVICES"), node)
    return functools.partial(start_tier, tier=judge_tier(cfg), places=places, hub_cache=cfg.model.hub_cache,
                             seed=cfg.run.seed, log=log)


def describe_judge(settings: JudgeSettings, box: Box, url: str | None = None) -> str:
    """The judge's line in the run's log: the model served (rpk's tiny judge's directory
    when the config names none), and where (`url`: an external endpoint)."""
    if url is not None:
        return f"judge: {settings.model or 'the model'} served at {url} ({settings.verdict} verdicts)"
    places = judge_places(box, os.environ.get("CUDA_VISIBLE_DEVICES"))
    where = ""
    if places:
        d = places[0].device
        where = (f"; an engine on each of GPUs {[p.gpu for p in places]} (gpu_memory_utilization "
                 f"{d.gpu_memory_utilization}, {d.offloaded} of {d.layers} layers streamed from host, "
                 f"max_num_seqs {d.max_num_seqs})")
    return f"judge: {settings.model} ({settings.verdict} verdicts){where}"
