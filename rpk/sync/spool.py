"""Weights from the trainer into vLLM replicas through shared memory: every bucket is
written once, as a safetensors file in /dev/shm, and every replica's workers load the
same files (`rpk.sync.worker.ext`). One weight update therefore costs one copy of the
weights in RAM, however many replicas read it, and the sender holds one bucket at a
time.

It needs nothing of the device: it is the path on CPU, and works on GPU too. vLLM's
transfer engines (gloo, cpu_ipc, NCCL, CUDA IPC) are driven by `rpk.sync.transport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file

from rpk.core.protocols import WeightBucket


class FileLoading(Protocol):
    """A replica that loads weights from spool files (`VLLMEngine`)."""

    async def load_weight_files(self, paths: Sequence[Path], version: int) -> None: ...


@contextlib.asynccontextmanager
async def spooled(buckets: AsyncIterable[WeightBucket]) -> AsyncIterator[list[Path]]:
    """Each bucket written to its own spool file as it arrives; the files are removed
    when the block ends."""
    paths: list[Path] = []
    try:
        async for bucket in buckets:
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            paths.append(spool_file(nbytes))
            await asyncio.to_thread(_save_weights, bucket, paths[-1])
        yield paths
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


class SpoolTransport:
    """The weight path of a fleet: the buckets spooled once, every replica loading the
    files side by side."""

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[FileLoading], version: int
    ) -> None:
        async with spooled(buckets) as paths:
            await asyncio.gather(*(r.load_weight_files(paths, version) for r in replicas))

    async def close(self) -> None:
        """Nothing stays open: each sync's files go when it ends."""


def _save_weights(bucket: WeightBucket, path: Path) -> None:
    """Write CPU copies, keeping the first name of tensors that share memory: safetensors
    refuses shared tensors, and tied weights are one tensor that vLLM loads under the
    embedding's name (first in a state_dict; `lm_head.weight` comes last)."""
    seen: set[tuple[torch.device, int, tuple[int, ...]]] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in bucket:
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().to("cpu").contiguous()
    save_file(unique, str(path))


def spool_file(nbytes: int, prefix: str = "rpk-weights-", suffix: str = ".safetensors") -> Path:
    """A fresh file in /dev/shm (RAM) when it has room, else in the temp dir: container
    /dev/shm is often only 64 MiB."""
    shm = Path("/dev/shm")
    room = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * nbytes
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=shm if room else None)
    os.close(fd)
    return Path(name)
