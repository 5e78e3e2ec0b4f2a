"""The trainer thread's CUDA stream: on GPU, trainer kernels queue on a side stream of
their own thread; on CPU there is nothing to set up."""

from __future__ import annotations

import pytest
import torch

from rpk.gpu.streams import side_stream_init
from rpk.loop.trainer import AsyncTrainer
from rpk.sim.trainer import NullTrainer


def test_cpu_needs_no_stream():
    assert side_stream_init("cpu") is None

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_trainer_thread_runs_on_a_side_stream():
    runner = AsyncTrainer(NullTrainer(), thread_init=side_stream_init("cuda"))
    try:
        def work():
            x = torch.ones(1024, 1024, device="cuda")
            y = (x @ x).sum()
            return torch.cuda.current_stream(), y.item()

        stream, value = await runner.call(work)
    finally:
        await runner.aclose()
    assert stream != torch.cuda.default_stream()
    assert value == 1024.0 ** 3
    # the event loop's thread keeps the default stream
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
