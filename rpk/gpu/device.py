"""Which device and dtype each component uses, decided in one place."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

# Where the CUDA MPS control daemon opens its pipe unless CUDA_MPS_PIPE_DIRECTORY says.
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


def trainer_device(requested: str) -> str:
    """`auto` takes CUDA when present; asking for CUDA without it is an error, not a
    silent fall-back to a CPU run that would take days."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but no CUDA device is visible")
    return requested


def engine_dtype(requested: str) -> str:
    """float32 on CPU: on these AVX2 machines vLLM's float32 path is ~1.5x faster than
    bfloat16 (measured: 4,224 vs 2,776 tokens/s); bfloat16 on GPU."""
    if requested != "auto":
        return requested
    return "bfloat16" if torch.cuda.is_available() else "float32"


def mps_on(pipe_dir: Path | None = None) -> bool:
    """Whether the CUDA MPS control daemon runs (its `control` pipe in `pipe_dir`, else
    CUDA_MPS_PIPE_DIRECTORY's or the default). Without it, processes on one GPU (a judge,
    a rollout replica, a trainer rank) take turns on it instead of sharing its SMs."""
    directory = pipe_dir or Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT)
    try:
        return stat.S_ISFIFO((directory / "control").stat().st_mode)
    except OSError:
        return False
