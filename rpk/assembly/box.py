"""The GPU box: a run's rollout layout, engine settings and trainer choices resolved
from the config and the memory plan (`rpk.gpu.plan`). Assembly: the one place the plan
meets the config, so `rpk.gpu` reads none; `rpk.assembly.dry_run` prints what it resolves.

On CUDA with N GPUs per node, rollout and training share all N: the rollout's replicas
cover every GPU at the TP the plan picks (the smallest whose weights and a useful KV
cache fit), the trainer is FSDP over every rank, and vLLM gets the plan's
`gpu_memory_utilization` (never an explicit KV size: that would override it) with its
sleep mode on. On CPU nothing changes: the config's devices and TP sizes, and its KV
size. The same resolution answers a dry run for a target this machine does not have
(`--dist.gpus 8 --dist.gpu_mem_gb 80`, and `--dist.host_mem_gb` for its nodes' RAM).

The judge (`reward.judge.model`, or the tiny judge rpk builds for the judged task) is in
the plan whenever the run has one: `judge_plan` works out its engines once, one on every
rollout GPU of every engine node, each pinned there as the rollout replicas are and with
the plan's share of the GPU, its streamed layers and its per-GPU concurrency
(`rpk.judge.pool.JudgePlan`); on CPU one engine with `reward.judge`'s settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpk import hub
from rpk.assembly.settings import run_judge_settings, speculation, uses_tiny_judge
from rpk.config import Config, ConfigError
from rpk.config.execution import RolloutConfig
from rpk.core.modes import Offload, RestLevel, StreamMode
from rpk.core.records import RoundKind
from rpk.engine.placement import FleetPlan, Platform, fleet_plan
from rpk.engine.vllm_settings import SpecSettings, VLLMSettings
from rpk.gpu.device import engine_dtype
from rpk.gpu.plan import Knobs, MemoryPlan, ModelShape, Stream, Target, judge, plan_memory, plan_split, split_gpus
from rpk.gpu.plan.judge import TEMPLATE_TOKENS
from rpk.gpu.plan.pricing import PREFILL_TOKENS, JudgeKnobs, prefill_tokens, splits_heads
from rpk.judge.pool import JudgePlan
from rpk.judge.vllm import JudgeDevice
from rpk.sched.speculate import Speculation
from rpk.sync import backends
from rpk.sync.adapter import max_lora_rank
from rpk.sync.backends import WeightPath
from rpk.sync.runtime import runnable
from rpk.tasks.specs import TinySpec


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


def tiny_config(spec: TinySpec) -> dict[str, Any]:
    """The config.json of rpk's tiny model of `spec` (the policy's or the judge's), for a
    plan made before it is built (the tokenizer may end up a little smaller than
    vocab_size)."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size, "tie_word_embeddings": True,
        "max_position_embeddings": spec.max_position_embeddings,
    }


def model_config(cfg: Config, model_dir: Path | None) -> dict[str, Any]:
    """The model's config.json, or for the tiny model not built yet, its shape from
    `model.tiny`."""
    if model_dir is not None:
        return json.loads((model_dir / "config.json").read_text())
    return tiny_config(cfg.model.tiny)


def judge_config(cfg: Config) -> dict[str, Any] | None:
    """The config.json of the judge the run starts (`judge_settings`: `reward.judge.model`,
    a directory or a Hub id whose config alone is fetched; or rpk's tiny judge of the
    judged task, from its spec while it is not built), or None without a judge of rpk's
    to place (none, or an external one: `reward.judge.url`)."""
    model = run_judge_settings(cfg).model if cfg.reward.judge.model is not None or uses_tiny_judge(cfg) else None
    if model is None or cfg.reward.judge.url is not None:
        return None
    path = Path(model)
    if uses_tiny_judge(cfg) and not (path / "config.json").is_file():
        return tiny_config(cfg.model.tiny_judge)
    if hub.is_hub_id(model) and not path.exists():
        path = hub.fetch(model, cfg.model.hub_cache, config_only=True)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{model!r} has no config.json for the memory plan to read", "reward.judge.model")
    return json.loads((path / "config.json").read_text())


