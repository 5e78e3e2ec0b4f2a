"""The GPU memory plan (rpk.gpu.plan): parameter counts against the published ones,
the trainer's bytes per parameter, and the paper's settings on 8 x 80 GB and 32 GPUs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from rpk.core.modes import RestLevel, StreamMode
from rpk.gpu.plan import (
    HEADROOM_FRAC,
    USEFUL_SEQS,
    GiB,
    Knobs,
    ModelShape,
    Offload,
    Phase,
    PlanRefused,
    Stream,
    Target,
    explain,
    plan_memory,
)
from rpk.gpu.plan.pricing import CUDA_GRAPH_BYTES, PEER_CONTEXT_BYTES, PROCESS_BYTES

MODELS = Path(__file__).parent / "fixtures" / "models"
GB80 = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9)


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))


@pytest.mark.parametrize("name, published", [("0.5b", 0.49), ("7b", 7.62), ("14b", 14.8), ("32b", 32.8)])
def test_parameter_counts_match_the_published_ones(name: str, published: float) -> None:
    digits = 2 if published < 10 else 1
    assert round(shape(name).params / 1e9, digits) == published


@pytest.mark.parametrize("name, kib", [("7b", 56), ("14b", 192), ("32b", 256)])
def test_kv_cache_per_token(name: str, kib: int) -> None:
    assert shape(name).kv_bytes_per_token(2) == kib * 1024


def test_a_config_without_a_shape_field_is_refused_by_name() -> None:
    with pytest.raises(PlanRefused, match="'intermediate_size'"):
        ModelShape.from_hf({"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 9})


@pytest.mark.parametrize("gpus", [8, 32])
def test_adamw_with_fp32_master_is_16_bytes_a_parameter_over_fsdp(gpus: int) -> None:
    s = shape("14b")
    target = Target(gpus // 8, 8, 80 * 10**9)
    plan = plan_memory(s, target, Knobs(max_model_len=9216, defer_reduction=False))
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    state = sum(train.bytes_of("trainer", n) for n in ("params", "grads", "adamw"))
    assert plan.fsdp == gpus
    assert state == pytest.approx(16 * s.params / gpus, abs=8)
    # Deferred reduction keeps the whole float32 gradient on every rank.
    deferred = plan_memory(shape("7b"), GB80, Knobs(max_model_len=9216, defer_reduction=True))
    train = next(p for p in deferred.phases if p.phase is Phase.TRAIN)
    assert train.bytes_of("trainer", "grads_unsharded") == 4 * shape("7b").params


def _check(plan) -> None:
    for p in plan.phases:
        assert p.fits and p.total <= p.capacity * (1 - HEADROOM_FRAC), p.phase
        assert all(r.bytes >= 0 for r in p.residents)
    rollout = plan.phases[0]
    assert rollout.phase is Phase.ROLLOUT
    kv_per_token = plan.shape.kv_bytes_per_token(2) // plan.tp
    assert plan.kv_cache_bytes >= USEFUL_SEQS * plan.knobs.max_model_len * kv_per_token
    # vLLM's own share is what gpu_memory_utilization grants it: its budget starts after
    # its context (vLLM's start-up snapshot is taken once the context is up), and the
    # layouts asleep beside it are other processes.
    vllm = sum(r.bytes for r in rollout.residents if r.owner == "vllm" and r.name not in ("context", "asleep_layouts"))
    assert vllm <= plan.gpu_memory_utilization * plan.target.gpu_bytes + 10**6
    assert vllm > (plan.gpu_memory_utilization - 0.002) * plan.target.gpu_bytes


@pytest.mark.parametrize("name", ["7b", "14b"])
@pytest.mark.parametrize("response", [8192, 16384, 32768])
def test_paper_settings_on_8_gpus_of_80gb_fit(name: str, response: int) -> None:
    plan = plan_memory(shape(name), GB80, Knobs(max_model_len=response + 1024))
    _check(plan)
    assert plan.fsdp == 8 and plan.tp == 1
    # While vLLM generates, the trainer state waits on the host: it would cost KV.
    assert plan.offload is Offload.ALL
    assert plan.rest_level is RestLevel.DROP_WEIGHTS
    # Rollout and training never fit together here: training waits for the round.
    assert plan.stream is Stream.AFTER and plan.stream_gpus == ()


@pytest.mark.parametrize("response", [8192, 16384, 32768])
def test_32b_on_8_gpus_of_80gb_is_refused_in_one_line_naming_what_to_change(response: int) -> None:
    with pytest.raises(PlanRefused) as e:
        plan_memory(shape("32b"), GB80, Knobs(max_model_len=response + 1024))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("train phase, GPU 0:")
    assert "trainer.adamw" in line and "FSDP divides the trainer state" in line
    # ... and the GPU count it names does fit.
    gpus = int(line.split("; ")[-1].split(" GPUs")[0])
    _check(plan_memory(shape("32b"), Target(gpus // 8, 8, 80 * 10**9), Knobs(max_model_len=response + 1024)))


def test_14b_at_16k_on_4_nodes() -> None:
    plan = plan_memory(shape("14b"), Target(4, 8, 80 * 10**9), Knobs(max_model_len=16384 + 1024))
    _check(plan)
    assert plan.fsdp == 32 and plan.target.gpus // plan.tp == 32
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    assert train.bytes_of("trainer", "adamw") == pytest.approx(8 * shape("14b").params / 32, abs=8)
    # With 32 ranks the unsharded float32 gradient no longer fits beside the rest.
    assert not plan.defer_reduction


def test_hsdp_streams_on_the_lent_replicas_gpus_where_they_make_whole_groups() -> None:
    small = Target(1, 8, 80 * 10**9)
    plan = plan_memory(shape("7b"), small, Knobs(max_model_len=9216, dp_replicate=2, stream_mode=StreamMode.BORROW))
    assert plan.stream is Stream.LENT and plan.stream_gpus == (4, 5, 6, 7)
    stream = next(p for p in plan.phases if p.phase is Phase.STREAM)
    assert stream.bytes_of("vllm", "kv_cache") == 0 and stream.bytes_of("trainer", "activations") > 0


def test_a_small_model_streams_beside_vllm_and_keeps_its_state() -> None:
    plan = plan_memory(shape("0.5b"), GB80, Knobs(max_model_len=4096))
    assert plan.offload is Offload.NONE and plan.stream is Stream.BESIDE
    assert plan.stream_gpus == tuple(range(8))
    _check(plan)


def test_tp_is_the_smallest_whose_weights_and_a_useful_kv_cache_fit() -> None:
    # 14B's bf16 weights alone are 29.5 GB; the sync keeps AdamW on the GPU beside them
    # (and, at TP 2, the resting layout's graph pool and rank 0's copies on GPU 1)
    small = Target(3, 8, 38 * 10**9)
    plan = plan_memory(shape("14b"), small, Knobs(max_model_len=4096, micro_batch_tokens=4096))
    assert plan.tp == 2
    assert plan.kv_cache_bytes >= USEFUL_SEQS * 4096 * shape("14b").kv_bytes_per_token(2) // 2


def test_the_plan_renders_as_one_table_and_json() -> None:
    plan = plan_memory(shape("14b"), GB80, Knobs(max_model_len=17408))
    table = explain.table(plan).splitlines()
    assert table[1].split()[0] == "phase" and [row.split()[0] for row in table[2:]] == [
        "rollout", "train", "sync"
    ]
    d = explain.as_dict(plan)
    json.dumps(d)
    assert d["gpus"] == 8 and all(p["fits"] for p in d["phases"])
    assert d["kv_tokens_per_replica"] == plan.kv_cache_bytes // (192 * 1024)
    assert d["offload_gb_per_gpu"] == pytest.approx(12 * shape("14b").params / 8 / 1e9, abs=0.01)


def test_an_explicit_offload_none_costs_kv_and_may_refuse() -> None:
    kept = plan_memory(shape("7b"), GB80, Knobs(max_model_len=9216, offload=Offload.NONE))
    moved = plan_memory(shape("7b"), GB80, Knobs(max_model_len=9216))
    assert kept.kv_cache_bytes < moved.kv_cache_bytes
    # gpu_memory_utilization has three decimals: 80 MB steps on 80 GB.
    assert kept.kv_cache_bytes == pytest.approx(moved.kv_cache_bytes - 12 * shape("7b").params // 8, abs=80e6)
    with pytest.raises(PlanRefused, match="rollout, GPU 0"):
        plan_memory(shape("14b"), Target(1, 1, 40 * GiB), Knobs(max_model_len=9216, offload=Offload.NONE))


def test_the_paper_table_says_which_settings_fit() -> None:
    from bench.memory_plan import rows

    fits = {(r[0], r[1], r[2]): r[3] for r in rows(80.0, [1, 4])}
    assert all(fits[(f"Qwen2.5-{m}", k, "1x8")] == "yes" for m in ("7B", "14B") for k in ("8k", "16k", "32k"))
    assert all(fits[("Qwen2.5-32B", k, "1x8")] == "no" for k in ("8k", "16k", "32k"))
    assert fits[("Qwen2.5-14B", "16k", "4x8")] == "yes" and fits[("Qwen2.5-32B", "32k", "4x8")] == "yes"


def test_a_kl_reference_is_a_float32_shard_on_every_gpu_in_every_phase() -> None:
    s, target = shape("32b"), Target(nodes=4, gpus_per_node=8, gpu_bytes=80 * 10**9)
    knobs = Knobs(max_model_len=9216)
    plain, kl = plan_memory(s, target, knobs), plan_memory(s, target, replace(knobs, kl_reference=True))
    assert (kl.tp, kl.offload) == (plain.tp, plain.offload)
    shard = math.ceil(4 * s.params / 32)  # sharded like the policy, never offloaded
    assert [p.phase for p in kl.phases] == [p.phase for p in plain.phases]
    for p in kl.phases:
        assert p.bytes_of("trainer", "kl_reference") == shard and p.fits, p.phase
    # It stays through rollout: the KV cache gives it up (to vLLM's three decimals).
    assert abs(plain.kv_cache_bytes - kl.kv_cache_bytes - shard) < 0.001 * target.gpu_bytes
    train, plain_train = (next(p for p in plan.phases if p.phase is Phase.TRAIN) for plan in (kl, plain))
    # Its forward gathers its own root and two layers in bf16 beside the policy's.
    gathered = (s.root_params + 2 * s.layer_params) * 2
    assert train.bytes_of("trainer", "fsdp_gathered") - plain_train.bytes_of("trainer", "fsdp_gathered") == gathered


@pytest.mark.parametrize("name", ["7b", "14b"])
def test_the_sync_row_keeps_adamw_which_the_code_offloads_after_the_push(name: str) -> None:
    plan = plan_memory(shape(name), GB80, Knobs(max_model_len=16384))
    sync = next(p for p in plan.phases if p.phase is Phase.SYNC)
    assert plan.offload is Offload.ALL
    assert sync.bytes_of("trainer", "adamw") == math.ceil(shape(name).params * 8 / 8)
    assert "trainer.adamw -> host" not in sync.moved_out


def test_the_head_counts_the_backwards_float32_scaled_and_d_hidden() -> None:
    s, k = shape("7b"), Knobs(max_model_len=16384)
    train = next(p for p in plan_memory(s, GB80, k).phases if p.phase is Phase.TRAIN)
    assert train.bytes_of("trainer", "logprob_head") >= 16384 * s.hidden_size * (2 + 4 + 4)


def test_sleeping_elastic_layouts_leave_a_context_and_graph_pool_on_every_gpu() -> None:
    k = Knobs(max_model_len=16384, tp_sizes=(1, 2, 4, 8))
    plan = plan_memory(shape("7b"), GB80, k)
    for p in plan.phases:
        assert p.bytes_of("vllm", "asleep_layouts") == 3 * 2 * GiB, p.phase


def test_beside_leaves_the_trainers_allocator_headroom() -> None:
    plan = plan_memory(shape("0.5b"), GB80, Knobs(max_model_len=4096))
    row = next(p for p in plan.phases if p.phase is Phase.STREAM)
    assert plan.stream is Stream.BESIDE
    assert row.total <= (1 - HEADROOM_FRAC - 0.05) * GB80.gpu_bytes


def test_the_resting_layouts_graph_pool_stays_in_the_train_and_sync_rows() -> None:
    """The awake layout rests at level 2 and keeps its CUDA-graph pool: vLLM allocates it
    outside sleep mode's cumem pool unless `sleep_mode_offload_cudagraph` (which rpk does
    not set), so `sleep` frees it not (vllm/config/vllm.py, `use_cumem_cudagraph_pool`)."""
    plan = plan_memory(shape("14b"), GB80, Knobs(max_model_len=16384))
    for p in plan.phases:
        resting = p.phase is not Phase.ROLLOUT
        assert p.bytes_of("vllm", "cuda_graphs") == (CUDA_GRAPH_BYTES if resting else 0), p.phase


def test_a_layout_spanning_gpu_0_puts_rank_0s_context_and_bucket_copy_on_its_other_gpus() -> None:
    """The IPC lane feeds a replica holding the trainer's GPU by copying each bucket onto
    its other GPUs (`rpk.sync.lanes.IpcLane.send`, `t.to(f"cuda:{d}")`): rank 0's process
    then has a context on each of them, and a bucket in flight during the sync."""
    s = shape("14b")
    alone = plan_memory(s, GB80, Knobs(max_model_len=16384))
    spanning = plan_memory(s, GB80, Knobs(max_model_len=16384, tp_sizes=(1, 2)))
    for plan, peer in ((alone, 0), (spanning, PEER_CONTEXT_BYTES)):
        for p in plan.phases:
            assert p.bytes_of("trainer", "context") == PROCESS_BYTES + peer, p.phase
    bucket = max(spanning.knobs.weight_bucket_bytes, s.largest_tensor * 4)
    sync = {plan: next(p for p in plan.phases if p.phase is Phase.SYNC) for plan in (alone, spanning)}
    assert sync[alone].bytes_of("trainer", "sync_buckets") == 2 * bucket
    assert sync[spanning].bytes_of("trainer", "sync_buckets") == 2 * bucket + bucket // 2  # its bf16 copy
