"""The disaggregated GPU layout (`dist.trainer_gpus`, rpk.gpu.plan.split): the arithmetic of
each side's memory, its refusals naming the values, `auto`'s weight path over it
(`nccl_m2n` for a sharded trainer), and the dry run that shows it, on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpk import run
from rpk.assembly import box
from rpk.config import ConfigError, from_argv
from rpk.gpu.plan import Knobs, ModelShape, PlanRefused, Stream, Target, explain, plan_split, split_gpus
from rpk.sync import runtime

MODELS = Path(__file__).parent / "fixtures" / "models"
H100 = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9)


def _shape(name: str = "qwen2.5-7b") -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / name / "config.json").read_text()))


def test_each_side_holds_only_its_own_and_fits() -> None:
    shape, knobs = _shape(), Knobs(max_model_len=4096)
    plan = plan_split(shape, H100, knobs, trainer_gpus=4)
    rollout, train, sync = plan.phases
    assert rollout.gpus == (4, 5, 6, 7) and train.gpus == sync.gpus == (0, 1, 2, 3)
    assert {r.owner for r in rollout.residents} == {"vllm"}
    assert {r.owner for r in (*train.residents, *sync.residents)} == {"trainer"}
    assert all(p.fits for p in plan.phases)
    # FSDP over the trainer's 4 GPUs only: 16 bytes a parameter (params + AdamW) / 4
    assert plan.fsdp == 4
    assert train.bytes_of("trainer", "params") + train.bytes_of("trainer", "adamw") == pytest.approx(
        shape.params * 12 / 4, rel=1e-6)
    # vLLM never sleeps for the trainer, nothing is offloaded, training runs beside the rollout
    assert plan.rest_level is None and plan.offload.value == "none" and plan.stream is Stream.BESIDE
    # vLLM's share of a GPU is exactly its residents and the KV cache, below the headroom
    fixed = sum(r.bytes for r in rollout.residents if r.name not in ("kv_cache", "context"))
    assert plan.kv_cache_bytes == int(plan.gpu_memory_utilization * H100.gpu_bytes) - fixed > 0
    assert plan.gpu_memory_utilization <= 0.95
    assert explain.as_dict(plan)["replicas"] == 4 // plan.tp


def test_two_nodes_give_each_side_its_gpus_on_both() -> None:
    plan = plan_split(_shape(), Target(nodes=2, gpus_per_node=8, gpu_bytes=80 * 10**9),
                      Knobs(max_model_len=4096), trainer_gpus=2)
    rollout, train, _ = plan.phases
    assert train.gpus == (0, 1, 8, 9) and rollout.gpus == (2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15)
    assert plan.fsdp == 4


@pytest.mark.parametrize("trainer_gpus,rollout,match", [
    (0, (), r"dist\.trainer_gpus=0: the trainer takes 1\.\.7 of the 8 GPUs"),
    (8, (), r"dist\.trainer_gpus=8: the trainer takes 1\.\.7"),
    (4, (3, 4), r"rollout\.devices=\[3, 4\] with dist\.trainer_gpus=4: GPUs \[3\] are the trainer's"),
    (4, (4, 9), r"GPUs \[9\] are not among the node's 0\.\.7"),
])
def test_the_sides_must_split_the_node(trainer_gpus: int, rollout: tuple[int, ...], match: str) -> None:
    with pytest.raises(PlanRefused, match=match):
        split_gpus(8, trainer_gpus, rollout)


def test_a_trainer_too_big_for_its_gpus_is_refused_naming_them() -> None:
    with pytest.raises(PlanRefused, match=r"train phase, trainer GPU 0: .* FSDP over 1 GPUs; "
                                          r"raise dist\.trainer_gpus=1"):
        plan_split(_shape(), H100, Knobs(max_model_len=4096), trainer_gpus=1)
    with pytest.raises(PlanRefused, match=r"dist\.dp_replicate=3 does not divide the 4 trainer GPUs"):
        plan_split(_shape(), H100, Knobs(max_model_len=4096, dp_replicate=3), trainer_gpus=4)
    # a rollout side too small for a useful KV cache: 32B in bf16 on one 24 GB GPU
    with pytest.raises(PlanRefused, match=r"rollout, GPU 7: at TP 1 the KV cache gets 0\.0 GiB"
                                          r".*\(lower dist\.trainer_gpus=7\)"):
        plan_split(_shape("qwen2.5-32b"), Target(1, 8, 24 * 10**9), Knobs(max_model_len=4096), trainer_gpus=7)


def _box(*argv: str, model: str = "qwen2.5-7b") -> tuple[box.Box, object]:
    cfg = from_argv(["--run.dry_run", "true", "--dist.gpus", "8", "--dist.gpu_mem_gb", "80", *argv])
    return box.resolve_box(cfg, box.model_config(cfg, MODELS / model), box.target_of(cfg, (0, 0))), cfg


@pytest.fixture
def m2n_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with nccl_m2n's runtime (nccl-extensions, a recent NCCL)."""
    monkeypatch.setattr(runtime, "m2n_missing", lambda: None)


