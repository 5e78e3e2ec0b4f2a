"""One trainer rank's end of `nccl_m2n`: every rank sends its own shards into every
replica's group (`rpk.sync.m2n_lane` drives rank 0's from the event loop; the
followers' run in `rpk.train.dist`). The trainer's side of the m2n path: it imports
nothing of the workers' (`rpk.sync.worker`) nor of the fleet.

A rank's end reshards each parameter into every replica's group in turn: on GPU with
`nccl.m2n.reshard` over vLLM's NCCL communicator (`NcclLink`), on CPU with gloo
standing in (`GlooLink`: the pieces `m2n_plan.pieces` assigns this rank, sent point to
point, into replicas started with rpk's `gloo_m2n` engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from rpk.core.protocols import WeightBucket
from rpk.sync import m2n_plan as mp
from rpk.sync.backends import Wire
from rpk.sync.gloo import close_group, open_group


class ShardBucket(list[tuple[str, torch.Tensor]]):
    """A bucket of this rank's own shards of the weights, HF-named: not whole tensors,
    so an m2n lane takes it and nothing hashes it as the weights (`rpk.sync.verify`).
    Any other `WeightBucket` holds whole tensors."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardGroup:
    """One replica's group: the trainer's ranks (rank 0 hosts the rendezvous at
    `address:port`), then the replica's `tp` workers."""

    address: str
    port: int
    tp: int



class GlooLink:
    """One replica's group over gloo, trainer side: this rank sends the pieces the plan
    gives it, point to point to each worker, tagged with the parameter's index."""

    def __init__(self, group: ProcessGroup, rank: int, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
                 destinations: Sequence[mp.Placements | None], tp: int) -> None:
        self._group = group
        self._rank = rank
        self._src = src
        self._layouts = list(layouts)
        dst = mp.replica_mesh(src.size, tp)
        self._mine = [[p for p in ps if p.src == rank] for ps in mp.plan(layouts, src, dst, destinations)]

    def send(self, index: int, local: torch.Tensor) -> None:
        layout = self._layouts[index]
        origin = mp.held_box(layout.shape, self._src, layout.placements, self._rank)
        works = [self._group.send([local[mp.slices(p.box, origin)].contiguous()], self._src.size + p.dst, index)
                 for p in self._mine[index]]
        for w in works:
            w.wait()

    def close(self) -> None:
        close_group(self._group)


class NcclLink:
    """One replica's group over vLLM's NCCL communicator: `nccl.m2n.reshard` of this
    rank's shard, as vLLM's `M2NTrainerWeightTransferEngine._send` issues it. Each
    parameter's meshes and placements are resolved once, when the group forms; a send
    only enqueues (the bucket's end waits, `Ends.reshard`)."""

    def __init__(self, comm: Any, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
                 destinations: Sequence[mp.Placements | None], tp: int) -> None:
        from vllm.distributed.weight_transfer.m2n_common import (
            M2NMesh,
            import_m2n,
            resolve_layout,
            to_mesh,
            to_placements,
        )

        self._m2n = m2n = import_m2n()
        self._comm = comm
        dst = mp.replica_mesh(src.size, tp)
        mp.plan(layouts, src, dst, destinations)  # m2n's checks, naming the parameter
        self._resolved = []
        for layout, destination in zip(layouts, destinations):
            src_mesh, src_placements = resolve_layout(M2NMesh(src.dims, 0), layout.placements)
            dst_mesh, dst_placements = resolve_layout(M2NMesh(dst.dims, dst.start), destination)
            self._resolved.append(dict(
                src_mesh=to_mesh(m2n, src_mesh), src_placements=to_placements(m2n, src_placements),
                dst_mesh=to_mesh(m2n, dst_mesh), dst_placements=to_placements(m2n, dst_placements)))
        self._handle = m2n.Handle.create(m2n.Config(max_cta=None))

    def send(self, index: int, local: torch.Tensor) -> None:
        from vllm.distributed.weight_transfer.m2n_common import comm_ptr

        # Enqueued on the current stream, which the trainer's next use of the memory
        # follows: the caching allocator keeps a freed block for that stream alone.
        self._m2n.reshard(local.detach().contiguous(), None, comm_ptr(self._comm), torch.cuda.current_stream(),
                          handle=self._handle, **self._resolved[index])

    def close(self) -> None:
        torch.cuda.synchronize()
        self._handle.destroy()
        self._comm.destroy()


class Ends:
    """A trainer rank's `ShardEnd`: each parameter of a bucket resharded into every
    replica's group in turn, in the order the trainer announced them; `wait`, once the
    bucket's sends are issued (NCCL's are asynchronous: the bucket is done when it returns)."""

    def __init__(self, layouts: Sequence[mp.ParamLayout], links: Sequence[GlooLink | NcclLink],
                 wait: Callable[[], None] = lambda: None) -> None:
        self._order = {p.name: i for i, p in enumerate(layouts)}
        self._links = list(links)
        self._wait = wait

    def reshard(self, bucket: WeightBucket) -> None:
        for name, local in bucket:
            index = self._order.get(name)
            if index is None:
                raise RuntimeError(f"nccl_m2n: {name!r} was not announced at init")
            for link in self._links:
                link.send(index, local)
        self._wait()

    def close(self) -> None:
        links, self._links = self._links, []  # once: the lane and the trainer both may
        for link in links:
            link.close()


def open_ends(
    wire: Wire, rank: int, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
    groups: Sequence[ShardGroup], timeout_s: float = 300.0,
) -> Ends:
    """This trainer rank joins every replica's group, in order (blocking; each forms
    once all its members join), and takes the destinations its first worker publishes."""
    links: list[GlooLink | NcclLink] = []
    try:
        for g in groups:
            world = src.size + g.tp
            if wire is Wire.GLOO:
                group = open_group(g.address, g.port, rank, world, timeout_s=timeout_s)
                rows = torch.zeros(len(layouts), 2, dtype=torch.int64)
                group.broadcast(rows, root=src.size).wait()
                links.append(GlooLink(group, rank, src, layouts, mp.decode_destinations(rows.tolist()), g.tp))
            elif wire is Wire.NCCL:
                from vllm.distributed.weight_transfer.m2n_common import publish_destination_placements
                from vllm.distributed.weight_transfer.nccl_common import trainer_init

                comm = trainer_init({"master_address": g.address, "master_port": g.port,
                                     "world_size": world}, rank=rank)
                destinations = publish_destination_placements(comm, src.size, None, len(layouts))
                links.append(NcclLink(comm, src, layouts, destinations, g.tp))
            else:
                raise ValueError(f"nccl_m2n runs over nccl or gloo, not {wire!r}")
    except BaseException:
        for link in links:
            link.close()
        raise
    if wire is Wire.NCCL:
        return Ends(layouts, links, wait=lambda: torch.cuda.current_stream().synchronize())
    return Ends(layouts, links)
