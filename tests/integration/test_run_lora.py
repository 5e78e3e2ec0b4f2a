"""`python -m rpk.run --model.lora_rank 8` end to end on the real vLLM engine: every sync
an adapter version, verified; checkpoints in PEFT's format; a resume that installs the
checkpoint's adapter before its first round; the merged export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.runs import metrics, rpk_run

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# An entropy bonus gives the adapters a gradient even where the small model scores
# nothing (no advantage): they move every step, so each sync carries new weights.
LORA = ["--model.lora_rank", "8", "--run.verify_sync", "true", "--train.entropy_coef", "0.01"]
# The first test's runs validate before and after (the adapter served for validation);
# the others check sharding and batching, where validation adds only time.
UNVALIDATED = [*LORA, "--data.val_size", "0"]


def test_a_lora_run_syncs_adapters_checkpoints_them_resumes_and_merges(tmp_path: Path, rpk_cache: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rpk.checkpoint import main as checkpoint_main

    first = rpk_run(tmp_path, rpk_cache, *LORA, "--rollout.policy", "tail", "--run.steps", "2")
    assert "weights: LoRA rank 8" in first.stdout + first.stderr
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    step2 = run_dir / "checkpoints" / "step_000002"
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer"} <= {p.name for p in step2.iterdir()}
    assert not (step2 / "model.safetensors").exists()  # the base is not copied into checkpoints
    config = json.loads((step2 / "adapter_config.json").read_text())
    base = Path(config["base_model_name_or_path"])
    assert (config["r"], config["lora_alpha"]) == (8, 16.0) and (base / "config.json").is_file()
    assert json.loads((step2 / "rpk_state.json").read_text())["policy"]["policy"] == "tail"

    second = rpk_run(tmp_path, rpk_cache, *LORA, "--run.steps", "3", "--run.resume", str(run_dir))
    assert "from step_000002" in second.stdout + second.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]

    step3 = run_dir / "checkpoints" / "step_000003"
    a2, a3 = load_file(str(step2 / "adapter_model.safetensors")), load_file(str(step3 / "adapter_model.safetensors"))
    assert a2.keys() == a3.keys() and any(not torch.equal(a2[k], a3[k]) for k in a2)

    assert checkpoint_main(["merge", str(step3), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert merged.keys() == original.keys()
    assert not torch.equal(merged["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], original["model.embed_tokens.weight"])


def test_a_lora_run_on_two_ranks_resumes_on_one(tmp_path: Path, rpk_cache: Path) -> None:
    """FSDP2 over two gloo ranks: the adapters sharded, gathered for each sync and each
    checkpoint, whose DCP state then resumes on a single process."""
    from safetensors.torch import load_file

    rpk_run(tmp_path, rpk_cache, *UNVALIDATED, "--dist.nproc", "2", "--run.steps", "2")
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert [r["version"] for r in metrics(run_dir)] == [1, 2]
    rpk_run(tmp_path, rpk_cache, *UNVALIDATED, "--run.steps", "3", "--run.resume", str(run_dir))
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    checkpoints = run_dir / "checkpoints"
    steps = [load_file(str(checkpoints / f"step_00000{i}" / "adapter_model.safetensors")) for i in (1, 2, 3)]
    for before, after in zip(steps, steps[1:]):
        assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_lora_run_under_length_aware_batching(tmp_path: Path, rpk_cache: Path) -> None:
    """length_aware draws lookahead_rounds * P0 prompts and packs them by guessed length:
    its rounds sample from whichever adapter version is current, as tail's do."""
    from safetensors.torch import load_file

    rpk_run(tmp_path, rpk_cache, *UNVALIDATED, "--rollout.policy", "length_aware", "--run.steps", "2")
    run_dir = (tmp_path / "runs" / "latest").resolve()
    assert [(r["step"], r["version"]) for r in metrics(run_dir)] == [(1, 1), (2, 2)]
    checkpoints = run_dir / "checkpoints"
    state = json.loads((checkpoints / "step_000002" / "rpk_state.json").read_text())
    assert state["policy"]["policy"] == "length_aware"
    before, after = (load_file(str(checkpoints / f"step_00000{i}" / "adapter_model.safetensors")) for i in (1, 2))
    assert any(not torch.equal(before[k], after[k]) for k in before)
