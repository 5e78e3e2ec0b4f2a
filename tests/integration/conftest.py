"""Fixtures of the integration tests: one tiny model and one real vLLM engine per session,
and (slow tier) one reference run that several modules read and resume.

Starting vLLM costs ~5 s of import and ~10 s of start-up on a 2-core CPU machine, so the engine
is shared by every test of the session and shut down explicitly at its end (left to the
interpreter's exit, its finaliser runs after vLLM's modules are torn down).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from tests.integration.engines import scaled_normal
from tests.integration.runs import STEPS, Reference, finish, metrics, start


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rpk.config import TinySpec
    from rpk.tasks.tiny import build_tiny_model

    # Random init is enough to exercise the engine, and skips the minutes of warm-up.
    return build_tiny_model(TinySpec(sft_steps=0), tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings

    engine = await VLLMEngine.launch(VLLMSettings(model=tiny_model_dir, max_num_seqs=8))
    try:
        yield engine
    finally:
        await engine.shutdown()


@pytest.fixture(scope="session")
def weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """Weights for the tiny model whose greedy output is not one repeated token (the
    random init's is): what the weight-sync tests send."""
    from safetensors.torch import load_file

    original = load_file(tiny_model_dir / "model.safetensors")
    original["lm_head.weight"] = original["model.embed_tokens.weight"]
    return scaled_normal(original, seed=11)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, rpk_cache: Path) -> Reference:
    """One whole run of `LIFECYCLE`, validated before the first step and after the last,
    a checkpoint each step: what a run writes (test_run_e2e.py), and what an interrupted
    and resumed run must repeat step for step (test_run_lifecycle.py)."""
    out = tmp_path_factory.mktemp("reference")
    code, err = finish(start(out, rpk_cache, "--data.val_size", "8"))
    assert code == 0, err[-4000:]
    run_dir = (out / "runs" / "latest").resolve()
    records = metrics(run_dir)
    assert [r["round_kind"] for r in records] == ["short"] * (STEPS - 1) + ["long"]
    return Reference(run_dir, records, err)
