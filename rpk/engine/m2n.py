"""The `nccl_m2n` lane: weights from a sharded trainer into vLLM replicas without a full
gather on any rank (vLLM 0.32's `m2n_engine`), on the same lifecycle as the other lanes
of `rpk.engine.collective`.

vLLM's own trainer engine (`M2NTrainerWeightTransferEngine`) drives one replica's
control plane synchronously from trainer rank 0. Here rank 0's event loop drives it for
every replica at once, as for `gloo` and `nccl`, and the only differences from
`GroupLane` are the ones m2n's protocol makes:

- every trainer rank is in the group, not rank 0 alone. Rank 0's end is opened through
  the trainer (`ShardSenders`: `rpk.train.dist.DistTrainer` sends its followers a
  `JoinShards` and each joins with its own end), and while ends are open the trainer's
  `weight_buckets` yield each rank's local shards: rank 0's come here, the followers
  send theirs in step from their own processes;
- one group per replica (`rpk.engine.m2n_plan`: vLLM fixes a worker's rank offset to
  the number of trainer ranks), each of the trainer ranks plus the replica's TP workers;
- the init info is `M2NWeightTransferInitInfo` (both meshes and every parameter's
  name, dtype, shape and trainer placement), and at init the replica's first worker
  publishes where each parameter lands (`publish_destination_placements`); an update
  names its parameters only (`M2NWeightTransferUpdateInfo`).

A rank's end reshards each parameter into every replica's group in turn: on GPU with
`nccl.m2n.reshard` over vLLM's NCCL communicator (replicas started with vLLM's
`nccl_m2n` engine), on CPU with gloo standing in (`GlooLink`: the pieces
`m2n_plan.pieces` assigns this rank, sent point to point, into replicas started with
rpk's `gloo_m2n` engine, `rpk.engine.m2n_engine`, which receives them). The two differ
only in the backend's name and the communicator (`COMMUNICATORS`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Awaitable, Protocol, Sequence

import torch

from rpk.core.protocols import WeightBucket
from rpk.engine import m2n_plan as mp
from rpk.engine.collective import GroupLane, Receiving, free_port, open_trainer_end


# The m2n backends a replica can be started with, and the communicator of each.
COMMUNICATORS = {"nccl_m2n": "nccl", "gloo_m2n": "gloo"}
# The gathers of `run.verify_sync`'s whole-weight digests go a bucket of this at a time.
VERIFY_BUCKET_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class ShardGroup:
    """One replica's group: the trainer's ranks (rank 0 hosts the rendezvous at
    `address:port`), then the replica's `tp` workers."""

    address: str
    port: int
    tp: int


class ShardEnd(Protocol):
    """One trainer rank's ends of every replica's group."""

    def reshard(self, bucket: WeightBucket) -> None: ...

    def close(self) -> None: ...


class ShardSenders(Protocol):
    """Every trainer rank, driven from rank 0 (`TrainerShards` over a `DistTrainer`)."""

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]: ...

    async def open_shards(self, backend: str, groups: Sequence[ShardGroup]) -> ShardEnd: ...

    async def close_shards(self) -> None: ...

    async def digests(self) -> dict[str, str]: ...


class TrainerShards:
    """`ShardSenders` over the run's trainer (`rpk.loop.trainer.AsyncTrainer` over a
    `rpk.train.dist.DistTrainer`), each method run where the trainer's calls run.
    `trainer` is awaited at the first sync: the fleet starts while the trainer loads."""

    def __init__(self, trainer: Awaitable[Any]) -> None:
        self._trainer = asyncio.ensure_future(trainer)

    async def _call(self, method: str, *args: Any) -> Any:
        trainer = await self._trainer
        return await trainer.call(getattr(trainer.trainer, method), *args)

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]:
        return await self._call("shard_layout")

    async def open_shards(self, backend: str, groups: Sequence[ShardGroup]) -> ShardEnd:
        return await self._call("open_shards", backend, tuple(groups))

    async def close_shards(self) -> None:
        await self._call("close_shards")

    async def digests(self) -> dict[str, str]:
        """The whole weights' sha256 per HF name (`run.verify_sync`: a gather)."""
        return await self._call("weight_digests", VERIFY_BUCKET_BYTES)


class M2NLane(GroupLane):
    """Replicas fed by every trainer rank's shards; `backend`: theirs, `nccl_m2n` on GPU
    or `gloo_m2n` (gloo standing in for NCCL) on CPU. A `GroupLane` whose trainer's end
    is rank 0's `ShardEnd` and whose groups are one per replica."""

    def __init__(
        self, replicas: Sequence[Receiving], senders: ShardSenders, address: str, backend: str = "nccl_m2n"
    ) -> None:
        if backend not in COMMUNICATORS:
            raise ValueError(f"an m2n lane takes one of {sorted(COMMUNICATORS)}, not {backend!r}")
        super().__init__(backend, replicas, open_trainer_end, address)
        self._senders = senders
        self._comm_backend = COMMUNICATORS[backend]

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        mesh, layouts = await self._senders.shard_layout()
        groups = [ShardGroup(self._address, free_port(), r.settings.tensor_parallel_size)
                  for r in self.replicas]
        payloads = {id(r): mp.init_info(g.address, g.port, mesh, g.tp, layouts)
                    for r, g in zip(self.replicas, groups)}

        def init(r: Receiving) -> Awaitable[None]:
            return r.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payloads[id(r)]))

        await self._join(self._senders.open_shards(self._comm_backend, groups), init)

    async def send(self, bucket: WeightBucket) -> None:
        # The workers reshard inside update_weights; every trainer rank sends meanwhile.
        await self._update_while({"names": [name for name, _ in bucket]}, lambda end: end.reshard(bucket))

    async def close(self) -> None:
        await super().close()
        await self._senders.close_shards()


