"""The trainer's weights on their way out: HF-named tensors in buckets of bounded size.

Tied weights (Qwen's LM head is the embedding) are one tensor under two names; only the
first name travels: vLLM ties them again on load, and the bytes are not sent twice.

For `nccl_m2n` a sharded trainer sends each rank's own shards (`local_shard`), described
once by `shard_layouts` (full shape and placement per tensor, in the same order). A
tensor FSDP2 shards unevenly (it pads the last shard: a vocabulary of 287 rows over 2
ranks) is the exception: m2n moves only even shards, so that tensor alone is gathered
and travels whole, described as held whole by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from rpk.core.protocols import WeightBucket
from rpk.sync.m2n_plan import REPLICATE, Mesh, ParamLayout, Placements, trainer_mesh


def bucketed(
    named: Iterable[tuple[str, torch.Tensor]],
    max_bytes: int,
    materialise: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.detach(),
    start: Callable[[], None] = lambda: None,
) -> Iterator[WeightBucket]:
    """Group `named` into buckets of at most `max_bytes` (a larger tensor goes alone).
    `materialise` turns each tensor into what travels (a sharded trainer gathers it
    here); it runs as the bucket fills, so at most one bucket exists at a time. `start`
    runs before each bucket's first tensor: once the one before it was consumed."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in _untied(named):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        if not bucket:
            start()
        bucket.append((name, materialise(tensor)))
        size += nbytes
    if bucket:
        yield bucket


def _untied(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` without a tensor seen before under another name."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in named:
        key = (_storage_id(tensor), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            yield name, tensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a (possibly sharded) tensor: no gather, unless FSDP2
    shards it unevenly (every rank gathers that tensor, in the same order)."""
    if _uneven(tensor):
        return tensor.full_tensor().detach()  # type: ignore[attr-defined]
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach()


def _uneven(tensor: torch.Tensor) -> bool:
    """A sharded dim that does not divide by its mesh axis (FSDP2 pads the last shard)."""
    placements = getattr(tensor, "placements", ())
    return any(p.is_shard() and tensor.shape[p.dim] % tensor.device_mesh.size(axis)  # type: ignore[attr-defined]
               for axis, p in enumerate(placements))


def shard_layouts(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[Mesh, list[ParamLayout]]:
    """The trainer's mesh and each tensor's layout as `nccl_m2n` describes them (the
    tensors `bucketed` sends, in its order), read off the DTensors without a gather."""
    layouts, meshes = [], set()
    for name, tensor in _untied(named):
        placements = _placements(name, tensor)
        if placements is not None:
            meshes.add(_mesh(name, tensor))
            if _uneven(tensor):
                placements = None  # gathered: every rank then holds it whole
        layouts.append(ParamLayout(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), placements))
    if len(meshes) > 1:
        raise ValueError(f"nccl_m2n needs one trainer mesh; the weights span {sorted(m.dims for m in meshes)}")
    return (meshes.pop() if meshes else Mesh((1, 1))), layouts


def _placements(name: str, tensor: torch.Tensor) -> Placements | None:
    codes = []
    for p in getattr(tensor, "placements", ()):
        if p.is_replicate():
            codes.append(REPLICATE)
        elif p.is_shard():
            codes.append(p.dim)
        else:
            raise ValueError(f"nccl_m2n cannot send {name!r}: placement {p} is neither Shard nor Replicate")
    if all(c == REPLICATE for c in codes):
        return None
    return (codes[0], REPLICATE) if len(codes) == 1 else (codes[0], codes[1])


def _mesh(name: str, tensor: torch.Tensor) -> Mesh:
    grid = tensor.device_mesh.mesh  # type: ignore[attr-defined]
    ranks = grid.flatten().tolist()
    if ranks != list(range(len(ranks))):
        raise ValueError(f"nccl_m2n needs the trainer's ranks 0..{len(ranks) - 1} in order; {name!r} is on {ranks}")
    return trainer_mesh(tuple(grid.shape))


def _storage_id(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor shard's own storage
    return local.untyped_storage().data_ptr() + local.storage_offset() * local.element_size()
