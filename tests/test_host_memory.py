"""Host RAM in the memory plan (rpk.gpu.plan's host rows): what each node holds at its
worst moment, the lighter offload a small node gets, the one-line refusal and its fixes,
and where the node's RAM comes from (`dist.host_mem_gb`, this machine's)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from rpk import run
from rpk.assembly import box
from rpk.config import ConfigError, from_argv
from rpk.gpu.plan import Knobs, ModelShape, Offload, PlanRefused, Target, explain, plan_memory
from rpk.gpu.plan.pricing import CHECKPOINT_BUCKET_BYTES, HOST_HEADROOM_FRAC, TRAINER_HOST_BYTES

MODELS = Path(__file__).parent / "fixtures" / "models"
GB80 = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9)
H200x2 = Target(nodes=2, gpus_per_node=2, gpu_bytes=141 * 10**9)
KNOBS = Knobs(max_model_len=9216)


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))


def ram(target: Target, gb: float) -> Target:
    return replace(target, host_bytes=int(gb * 1e9))


def on_host(row) -> dict[str, int]:
    return {f"{r.owner}.{r.name}": r.bytes for r in row.residents}


def test_rank_0_alone_loads_the_whole_model_on_host_on_node_0() -> None:
    s = shape("14b")
    knobs = replace(KNOBS, offload=Offload.NONE, tp=8)
    plan = plan_memory(s, Target(2, 8, 80 * 10**9), knobs)
    zero, one = plan.host
    assert (zero.node, zero.moment) == (0, "load")
    # One float32 model (rank 0's: the other ranks receive their shards), not one per rank.
    assert on_host(zero) == {
        "trainer.processes": 8 * TRAINER_HOST_BYTES, "vllm.processes": on_host(one)["vllm.processes"],
        "trainer.model_load": 4 * s.params,
    }
    assert one.moment != "load" and "trainer.model_load" not in on_host(one)
    assert all(h.fits and not h.capacity for h in plan.host)  # RAM unknown: not checked


def test_rollout_holds_every_gpus_offloaded_state_and_no_copy_of_vllms_weights() -> None:
    s = shape("14b")
    plan = plan_memory(s, GB80, KNOBS)
    assert plan.offload is Offload.ALL
    row, = plan.host
    assert row.moment == "rollout"
    held = on_host(row)
    assert held["trainer.params"] == 8 * (4 * s.params // 8)  # pageable: module.to("cpu")
    # Pinned blocks are rounded up to a power of two each: more than the bytes, less than twice.
    moments = 8 * 8 * s.params // 8
    assert moments < held["trainer.adamw_pinned"] < 2 * moments
    # vLLM rests at level 2 for a save as for training: its weights never go to host.
    optimizer = plan_memory(s, GB80, replace(KNOBS, offload=Offload.OPTIMIZER)).host[0]
    assert optimizer.moment == "checkpoint" and set(on_host(optimizer)) == {
        "trainer.processes", "vllm.processes", "trainer.adamw_pinned", "trainer.checkpoint_bucket"}


def test_the_checkpoint_bucket_is_node_0s_alone() -> None:
    from rpk.train.state import HF_SHARD_BYTES

    assert CHECKPOINT_BUCKET_BYTES == HF_SHARD_BYTES
    zero, one = plan_memory(shape("7b"), H200x2, replace(KNOBS, offload=Offload.OPTIMIZER)).host
    assert zero.moment == "checkpoint"
    assert on_host(zero)["trainer.checkpoint_bucket"] == max(CHECKPOINT_BUCKET_BYTES, 4 * shape("7b").largest_tensor)
    assert "trainer.checkpoint_bucket" not in on_host(one)
    assert zero.total - one.total == on_host(zero)["trainer.checkpoint_bucket"]


def test_14b_on_8_gpus_of_80gb_with_ample_ram_plans_as_before() -> None:
    unknown = plan_memory(shape("14b"), GB80, KNOBS)
    ample = plan_memory(shape("14b"), ram(GB80, 2000), KNOBS)
    assert ample.offload is unknown.offload is Offload.ALL
    assert ample.phases == unknown.phases and ample.host[0].fits


@pytest.mark.parametrize("gb, offload", [(2000, Offload.ALL), (360, Offload.OPTIMIZER), (300, Offload.NONE)])
def test_a_node_short_of_ram_gets_a_lighter_offload_that_fits_the_gpus(gb: float, offload: Offload) -> None:
    everything = plan_memory(shape("14b"), GB80, KNOBS).host[0].total
    assert (everything > gb * 1e9 * (1 - HOST_HEADROOM_FRAC)) == (offload is not Offload.ALL)
    plan = plan_memory(shape("14b"), ram(GB80, gb), KNOBS)
    assert plan.offload is offload and plan.knobs.offload is None
    assert all(p.fits for p in plan.phases) and all(h.fits for h in plan.host)


def _fix_gb(line: str) -> int:
    found = re.search(r"nodes with (\d+) GB of RAM or more", line)
    assert found, line
    return int(found.group(1))


@pytest.mark.parametrize("gb", [128, 150])
def test_too_little_ram_for_any_offload_is_one_line_naming_host_the_node_and_a_fix_that_fits(gb: int) -> None:
    with pytest.raises(PlanRefused) as e:
        plan_memory(shape("14b"), ram(GB80, gb), KNOBS)
    line = str(e.value)
    assert "\n" not in line and line.startswith("host, node 0: needs 349.0 GB of RAM at rollout, ")
    assert f"the node has {gb}.0 GB" in line and "largest: trainer.adamw_pinned" in line
    # More nodes do not help (node 0 alone reads the whole model, 145 GB with the rest): more RAM does.
    assert "nodes of 8" not in line and line.endswith("(offload none then)")
    need = _fix_gb(line)
    plan = plan_memory(shape("14b"), ram(GB80, need), KNOBS)
    assert plan.offload is Offload.NONE and all(h.fits for h in plan.host)
    with pytest.raises(PlanRefused, match="^host"):  # the least RAM that fits
        plan_memory(shape("14b"), ram(GB80, need - 1), KNOBS)


def test_an_explicit_offload_too_big_for_the_ram_names_the_lighter_one_and_more_nodes() -> None:
    knobs = replace(KNOBS, offload=Offload.ALL)
    with pytest.raises(PlanRefused) as e:
        plan_memory(shape("14b"), ram(GB80, 360), knobs)
    line = str(e.value)
    assert "--train.offload optimizer" in line and "16 GPUs (2 nodes of 8)" in line
    assert plan_memory(shape("14b"), ram(GB80, 360), replace(knobs, offload=Offload.OPTIMIZER)).host[0].fits
    assert all(h.fits for h in plan_memory(shape("14b"), replace(ram(GB80, 360), nodes=2), knobs).host)


def test_a_kl_reference_is_loaded_on_node_0_with_the_pinned_moments_still_cached() -> None:
    s = shape("14b")
    knobs = replace(KNOBS, offload=Offload.OPTIMIZER, tp=8)
    plain = plan_memory(s, Target(2, 8, 80 * 10**9), knobs).host
    kl = plan_memory(s, Target(2, 8, 80 * 10**9), replace(knobs, kl_reference=True)).host
    # node 1 holds as much at rollout as at a save (no bucket there): the first is named
    assert [h.moment for h in plain] == ["checkpoint", "rollout"]
    assert [h.moment for h in kl] == ["load", "rollout"] and kl[1] == plain[1]
    assert on_host(kl[0]) == {
        "trainer.processes": 8 * TRAINER_HOST_BYTES, "vllm.processes": on_host(plain[0])["vllm.processes"],
        "trainer.adamw_pinned": on_host(plain[0])["trainer.adamw_pinned"], "trainer.model_load": 4 * s.params,
    }


def test_the_table_and_json_show_the_host_rows() -> None:
    plan = plan_memory(shape("14b"), ram(GB80, 2000), KNOBS)
    lines = explain.table(plan).splitlines()
    at = lines.index("host RAM (GB per node, 10% kept free):")
    assert lines[at + 1].split()[:2] == ["node", "moment"] and lines[at + 2].split()[:2] == ["0", "rollout"]
    assert lines[at + 2].split()[-2:] == ["349.0", "2000"]
    row, = explain.as_dict(plan)["host"]
    assert row["available_gb"] == 2000 and row["fits"] is True and row["needed_gb"] == pytest.approx(349.0, abs=0.05)
    unknown, = explain.as_dict(plan_memory(shape("14b"), GB80, KNOBS))["host"]
    assert unknown["available_gb"] is None and unknown["fits"] is None


def test_the_split_layout_loads_one_model_on_node_0_and_names_the_ram_that_fits() -> None:
    from rpk.gpu.plan import plan_split

    s = shape("7b")
    plan = plan_split(s, replace(ram(GB80, 128), nodes=2), KNOBS, trainer_gpus=4)
    zero, one = plan.host
    assert zero.moment == "load" and on_host(zero)["trainer.model_load"] == 4 * s.params and zero.fits
    assert "trainer.model_load" not in on_host(one) and one.total < zero.total
    with pytest.raises(PlanRefused) as e:
        plan_split(s, ram(GB80, 64), KNOBS, trainer_gpus=4)
    line = str(e.value)
    assert line.startswith("host, node 0: needs 73.4 GB of RAM at load, the node has 64.0 GB")
    assert line.endswith("nodes with 82 GB of RAM or more")
    assert plan_split(s, ram(GB80, _fix_gb(line)), KNOBS, trainer_gpus=4).host[0].fits
    with pytest.raises(PlanRefused, match="^host"):  # the least RAM that fits
        plan_split(s, ram(GB80, _fix_gb(line) - 1), KNOBS, trainer_gpus=4)


# -- where the node's RAM comes from -------------------------------------------------


def test_host_memory_reads_this_machine() -> None:
    import os

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < box.host_memory() <= physical


def test_the_dry_runs_target_takes_host_mem_gb_and_never_this_machines_ram() -> None:
    cfg = from_argv(["--run.dry_run", "true", "--dist.gpus", "8", "--dist.gpu_mem_gb", "80"])
    assert box.target_of(cfg, (0, 0), host=10**12).host_bytes == 0
    cfg = from_argv(["--run.dry_run", "true", "--dist.gpus", "8", "--dist.gpu_mem_gb", "80",
                     "--dist.host_mem_gb", "512"])
    assert box.target_of(cfg, (0, 0)).host_bytes == 512 * 10**9
    # The GPUs seen here: this machine's RAM.
    assert box.target_of(from_argv([]), (8, 80 * 10**9), host=10**12).host_bytes == 10**12
    with pytest.raises(ConfigError, match="host_mem_gb"):
        from_argv(["--dist.host_mem_gb", "-1"])


def _dry(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str]:
    code = run.main(["--run.dry_run", "true", "--model.path", str(MODELS / "qwen2.5-14b"),
                     "--dist.gpus", "8", "--dist.gpu_mem_gb", "80", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_the_dry_run_shows_the_host_row_and_refuses_a_node_too_small(capsys) -> None:
    code, d, _ = _dry(capsys, "--dist.host_mem_gb", "1024", "--rollout.max_tokens", "8192")
    assert code == 0 and d is not None
    row, = d["plan"]["host"]
    assert row["node"] == 0 and row["available_gb"] == 1024 and row["fits"] is True
    assert d["plan"]["offload_during_rollout"] == "all"
    code, _, err = _dry(capsys, "--dist.host_mem_gb", "128", "--rollout.max_tokens", "8192")
    assert code == 2
    line, = err.strip().splitlines()
    assert line.startswith("rpk: config error: host, node 0: needs ") and "the node has 128.0 GB" in line
    assert _fix_gb(line) > 128


def test_host_mem_gb_without_a_dry_run_is_refused(capsys) -> None:
    assert run.main(["--dist.host_mem_gb", "128"]) == 2
    assert "add --run.dry_run true" in capsys.readouterr().err


def test_a_run_on_cuda_checks_this_machines_ram(monkeypatch, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-7b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 64 * 10**9)
    with pytest.raises(PlanRefused, match=r"^host, node 0: .* the node has 64\.0 GB"):
        box.box_for(from_argv(["--rollout.max_tokens", "8192"]), model)
