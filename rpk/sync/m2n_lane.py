"""The `nccl_m2n` lane: weights from a sharded trainer into vLLM replicas without a full
gather on any rank (vLLM 0.32's `m2n_engine`), on the same lifecycle as the other lanes
of `rpk.sync.lanes`.

vLLM's own trainer engine (`M2NTrainerWeightTransferEngine`) drives one replica's
control plane synchronously from trainer rank 0. Here rank 0's event loop drives it for
every replica at once, as for `gloo` and `nccl`, and the only differences from
a group lane are the ones m2n's protocol makes (it joins its groups through the same
`rpk.sync.lanes.ReplicaGroup`):

- every trainer rank is in the group, not rank 0 alone. Rank 0's end is opened through
  the trainer (`ShardSenders`: `rpk.train.dist.DistTrainer` sends its followers a
  `JoinShards` and each joins with its own end), and while ends are open the trainer's
  `weight_buckets` yield each rank's local shards: rank 0's come here, the followers
  send theirs in step from their own processes;
- one group per replica (`rpk.sync.m2n_plan`: vLLM fixes a worker's rank offset to
  the number of trainer ranks), each of the trainer ranks plus the replica's TP workers;
- the init info is `M2NWeightTransferInitInfo` (both meshes and every parameter's
  name, dtype, shape and trainer placement), and at init the replica's first worker
  publishes where each parameter lands (`publish_destination_placements`); an update
  names its parameters only (`M2NWeightTransferUpdateInfo`).

Every rank's own end is `rpk.sync.m2n_send` (the trainer's side, which `rpk.train`
imports); this module is rank 0's lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from rpk.core.protocols import WeightBucket
from rpk.sync import m2n_plan as mp
from rpk.sync.backends import BACKENDS, Backend, TrainerEnd, Wire
from rpk.sync.lanes import OverGroup, ReplicaGroup, free_port
from rpk.sync.m2n_send import ShardBucket, ShardGroup
from rpk.sync.protocols import Receiving

# The gathers of `run.verify_sync`'s whole-weight digests go a bucket of this at a time.
VERIFY_BUCKET_BYTES = 256 * 2**20
T = TypeVar("T")


class ShardEnd(Protocol):
    """One trainer rank's ends of every replica's group (`rpk.sync.m2n_send.Ends`)."""

    def reshard(self, bucket: WeightBucket) -> None: ...

    def close(self) -> None: ...


class ShardSenders(Protocol):
    """Every trainer rank, driven from rank 0 (`TrainerShards` over a `DistTrainer`)."""

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]: ...

    async def open_shards(self, wire: Wire, groups: Sequence[ShardGroup]) -> ShardEnd: ...

    async def close_shards(self) -> None: ...

    async def digests(self) -> dict[str, str]: ...


class ShardingTrainer(Protocol):
    """What m2n asks of the sharded trainer (`rpk.train.dist.DistTrainer`), blocking."""

    def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]: ...

    def open_shards(self, wire: Wire, groups: Sequence[ShardGroup]) -> ShardEnd: ...

    def close_shards(self) -> None: ...

    def weight_digests(self, max_bytes: int) -> dict[str, str]: ...


class TrainerCalls(Protocol):
    """Where the trainer's calls run (`rpk.loop.trainer.AsyncTrainer`), over a sharded
    trainer: the assembly hands `TrainerShards` one only for a backend that
    `sends_shards`, whose trainer is a `DistTrainer` (`rpk.assembly.parts`)."""

    trainer: ShardingTrainer

    async def call(self, fn: Callable[..., T], *args: Any) -> T: ...


class TrainerShards:
    """`ShardSenders` over the run's trainer (an `AsyncTrainer` over a `DistTrainer`),
    each method run where the trainer's calls run. `trainer` is awaited at the first
    sync: the fleet starts while the trainer loads."""

    def __init__(self, trainer: Awaitable[TrainerCalls]) -> None:
        self._trainer = asyncio.ensure_future(trainer)

    async def _run(self, work: Callable[[ShardingTrainer], T]) -> T:
        calls = await self._trainer
        return await calls.call(work, calls.trainer)

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]:
        return await self._run(lambda t: t.shard_layout())

    async def open_shards(self, wire: Wire, groups: Sequence[ShardGroup]) -> ShardEnd:
        return await self._run(lambda t: t.open_shards(wire, tuple(groups)))

    async def close_shards(self) -> None:
        await self._run(lambda t: t.close_shards())

    async def digests(self) -> dict[str, str]:
        """The whole weights' sha256 per HF name (`run.verify_sync`: a gather)."""
        return await self._run(lambda t: t.weight_digests(VERIFY_BUCKET_BYTES))


class M2NLane(OverGroup):
    """Replicas fed by every trainer rank's shards; `backend`: theirs, `nccl_m2n` on GPU
    or `gloo_m2n` (gloo standing in for NCCL) on CPU. Its groups, one per replica, hold
    rank 0's `ShardEnd` as the trainer's end."""

    def __init__(
        self, replicas: Sequence[Receiving], senders: ShardSenders, address: str,
        backend: Backend = Backend.NCCL_M2N,
    ) -> None:
        spec = BACKENDS[backend]
        if spec.trainer_end is not TrainerEnd.SHARDS or spec.wire is None:
            shards = [b.value for b, s in BACKENDS.items() if s.trainer_end is TrainerEnd.SHARDS]
            raise ValueError(f"an m2n lane takes one of {sorted(shards)}, not {backend.value!r}")
        self._group: ReplicaGroup[ShardEnd] = ReplicaGroup(backend, replicas)
        self._senders = senders
        self._address = address
        self._wire = spec.wire

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        mesh, layouts = await self._senders.shard_layout()
        groups = [ShardGroup(self._address, free_port(), r.settings.tensor_parallel_size)
                  for r in self.replicas]
        payloads = {id(r): mp.init_info(g.address, g.port, mesh, g.tp, layouts)
                    for r, g in zip(self.replicas, groups)}

        def init(r: Receiving) -> Awaitable[None]:
            return r.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payloads[id(r)]))

        await self._group.join(self._senders.open_shards(self._wire, groups), init)

    async def send(self, bucket: WeightBucket) -> None:
        if not isinstance(bucket, ShardBucket):
            names = [name for name, _ in bucket][:3]
            raise TypeError(f"the {self._group.backend} lane sends this rank's shards, but got whole "
                            f"tensors ({names}...): the trainer's m2n groups are not open")
        # The workers reshard inside update_weights; every trainer rank sends meanwhile.
        await self._group.update_while({"names": [name for name, _ in bucket]},
                                       lambda end: end.reshard(bucket))

    async def close(self) -> None:
        await super().close()
        await self._senders.close_shards()
