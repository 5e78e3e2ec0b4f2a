"""Which device and dtype each component uses, decided in one place."""

from __future__ import annotations

import torch


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