def test_auto_sends_shards_over_m2n_only_for_a_sharded_trainer_off_the_rollouts_gpus(m2n_here) -> None:
    split, cfg = _box("--dist.trainer_gpus", "4")
    assert split.trainer_devices == (0, 1, 2, 3)
    assert {d for ps in split.fleet.layouts().values() for p in ps for d in p.devices} == {4, 5, 6, 7}
    assert box.weight_path(cfg, split, 4).local == "nccl_m2n"
    assert box.colocation(cfg, split) is None  # nothing to hand back and forth
    # one trainer rank: nothing sharded to send; every replica off its GPU takes NCCL
    assert box.weight_path(cfg, split, 1).local == "cuda"
    shared, cfg = _box()
    assert shared.trainer_devices == () and box.weight_path(cfg, shared, 8).local == "cuda"
    forced, cfg = _box("--dist.trainer_gpus", "4", "--rollout.weight_transfer", "nccl")
    assert box.weight_path(cfg, forced, 4).local == "nccl"


def test_without_m2n_runtime_auto_falls_back_to_nccl_in_one_line_and_m2n_by_name_is_refused() -> None:
    """This machine has no nccl-extensions: the plan says so before the first step, where
    the first sync used to fail a whole step later (`import_m2n`)."""
    why = runtime.m2n_missing()
    assert why is not None and "nccl-extensions" in why
    split, cfg = _box("--dist.trainer_gpus", "4")
    path = box.weight_path(cfg, split, 4)
    backend, line = path.local, path.note
    assert backend == "nccl" and line.startswith("weights: NCCL broadcast from trainer rank 0, not nccl_m2n")
    assert "\n" not in line and "nccl-extensions" in line
    named, cfg = _box("--dist.trainer_gpus", "4", "--rollout.weight_transfer", "m2n")
    with pytest.raises(ConfigError, match="rollout.weight_transfer=m2n: vLLM's nccl_m2n cannot run here"):
        box.weight_path(cfg, named, 4)
    # A library too old, or none named for vLLM to share with m2n, is as missing.
    assert runtime.runnable(runtime.Backend.NCCL_M2N, "auto", lambda: "NCCL 2.21.5")[0] == "nccl"
    assert runtime.runnable(runtime.Backend.NCCL, "auto", lambda: "never asked") == ("nccl", "")


def test_a_split_asks_for_gpus_and_no_colocation() -> None:
    cfg = from_argv(["--dist.trainer_gpus", "2"])
    with pytest.raises(ConfigError, match=r"dist\.trainer_gpus"):
        box.resolve_box(cfg, {}, None)
    with pytest.raises(ConfigError, match=r"rollout\.colocate"):
        _box("--dist.trainer_gpus", "4", "--rollout.colocate", "true")


def test_the_dry_run_says_which_gpus_train_which_roll_out_and_the_weight_path(
    capsys: pytest.CaptureFixture[str], m2n_here: None,
) -> None:
    code = run.main(["--run.dry_run", "true", "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8",
                     "--dist.gpu_mem_gb", "80", "--dist.trainer_gpus", "4"])
    out, _ = capsys.readouterr()
    assert code == 0
    d = json.loads(out)
    layout = d["layout"]
    assert layout["trainer_devices"] == [0, 1, 2, 3] and layout["rollout_devices"] == [4, 5, 6, 7]
    assert layout["disaggregated"] is True and layout["weight_transfer"] == "nccl_m2n"
    assert layout["trainer_ranks"] == 4 and layout["fsdp"] == 4
    assert sorted(x for r in d["replicas"] for x in r["devices"]) == [4, 5, 6, 7]
    assert all(r["env"]["CUDA_VISIBLE_DEVICES"] in {"4", "5", "6", "7"} for r in d["replicas"])
    assert [p["phase"] for p in d["plan"]["phases"]] == ["rollout", "train", "sync"]
    assert all(p["fits"] for p in d["plan"]["phases"])
    assert d["trainer"]["offload"] == "none"

    code = run.main(["--run.dry_run", "true", "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8",
                     "--dist.gpu_mem_gb", "80", "--dist.trainer_gpus", "8"])
    _, err = capsys.readouterr()
    assert code == 2 and "dist.trainer_gpus=8: the trainer takes 1..7" in err
