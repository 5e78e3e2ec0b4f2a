"""Who sends what in vLLM's `nccl_m2n` weight sync: arithmetic over meshes and
placements, no device calls.

vLLM 0.32's m2n puts the trainer's ranks and the workers in one communicator, trainer
ranks `[0, T)` and workers `[T, T + N)`, and moves each parameter with one reshard from
the trainer's layout to the workers': every trainer rank sends only the local shard it
holds, and no rank ever gathers a full tensor. Layouts are vLLM's (`m2n_common`): a
mesh of two axes over a contiguous rank interval, and per tensor one code per axis,
`REPLICATE` (-1) or the tensor dim that axis shards; `None` for a tensor every rank of
the side holds whole.

- The trainer's side is FSDP2's: a 1-D mesh of T ranks, spelt `(T, 1)`, each parameter
  `Shard(0)`, i.e. `(0, REPLICATE)`; HSDP's `(replicate, shard)` mesh is `(-1, 0)`.
- A replica's side is `(1, tp)`: axis 0 replicates, axis 1 is its TP group. The workers
  choose each parameter's destination themselves (vLLM resolves its loader: a
  row-parallel weight is sharded on dim 1 and written in place, a fused q/k/v or
  gate/up part arrives whole and goes through `load_weights`) and publish them at init;
  a plan takes them as given.

One communicator per replica: vLLM's worker engine requires its first worker's rank
(`rank_offset`) to equal the number of trainer ranks, so replicas started as separate
engines cannot share one; every trainer rank sends its shard once per replica.

`pieces` is the transfer spelt out: for every worker, the boxes of a parameter it
receives and the trainer rank that sends each. m2n computes its own equivalent on GPU;
the gloo stand-in (`rpk.sync.m2n_send.GlooLink`) executes exactly this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPLICATE = -1
Placements = tuple[int, int]
Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim

# vLLM's m2n_common bounds, mirrored so a plan fails where vLLM's would, naming the
# parameter (tests/test_m2n.py checks they equal vLLM's).
MAX_TENSOR_DIMS = 3
MAX_SOURCE_SHARDS = 16
MAX_DEST_SHARDS = 64
SUPPORTED_DTYPES = frozenset({
    "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "int32",
    "uint32", "float32", "int64", "uint64", "float64",
})


class M2NPlanError(ValueError):
    """A layout m2n cannot move; the message names the parameter and the values."""


@dataclass(frozen=True, slots=True)
class Mesh:
    """One side's ranks: `dims` row-major over `[start, start + dims[0] * dims[1])`."""

    dims: tuple[int, int]
    start: int = 0

    @property
    def size(self) -> int:
        return self.dims[0] * self.dims[1]


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One parameter as the trainer holds it: HF name, dtype name (`bfloat16`), full
    shape, and its placements over the trainer's mesh (None: whole on every rank)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    placements: Placements | None


@dataclass(frozen=True, slots=True)
class Piece:
    """`box` of parameter `name` (full-tensor coordinates) goes from trainer rank `src`
    to worker `dst` (group rank `T + dst`)."""

    name: str
    src: int
    dst: int
    box: Box

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


def trainer_mesh(mesh_shape: Sequence[int]) -> Mesh:
    """The trainer's device mesh (`ParallelLayout.mesh_shape`: (shard,) or
    (replicate, shard)) as m2n's two-axis mesh."""
    dims = tuple(mesh_shape)
    if len(dims) == 1:
        return Mesh((dims[0], 1))
    if len(dims) == 2:
        return Mesh((dims[0], dims[1]))
    raise M2NPlanError(f"nccl_m2n takes a 1-D or 2-D trainer mesh, got {list(dims)}")


def replica_mesh(ranks: int, tp: int) -> Mesh:
    """A TP-`tp` replica's workers, after the trainer's `ranks` in its group."""
    return Mesh((1, tp), ranks)


def _split(mesh: Mesh, placements: Placements | None) -> tuple[int | None, int, int]:
    """(tensor dim sharded or None, number of shards, the sharding mesh axis)."""
    if placements is None:
        return None, 1, 0
    axis = next(a for a, code in enumerate(placements) if code != REPLICATE)
    return placements[axis], mesh.dims[axis], axis


def _shard_index(mesh: Mesh, axis: int, rank: int) -> int:
    coords = divmod(rank - mesh.start, mesh.dims[1])
    return coords[axis]


def held_box(shape: Sequence[int], mesh: Mesh, placements: Placements | None, rank: int) -> Box:
    """The box of a tensor that `rank` (a group rank, `mesh.start` onwards) holds."""
    dim, parts, axis = _split(mesh, placements)
    return box_of(shape, dim, parts, 0 if dim is None else _shard_index(mesh, axis, rank))


def box_of(shape: Sequence[int], dim: int | None, parts: int, index: int) -> Box:
    """Shard `index` of `parts` along `dim` (None: the whole tensor)."""
    box = [(0, n) for n in shape]
    if dim is not None:
        step = shape[dim] // parts
        box[dim] = (index * step, (index + 1) * step)
    return tuple(box)


def slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """`box` (full-tensor coordinates) inside a tensor that holds `origin`."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def check(layout: ParamLayout, src: Mesh, dst: Mesh, dst_placements: Placements | None) -> None:
    """Reject what m2n would reject (dtype, rank, placements, uneven shards, its fan-in
    and fan-out bounds), naming the parameter: a bad plan must fail at init, not hang
    the first reshard."""
    name, shape = layout.name, layout.shape
    if layout.dtype not in SUPPORTED_DTYPES:
        raise M2NPlanError(f"parameter {name!r} has dtype {layout.dtype}, which nccl_m2n does not move")
    if not 1 <= len(shape) <= MAX_TENSOR_DIMS:
        raise M2NPlanError(f"parameter {name!r} has rank {len(shape)}; nccl_m2n moves rank 1..{MAX_TENSOR_DIMS}")
    for side, mesh, placements in (("trainer", src, layout.placements), ("worker", dst, dst_placements)):
        if placements is None:
            continue
        sharded = [c for c in placements if c != REPLICATE]
        if len(placements) != 2 or len(sharded) != 1 or sharded[0] < 0:
            raise M2NPlanError(f"parameter {name!r}: {side} placements {placements} need exactly one "
                               f"sharded axis and one replicated axis")
        dim, parts, _ = _split(mesh, placements)
        assert dim is not None
        if dim >= len(shape) or shape[dim] % parts:
            raise M2NPlanError(f"parameter {name!r} of shape {list(shape)}: the {side} side shards "
                               f"dim {dim} over {parts} ranks, which does not divide it evenly")
    sources = _split(src, layout.placements)[1]
    targets = _split(dst, dst_placements)[1]
    if targets == 1 and sources > MAX_SOURCE_SHARDS:
        raise M2NPlanError(f"parameter {name!r}: {sources} trainer shards into one whole tensor, "
                           f"over m2n's {MAX_SOURCE_SHARDS} sources per destination")
    if sources == 1 and targets > MAX_DEST_SHARDS:
        raise M2NPlanError(f"parameter {name!r}: one trainer shard into {targets} worker shards, "
                           f"over m2n's {MAX_DEST_SHARDS}")


def pieces(layout: ParamLayout, src: Mesh, dst: Mesh, dst_placements: Placements | None) -> list[Piece]:
    """Every box of `layout` that a worker receives, with its sender: each worker gets
    its destination box exactly once, from the trainer ranks whose shards it overlaps;
    a box held by several ranks (replicated on the trainer's side) is sent by one of
    them, chosen round-robin by worker so the ranks share the sending."""
    check(layout, src, dst, dst_placements)
    sdim, sparts, saxis = _split(src, layout.placements)
    holders: dict[int, list[int]] = {}
    for rank in range(src.size):
        index = 0 if sdim is None else _shard_index(src, saxis, rank)
        holders.setdefault(index, []).append(rank)
    out = []
    for worker in range(dst.size):
        want = held_box(layout.shape, dst, dst_placements, dst.start + worker)
        for index, ranks in sorted(holders.items()):
            have = _intersect(want, box_of(layout.shape, sdim, sparts, index))
            if have is not None:
                out.append(Piece(layout.name, ranks[worker % len(ranks)], worker, have))
    return out


def plan(
    layouts: Sequence[ParamLayout], src: Mesh, dst: Mesh, destinations: Sequence[Placements | None]
) -> list[list[Piece]]:
    """`pieces` of every parameter, in the trainer's order (the order of the reshards)."""
    if len(destinations) != len(layouts):
        raise M2NPlanError(f"the workers published {len(destinations)} destinations for "
                           f"{len(layouts)} parameters")
    return [pieces(p, src, dst, d) for p, d in zip(layouts, destinations)]


def init_info(address: str, port: int, src: Mesh, tp: int, layouts: Sequence[ParamLayout]) -> dict[str, Any]:
    """vLLM's `M2NWeightTransferInitInfo` for a TP-`tp` replica's workers, as JSON."""
    return {
        "master_address": address,
        "master_port": port,
        "rank_offset": src.size,
        "world_size": src.size + tp,
        "src_mesh_dims": list(src.dims),
        "dst_mesh_dims": list(replica_mesh(src.size, tp).dims),
        "names": [p.name for p in layouts],
        "dtype_names": [p.dtype for p in layouts],
        "shapes": [list(p.shape) for p in layouts],
        "src_placements": [None if p.placements is None else list(p.placements) for p in layouts],
    }


# The destinations travel as one int8 row per parameter (vLLM's
# `publish_destination_placements`): both codes, or this for a whole tensor.
WHOLE = REPLICATE - 1


def encode_destinations(destinations: Sequence[Placements | None]) -> list[list[int]]:
    return [[WHOLE, WHOLE] if d is None else list(d) for d in destinations]


def decode_destinations(rows: Sequence[Sequence[int]]) -> list[Placements | None]:
    return [None if all(c == WHOLE for c in row) else (int(row[0]), int(row[1])) for row in rows]