def judge_knobs(cfg: Config, hf: dict[str, Any], target: Target) -> JudgeKnobs:
    """The judge the plan places beside the rollout on every GPU: its longest input is the
    prompt, the tail of the longest response it sees, its template and its verdict (the
    judge's settings: the tiny judge's reads a short tail)."""
    j, r = run_judge_settings(cfg), cfg.rollout
    verdict = j.kind.output_tokens(j)
    longest = cfg.data.max_prompt_tokens + min(r.max_tokens, j.max_response_chars) + TEMPLATE_TOKENS + verdict
    context = int(hf.get("max_position_embeddings") or longest)
    return JudgeKnobs(ModelShape.from_hf(hf), j.max_model_len or min(context, longest),
                      -(-j.max_requests // target.gpus))


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
    return max_lora_rank(rank)


def resolve_box(cfg: Config, hf: dict[str, Any], target: Target | None, judge_hf: dict[str, Any] | None = None) -> Box:
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
    _check_heads(shape, "rollout.tp_size", (knobs.tp,) if knobs.tp else ())
    _check_heads(shape, "rollout.tp_sizes", r.tp_sizes)
    if judge_hf is not None:
        knobs = dataclasses.replace(knobs, judge=judge_knobs(cfg, judge_hf, target))
    if split and r.colocate:
        raise ConfigError(f"true with dist.trainer_gpus={split}: the trainer has GPUs of its own",
                          "rollout.colocate")

    def plan(k: Knobs) -> MemoryPlan:
        return plan_split(shape, target, k, split, r.devices) if split else plan_memory(shape, target, k)

    memory = plan(knobs)
    devices = split_gpus(target.gpus_per_node, split, r.devices) if split else (
        r.devices or tuple(range(target.gpus_per_node)))
    if r.tp_sizes:
        sizes = tuple(sorted(r.tp_sizes))
    elif r.tp == "elastic":
        sizes = tuple(t for t in (memory.tp << i for i in range(8)) if t <= len(devices) and splits_heads(shape, t))
        if len(sizes) < 2:
            raise ConfigError(
                f"rollout.tp=elastic: the plan's TP {memory.tp} leaves no larger layout over "
                f"{len(devices)} GPUs that splits the model's {shape.num_heads} attention heads; use rollout.tp fixed"
            )
        # The layouts the fleet starts, all but one asleep beside the awake one: planned
        # again with them, at the TP the first plan picked.
        memory = plan(dataclasses.replace(knobs, tp_sizes=sizes, tp=memory.tp))
    else:
        sizes = (memory.tp,)
    try:
        fleet = fleet_plan(devices, sizes, memory.tp, r.tp == "elastic")
    except ValueError as e:
        raise ConfigError(f"rollout over GPUs {list(devices)} at the plan's TP {memory.tp}: {e}") from None
    return Box("cuda", dataclasses.replace(fleet, pinned=True), memory, tuple(range(split)))


def _check_heads(shape: ModelShape, name: str, sizes: tuple[int, ...]) -> None:
    """TP sizes asked for that do not split the attention heads, refused as vLLM would
    refuse them at start (`Total number of attention heads ... must be divisible by
    tensor parallel size`)."""
    if bad := [t for t in sizes if not splits_heads(shape, t)]:
        raise ConfigError(f"{','.join(map(str, sizes))}: TP {bad} does not split the model's {shape.num_heads} "
                          f"attention heads ({shape.num_kv_heads} KV heads), which vLLM refuses", name)


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
        return resolve_box(cfg, {}, None)  # CPU: the config's layout, no model read
    # Under torchrun (which sets WORLD_SIZE) the trainer's FSDP spans every node's GPUs.
    # LOCAL_WORLD_SIZE alone is no launcher's: vLLM's CPU platform sets it to its TP.
    if "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        target = dataclasses.replace(target, nodes=max(1, world // max(local, 1)))
        check_local_ranks(cfg, local, target.gpus_per_node)
    return resolve_box(cfg, model_config(cfg, model_dir), target, judge_config(cfg))


def check_local_ranks(cfg: Config, local: int, gpus: int) -> None:
    """A launcher that started fewer ranks a node than the trainer's GPUs there (an outside
    `torchrun --nproc-per-node 4` on 8 GPUs) is refused: the plan shards the trainer over
    every trainer GPU, and fewer ranks would each hold more than it priced."""
    wanted = cfg.dist.trainer_gpus or gpus
    if local < wanted:
        raise ConfigError(
            f"the launcher started {local} ranks a node, but the memory plan shards the trainer over "
            f"the node's {wanted} {'trainer ' if cfg.dist.trainer_gpus else ''}GPUs: start {wanted} "
            f"(torchrun --nproc-per-node {wanted}), or let rpk start them (python -m rpk.run)")


def engine_settings(cfg: Config, model: str, max_model_len: int, box: Box) -> VLLMSettings:
    """The `VLLMSettings` every replica starts from (`rpk.engine.vllm_fleet` scales
    them per TP)."""
    r = cfg.rollout
    base = VLLMSettings(
        model=model, max_model_len=max_model_len, max_num_seqs=r.max_num_seqs, seed=cfg.run.seed,
        max_lora_rank=_lora_slot_rank(cfg.model.lora_rank),
        speculative=spec_settings(r, box.platform == "cuda"),
    )
    if box.memory is None:
        return dataclasses.replace(
            base, dtype=engine_dtype(r.dtype), kv_cache_memory_bytes=r.kv_cache_mb * 2**20,
            gpu_memory_utilization=r.gpu_memory_utilization,
        )
    return dataclasses.replace(
        base, dtype="bfloat16" if r.dtype == "auto" else r.dtype, kv_cache_memory_bytes=None,
        gpu_memory_utilization=box.memory.gpu_memory_utilization, enable_sleep_mode=True,
        enforce_eager=False,  # the plan reserves vLLM's CUDA graphs
        max_num_batched_tokens=PREFILL_TOKENS,  # the prefill the plan prices (`prefill_tokens`)
    )


def spec_settings(r: RolloutConfig, cuda: bool = False) -> SpecSettings | None:
    """The replicas' speculative decoding, None when off: the longest draft and the
    draft lengths by batch size at start, planned with the prior (no step cost or
    acceptance measured yet; rpk's proposer is re-planned every round, vLLM's ngram
    keeps this plan), and whether each replica has a plain twin (unset: on CPU only,
    where a twin costs no device memory)."""
    spec = speculation(r)
    if spec is None:
        return None
    choice, rule = spec
    assert choice.method is not None
    plan = Speculation(choice.sources, rule).plan(RoundKind.SYNC, "", r.max_num_seqs)
    twin = r.spec_twin if r.spec_twin is not None else not cuda
    return SpecSettings(choice.method, rule.max_k, tuple(plan.schedule()), twin=twin)


@dataclass(frozen=True, slots=True)
class Colocation:
    """How rollout and training share the devices (`rpk.engine.fleet.Fleet.rest`)."""

    level: RestLevel  # vLLM's sleep while the trainer trains
    offload: Offload  # the trainer state moved to host while vLLM generates
    # The trainer loads and moves its state out before vLLM starts: vLLM sizes its KV
    # cache from the memory free when it starts (GPU).
    trainer_first: bool


def weight_path(cfg: Config, box: Box, ranks: int) -> WeightPath:
    """The run's weight path, resolved once (`rpk.sync.backends.resolve`; `cuda`: each
    replica by where it sits, IPC on the trainer's GPU, else NCCL; a LoRA run's, adapters),
    as this machine can run it (`rpk.sync.runtime.runnable`: the path's `note` says why
    node 0's backend is not the one the choice resolves to, "" when it is)."""
    trainer = box.trainer_devices if ranks > 1 else box.trainer_devices[:1]
    choice = cfg.rollout.weight_transfer
    try:
        path = backends.resolve(choice, box.platform, set(box.fleet.devices), 0, trainer,
                                adapter=bool(cfg.model.lora_rank))
        local, note = runnable(path.local, choice)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(path, local=local, note=note)


def colocation(cfg: Config, box: Box) -> Colocation | None:
    """On by default on CUDA where rollout and training share the GPUs."""
    shared = box.platform == "cuda" and not box.trainer_devices
    on = cfg.rollout.colocate if cfg.rollout.colocate is not None else shared
    if not on:
        return None
    if box.memory is not None and box.memory.rest_level is not None:
        level = box.memory.rest_level
    else:  # a LoRA sync is the adapter alone: resting replicas keep the base
        level = RestLevel.for_sync(adapter=bool(cfg.model.lora_rank))
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


def judge_plan(cfg: Config, box: Box) -> JudgePlan | None:
    """The run's judge engines, worked out once (`rpk.assembly.parts.plan_parts`): on the
    GPUs, the plan's judge on each rollout GPU of every engine node; on CPU one engine
    with the judge's settings; None without a judge of rpk's (none, or an external one:
    `reward.judge.url`, `rpk.judge.tier`)."""
    if cfg.reward.judge.model is None and not uses_tiny_judge(cfg) or cfg.reward.judge.url is not None:
        return None
    settings, m = run_judge_settings(cfg), box.memory
    if m is None:
        return JudgePlan(settings, hub_cache=cfg.model.hub_cache, seed=cfg.run.seed)
    j, layout = m.knobs.judge, m.judge
    if j is None or layout is None:
        raise ConfigError(f"{settings.model!r} on GPUs, but the memory plan has no judge: a judge it "
                          "does not price would start at vLLM's defaults beside the rollout", "reward.judge.model")
    device = JudgeDevice(
        gpu_memory_utilization=judge.gpu_memory_utilization(j, layout, m.target.gpu_bytes),
        layers=j.shape.num_layers, offloaded=layout.offloaded(j.shape.num_layers),
        prefetch_step=judge.PREFETCH_STEP, max_num_seqs=j.max_num_seqs, max_model_len=j.max_model_len,
        max_num_batched_tokens=prefill_tokens(j.max_num_seqs),
    )
    return JudgePlan(settings, device, box.fleet.devices, cfg.model.hub_cache, cfg.run.seed)
