"""The GPU box (rpk.assembly.box) and `--run.dry_run`: what a run on an 8-GPU box would
start, asked on this CPU machine; the CPU defaults unchanged; every engine argument a
replica gets is one of vLLM 0.32's."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest

from rpk import run
from rpk.assembly import box
from rpk.assembly.dry_run import dry_run
from rpk.config import Config, ConfigError, from_argv

MODELS = Path(__file__).parent / "fixtures" / "models"


def _dry(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str]:
    code = run.main(["--run.dry_run", "true", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_dry_run_of_14b_at_16k_on_8_gpus_of_80gb(capsys: pytest.CaptureFixture[str]) -> None:
    code, d, _ = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-14b"), "--dist.gpus", "8",
        "--dist.gpu_mem_gb", "80", "--rollout.max_tokens", "16384",
    )
    assert code == 0 and d is not None
    assert d["platform"] == "cuda" and d["layout"]["rollout_gpus"] == 8
    assert sorted(x for r in d["replicas"] for x in r["devices"]) == list(range(8))
    assert d["layout"]["fsdp"] == 8 and d["layout"]["trainer_ranks"] == 8
    for r in d["replicas"]:
        args = r["engine_args"]
        assert args["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in args
        assert args["gpu_memory_utilization"] == d["plan"]["gpu_memory_utilization"] < 1
        assert args["dtype"] == "bfloat16" and args["enforce_eager"] is False
        assert r["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, r["devices"]))}
    assert all(p["fits"] for p in d["plan"]["phases"])
    assert d["plan"]["offload_during_rollout"] == "all"
    # Rollout and training do not fit on a GPU together: training after the round.
    assert d["layout"]["stream_mode"] == "none"


def test_dry_run_starts_replicas_on_the_inherited_masks_gpus(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    code, d, _ = _dry(capsys, "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "4",
                      "--dist.gpu_mem_gb", "80", "--rollout.tp_size", "2")
    assert code == 0 and d is not None
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in d["replicas"] if r["awake"]] == ["4,5", "6,7"]


def test_dry_run_of_32b_at_32k_on_8_gpus_is_a_one_line_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-32b"), "--dist.gpus", "8",
        "--dist.gpu_mem_gb", "80", "--rollout.max_tokens", "32768",
    )
    assert code == 2
    line, = err.strip().splitlines()
    assert line.startswith("rpk: config error: train phase, GPU 0:") and "24 GPUs (3 nodes of 8)" in line
    # ... and on the GPUs it names, it fits.
    code, d, _ = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-32b"), "--dist.gpus", "8", "--dist.nodes", "3",
        "--dist.gpu_mem_gb", "80", "--rollout.max_tokens", "32768",
    )
    assert code == 0 and d is not None and d["plan"]["fsdp"] == 24


def test_dry_run_of_the_default_cpu_run_is_todays(capsys: pytest.CaptureFixture[str]) -> None:
    code, d, _ = _dry(capsys)
    assert code == 0 and d is not None
    assert d["platform"] == "cpu" and d["model"] == "tiny" and d["plan"] is None
    replica, = d["replicas"]
    assert replica["name"] == "tp1.0" and replica["env"] == {}  # unpinned, as today
    args = replica["engine_args"]
    assert args["kv_cache_memory_bytes"] == 512 * 2**20 and args["enable_sleep_mode"] is False
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert d["trainer"] == {"defer_reduction": True, "offload": "none", "activation_checkpointing": False,
                            "dtype": "float32"}


def test_the_tiny_model_gets_a_plan_from_its_spec_without_being_built(capsys, tmp_path: Path) -> None:
    code, d, _ = _dry(capsys, "--dist.gpus", "2", "--dist.gpu_mem_gb", "24",
                      "--model.cache_dir", str(tmp_path))
    assert code == 0 and d is not None and not any(tmp_path.iterdir())
    cfg = Config()
    shape_params = d["plan"]["model_params"]
    t = cfg.model.tiny
    assert shape_params > t.vocab_size * t.hidden_size  # embeddings and layers counted
    assert d["layout"]["rollout_gpus"] == 2 and d["plan"]["stream"] == "beside"


def test_target_flags_without_a_dry_run_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--dist.gpus", "8"]) == 2
    assert "add --run.dry_run true" in capsys.readouterr().err


def test_elastic_tp_on_gpus_builds_layouts_from_the_plans_tp(capsys) -> None:
    code, d, _ = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8", "--dist.gpu_mem_gb", "80",
        "--rollout.tp", "elastic",
    )
    assert code == 0 and d is not None
    # 28 attention heads: no TP-8 layout, which vLLM would refuse.
    assert d["layout"]["tp_sizes"] == [1, 2, 4] and d["layout"]["tp"] == 1
    awake = {r["name"] for r in d["replicas"] if r["awake"]}
    assert awake == {f"tp1.{i}" for i in range(8)}  # one layout awake
    # A TP asked for is kept.
    code, d, _ = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8", "--dist.gpu_mem_gb", "80",
        "--rollout.tp_size", "2",
    )
    assert code == 0 and d is not None and d["layout"]["tp"] == 2 and len(d["replicas"]) == 4


def test_every_engine_argument_is_vllms() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    accepted = set(inspect.signature(AsyncEngineArgs).parameters)
    for argv in ([], ["--dist.gpus", "8", "--dist.gpu_mem_gb", "80", "--rollout.tp", "elastic"]):
        cfg = from_argv(["--run.dry_run", "true", *argv])
        d = dry_run(cfg, MODELS / "qwen2.5-7b")
        for r in d["replicas"]:
            assert set(r["engine_args"]) <= accepted, set(r["engine_args"]) - accepted
    assert inspect.signature(AsyncEngineArgs).parameters["enable_sleep_mode"].default is False


def test_a_run_on_cuda_takes_the_plan(monkeypatch, tmp_path: Path) -> None:
    """box_for on a machine whose CUDA shows 8 GPUs of 80 GB (the device check patched)."""
    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-7b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)  # such a box's RAM
    cfg = from_argv(["--rollout.max_tokens", "8192"])
    b = box.box_for(cfg, model)
    assert b.platform == "cuda" and b.fleet.devices == tuple(range(8)) and b.fleet.pinned
    settings = box.engine_settings(cfg, str(model), 32768, b)
    assert settings.kv_cache_memory_bytes is None and settings.enable_sleep_mode
    assert settings.gpu_memory_utilization == b.memory.gpu_memory_utilization


@pytest.mark.parametrize("env, nodes", [
    ({}, 1),
    # vLLM's CPU platform sets LOCAL_WORLD_SIZE to its TP in the process that starts it:
    # no launcher's variable, so no nodes of it.
    ({"LOCAL_WORLD_SIZE": "1"}, 1),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # torchrun, 2 nodes of 8
])
def test_the_plans_node_count_comes_from_the_launcher_alone(monkeypatch, tmp_path: Path, env, nodes) -> None:
    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-7b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)  # such a box's RAM
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plan = box.box_for(from_argv(["--rollout.max_tokens", "8192"]), model).memory
    assert plan is not None and plan.target.nodes == nodes


def test_fewer_ranks_than_the_trainers_gpus_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry(
        capsys, "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8",
        "--dist.gpu_mem_gb", "80", "--rollout.max_tokens", "8192", "--dist.nproc", "2",
    )
    assert code == 2
    assert "dist.nproc" in err and "2: fewer ranks than the trainer's 8 GPUs" in err
    assert len(err.strip().splitlines()) == 1


def test_an_outside_launcher_with_fewer_ranks_than_the_gpus_is_refused_in_one_line(monkeypatch, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 4` on an 8-GPU box: the plan would shard the trainer
    over 8 GPUs while 4 ranks each hold twice what it priced."""
    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-7b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="the launcher started 4 ranks a node, but the memory plan shards the "
                                          "trainer over the node's 8 GPUs") as refused:
        box.box_for(from_argv(["--rollout.max_tokens", "8192"]), model)
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert box.box_for(from_argv(["--rollout.max_tokens", "8192"]), model).memory is not None


def test_a_tp_that_does_not_split_the_heads_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-7B has 28 attention heads: vLLM refuses TP 8 at start."""
    for flag, value in (("--rollout.tp_size", "8"), ("--rollout.tp_sizes", "1,2,8")):
        code, _, err = _dry(capsys, "--model.path", str(MODELS / "qwen2.5-7b"), "--dist.gpus", "8",
                            "--dist.gpu_mem_gb", "80", flag, value)
        line, = err.strip().splitlines()
        assert code == 2 and f"{flag[2:]} {value}: TP [8] does not split the model's 28 attention heads" in line
