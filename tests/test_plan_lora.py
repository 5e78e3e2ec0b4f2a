"""The memory plan of a LoRA run (rpk.gpu.plan.pricing's LoRA rows): the frozen base in
bf16, gradients and AdamW for the adapters alone, no reference copy, vLLM's adapter slot,
level-1 rests with every GPU's weight shard backed up on host; and the dry run's engine
arguments and trainer dtype."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from rpk.assembly import box
from rpk.assembly.dry_run import dry_run
from rpk.core.modes import Offload, RestLevel
from rpk.gpu.plan import Knobs, ModelShape, Phase, Target, plan_memory
from rpk.gpu.plan.pricing import adapter_params

MODELS = Path(__file__).parent / "fixtures" / "models"
GB80 = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9, host_bytes=2 * 10**12)


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))


def lora(rank: int = 8, **kw: object) -> Knobs:
    return Knobs(max_model_len=17408, lora_rank=rank, lora_slot_rank=max(rank, 8), **kw)  # type: ignore[arg-type]


def test_adapter_count_is_rank_times_in_plus_out_of_each_targeted_linear() -> None:
    s = shape("7b")
    h, kv, i = s.hidden_size, s.kv_dim, s.intermediate_size
    qv = 8 * (h + h) + 8 * (h + kv)  # q_proj is h -> h on Qwen2.5-7B, v_proj h -> kv
    assert adapter_params(s, 8, ("q_proj", "v_proj")) == s.num_layers * qv
    every = 8 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i)) * s.num_layers
    assert adapter_params(s, 8, ("all-linear",)) == every
    assert adapter_params(s, 16, ("all-linear",)) == 2 * every


def test_lora_rows_hold_a_bf16_base_and_float32_adapter_state_only() -> None:
    s = shape("7b")
    plan = plan_memory(s, GB80, lora(defer_reduction=True))
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    names = {r.name for r in train.residents if r.owner == "trainer"}
    assert {"base", "adapters", "adapter_adamw", "adapter_grads_unsharded"} <= names
    assert not names & {"params", "adamw", "grads", "grads_unsharded", "kl_reference"}
    n = adapter_params(s, 8, ("all-linear",))
    assert train.bytes_of("trainer", "base") == math.ceil(s.params * 2 / 8)  # bf16 over FSDP 8
    # The adapters, their gradient and AdamW's moments in float32, as a full model's.
    assert train.bytes_of("trainer", "adapters") == math.ceil(n * 4 / 8)
    assert train.bytes_of("trainer", "adapter_adamw") == math.ceil(n * 8 / 8)
    assert train.bytes_of("trainer", "adapter_grads_unsharded") == n * 4  # deferred: whole, every rank
    rollout = plan.phases[0]
    assert rollout.bytes_of("vllm", "lora_slot") == math.ceil(n * 2 / plan.tp)


def test_lora_trains_in_far_less_memory_and_keeps_no_reference_copy() -> None:
    s = shape("14b")
    full = plan_memory(s, GB80, Knobs(max_model_len=17408, kl_reference=True))
    adapted = plan_memory(s, GB80, lora())
    total = {p.phase: p.total for p in full.phases}
    for p in adapted.phases:
        assert p.bytes_of("trainer", "kl_reference") == 0
        if p.phase is Phase.TRAIN:
            assert p.total < total[Phase.TRAIN] / 2, (p.total, total[Phase.TRAIN])


def test_lora_rests_at_level_1_and_backs_each_gpus_shard_up_on_host() -> None:
    s = shape("7b")
    plan = plan_memory(s, GB80, lora())
    assert plan.rest_level is RestLevel.KEEP_WEIGHTS
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    assert "vllm.weights (sleep level 1: to host)" in train.moved_out
    host = plan.host[0]
    backup = sum(r.bytes for r in host.residents if r.name == "weights_backup")
    assert backup == 8 * math.ceil(s.params * 2 / plan.tp)
    full = plan_memory(s, GB80, Knobs(max_model_len=17408))
    assert full.rest_level is RestLevel.DROP_WEIGHTS
    assert not any(r.name == "weights_backup" for h in full.host for r in h.residents)


def test_lora_sync_sends_the_adapters_not_the_model() -> None:
    s = shape("14b")
    full = plan_memory(s, GB80, Knobs(max_model_len=17408))
    adapted = plan_memory(s, GB80, lora())
    sent = {p.knobs.lora_rank: next(x for x in p.phases if x.phase is Phase.SYNC).bytes_of("trainer", "sync_buckets")
            for p in (full, adapted)}
    assert sent[8] == 2 * adapter_params(s, 8, ("all-linear",)) * 4 < sent[0] / 10  # float32 adapters


def test_a_lora_offload_moves_the_base_and_the_adapter_moments() -> None:
    s = shape("32b")
    plan = plan_memory(s, replace(GB80), Knobs(max_model_len=33792, lora_rank=8, lora_slot_rank=8))
    assert plan.offload is Offload.ALL  # the bf16 base is over 5% of a GPU at 32B
    rollout = plan.phases[0]
    moved = {"trainer.base -> host", "trainer.adapters -> host", "trainer.adapter_adamw -> host"}
    assert moved <= set(rollout.moved_out)
    assert rollout.bytes_of("trainer", "base") == 0


def test_32b_at_32k_fits_one_box_with_lora_and_not_without() -> None:
    from rpk.gpu.plan import PlanRefused

    s = shape("32b")
    with pytest.raises(PlanRefused, match="train phase, GPU 0"):
        plan_memory(s, GB80, Knobs(max_model_len=33792))
    assert plan_memory(s, GB80, Knobs(max_model_len=33792, lora_rank=8, lora_slot_rank=8)).tp == 2


def test_the_dry_run_starts_vllm_with_lora_and_the_trainer_in_bf16() -> None:
    from rpk.config import from_argv

    cfg = from_argv(["--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8", "--dist.gpu_mem_gb", "80",
                     "--rollout.max_tokens", "16384", "--model.lora_rank", "8"])
    d = dry_run(cfg, MODELS / "qwen2.5-7b", cuda=(0, 0))
    args = d["replicas"][0]["engine_args"]
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 8, 1)
    assert d["plan"]["train_sleep_level"] == 1 and d["trainer"]["dtype"] == "bfloat16"
    assert "vllm.lora_slot" in d["plan"]["phases"][0]["residents_gb"]


@pytest.mark.parametrize("rank, level", [(0, RestLevel.DROP_WEIGHTS), (8, RestLevel.KEEP_WEIGHTS)])
def test_a_colocated_lora_run_rests_at_level_1_without_a_gpu_plan_too(rank: int, level: RestLevel) -> None:
    from rpk.config import from_argv

    cfg = from_argv(["--rollout.colocate", "true", "--model.lora_rank", str(rank)])
    colo = box.colocation(cfg, box.resolve_box(cfg, {}, None))
    assert colo is not None and colo.level is level and colo.offload is Offload.NONE
