"""The trainer's weights on their way out: HF-named tensors in buckets of bounded size.

Tied weights (Qwen's LM head is the embedding) are one tensor under two names; only the
first name travels: vLLM ties them again on load, and the bytes are not sent twice.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from rpk.core.protocols import WeightBucket


def bucketed(
    named: Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    materialise: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach(),
) -> Iterator[WeightBucket]:
    """Group `named` into buckets of at most `max_bytes` (a larger tensor goes alone).
    `materialise` turns each tensor into what travels (a sharded trainer gathers it
    here); it runs as the bucket fills, so at most one bucket exists at a time."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    seen: set[tuple[int, tuple[int, ...]]] = set()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        key = (_storage_id(tensor), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, materialise(tensor)))
        size += nbytes
    if bucket:
        yield bucket


def _storage_id(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor shard's own storage
    return local.untyped_storage().data_ptr() + local.storage_offset() * local.element_size()
