"""Fixtures of the integration tests: one tiny model and one real vLLM engine per session.

Starting vLLM costs ~5 s of import and ~10 s of start-up on a 2-core CPU machine, so the engine
is shared by every test of the session and shut down explicitly at its end (left to the
interpreter's exit, its finaliser runs after vLLM's modules are torn down).
"""

from __future__ import annotations

from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "integration: starts the real vLLM engine (once per session)"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rpk.config import TinySpec
    from rpk.tasks.tiny import build_tiny_model

    # Random init is enough to exercise the engine, and skips the minutes of warm-up.
    return build_tiny_model(TinySpec(sft_steps=0), tmp_path_factory.mktemp("tiny"))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    from rpk.engine.vllm_engine import VLLMEngine, VLLMSettings

    engine = await VLLMEngine.launch(VLLMSettings(model=tiny_model_dir, max_num_seqs=8))
    try:
        yield engine
    finally:
        await engine.shutdown()