# -- one trainer rank's end -------------------------------------------------------------


class GlooLink:
    """One replica's group over gloo, trainer side: this rank sends the pieces the plan
    gives it, point to point to each worker, tagged with the parameter's index."""

    def __init__(self, group: Any, rank: int, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
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
        from rpk.engine.gloo_engine import close_group

        close_group(self._group)


class NcclLink:
    """One replica's group over vLLM's NCCL communicator: `nccl.m2n.reshard` of this
    rank's shard, as vLLM's `M2NTrainerWeightTransferEngine._send` issues it."""

    def __init__(self, comm: Any, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
                 destinations: Sequence[mp.Placements | None], tp: int) -> None:
        from vllm.distributed.weight_transfer.m2n_common import import_m2n

        self._m2n = import_m2n()
        self._comm = comm
        self._src = src
        self._layouts = list(layouts)
        self._dst = mp.replica_mesh(src.size, tp)
        self._destinations = list(destinations)
        mp.plan(layouts, src, self._dst, destinations)  # m2n's checks, naming the parameter
        self._handle = self._m2n.Handle.create(self._m2n.Config(max_cta=None))

    def send(self, index: int, local: torch.Tensor) -> None:
        from vllm.distributed.weight_transfer.m2n_common import (
            M2NMesh,
            comm_ptr,
            resolve_layout,
            to_mesh,
            to_placements,
        )

        m2n, layout = self._m2n, self._layouts[index]
        src_mesh, src_placements = resolve_layout(M2NMesh(self._src.dims, 0), layout.placements)
        dst_mesh, dst_placements = resolve_layout(M2NMesh(self._dst.dims, self._dst.start),
                                                  self._destinations[index])
        stream = torch.cuda.current_stream()
        shard = local.detach().contiguous()
        m2n.reshard(shard, None, comm_ptr(self._comm), stream,
                    src_mesh=to_mesh(m2n, src_mesh), src_placements=to_placements(m2n, src_placements),
                    dst_mesh=to_mesh(m2n, dst_mesh), dst_placements=to_placements(m2n, dst_placements),
                    handle=self._handle)
        shard.record_stream(stream)
        stream.synchronize()

    def close(self) -> None:
        torch.cuda.synchronize()
        self._handle.destroy()
        self._comm.destroy()


class Ends:
    """A trainer rank's `ShardEnd`: each parameter of a bucket resharded into every
    replica's group in turn, in the order the trainer announced them."""

    def __init__(self, layouts: Sequence[mp.ParamLayout], links: Sequence[GlooLink | NcclLink]) -> None:
        self._order = {p.name: i for i, p in enumerate(layouts)}
        self._links = list(links)

    def reshard(self, bucket: WeightBucket) -> None:
        for name, local in bucket:
            index = self._order.get(name)
            if index is None:
                raise RuntimeError(f"nccl_m2n: {name!r} was not announced at init")
            for link in self._links:
                link.send(index, local)

    def close(self) -> None:
        links, self._links = self._links, []  # once: the lane and the trainer both may
        for link in links:
            link.close()


def open_ends(
    backend: str, rank: int, src: mp.Mesh, layouts: Sequence[mp.ParamLayout],
    groups: Sequence[ShardGroup], timeout_s: float = 300.0,
) -> Ends:
    """This trainer rank joins every replica's group, in order (blocking; each forms
    once all its members join), and takes the destinations its first worker publishes."""
    links: list[GlooLink | NcclLink] = []
    try:
        for g in groups:
            world = src.size + g.tp
            if backend == "gloo":
                from rpk.engine.gloo_engine import open_group

                group = open_group(g.address, g.port, rank, world, timeout_s=timeout_s)
                rows = torch.zeros(len(layouts), 2, dtype=torch.int64)
                group.broadcast(rows, root=src.size).wait()
                links.append(GlooLink(group, rank, src, layouts, mp.decode_destinations(rows.tolist()), g.tp))
            elif backend == "nccl":
                from vllm.distributed.weight_transfer.m2n_common import publish_destination_placements
                from vllm.distributed.weight_transfer.nccl_common import trainer_init

                comm = trainer_init({"master_address": g.address, "master_port": g.port,
                                     "world_size": world}, rank=rank)
                destinations = publish_destination_placements(comm, src.size, None, len(layouts))
                links.append(NcclLink(comm, src, layouts, destinations, g.tp))
            else:
                raise ValueError(f"nccl_m2n runs over nccl or gloo, not {backend!r}")
    except BaseException:
        for link in links:
            link.close()
        raise
    return Ends(layouts, links)
