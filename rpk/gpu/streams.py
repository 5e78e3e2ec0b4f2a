"""CUDA streams for the trainer thread.

The trainer runs on its own thread so the event loop keeps feeding vLLM; on GPU it also
needs its own CUDA stream, or its kernels queue behind (and in front of) whatever the
default stream carries. PyTorch's current stream is per thread, so setting it once when
the trainer thread starts puts every trainer kernel on the side stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def side_stream_init(device: str) -> Callable[[], None] | None:
    """A thread initialiser that makes a fresh CUDA stream current on that thread, or
    None on CPU (nothing to do: CPU work is ordered by the thread itself)."""
    if not device.startswith("cuda"):
        return None

    def init() -> None:
        torch.cuda.set_stream(torch.cuda.Stream(device=device))

    return init


def wait_for_stream_blocking(device: torch.device) -> None:
    """Block the calling host thread until the work queued on its current CUDA stream
    is done (a no-op off CUDA). What the trainer's side stream computed, say the
    optimizer step, is then final for a reader on any other stream or thread."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
