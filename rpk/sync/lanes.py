"""The lanes of a weight sync: the replicas of one backend, fed each bucket as it comes
through vLLM's weight-transfer engines (`rpk.sync.transport.CollectiveTransport` runs
the lifecycle around them).

- a group lane (`gloo`, `nccl`): one process group, the trainer at rank 0 and every
  worker of every replica after it; each tensor of a bucket is broadcast once and
  reaches them all;
- an IPC lane (`ipc`, replicas with a worker on the trainer's own GPU): CUDA IPC
  handles of each bucket's tensors, one per GPU of those replicas, opened in place;
  NCCL refuses two ranks on one device, so such a replica never joins a group;
- a shared-memory lane (`cpu_ipc`, CPU replicas on the trainer's machine): the same
  protocol with handles into /dev/shm, to the trainer's parameters where they live
  there, else to staging files (`rpk.sync.cpu_ipc`);
- an m2n lane (`rpk.sync.m2n_lane`), which joins its groups as a group lane does
  (`ReplicaGroup`, held rather than inherited).

A group belongs to exactly the replicas it was formed with (held, not remembered by
`id`): a sync to any other set tears it down on both sides and forms one for the new
set, sized from their TP.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import pickle
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch.distributed import ProcessGroup

from rpk.core.protocols import WeightBucket
from rpk.sync.backends import BACKENDS, Backend, Wire
from rpk.sync.cpu_ipc import Staging
from rpk.sync.gloo import broadcast, close_group, engine_payload, open_group, update_info
from rpk.sync.protocols import Receiving


class WeightSyncError(RuntimeError):
    """A replica failed during a weight sync; it is named, and no replica serves the
    new version."""


class Closing(Protocol):
    def close(self) -> None: ...


class Communicator(Protocol):
    """The trainer's end of a group: rank 0 of a broadcast."""

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


# (backend, address, port, world size) -> the trainer's end, once every rank has joined.
OpenTrainer = Callable[[Backend, str, int, int], Communicator]
End = TypeVar("End", bound=Closing)


async def _named(replica: Receiving, what: str, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as e:
        raise WeightSyncError(
            f"weight sync: replica {replica.name} failed in {what}: {type(e).__name__}: {e}"
        ) from e


async def each(replicas: Sequence[Receiving], what: str, call: Callable[[Receiving], Awaitable[Any]]) -> None:
    """`call` on every replica at once; the first failure is raised, naming its replica."""
    tasks = [asyncio.ensure_future(_named(r, what, call(r))) for r in replicas]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class ReplicaGroup(Generic[End]):
    """Replicas whose workers meet the trainer's `End` inside collectives: they join
    while it opens, and receive each update while it sends."""

    def __init__(self, backend: Backend, replicas: Sequence[Receiving]) -> None:
        self.backend = backend
        self.replicas = list(replicas)
        self._end: End | None = None

    async def join(self, trainer_end: Awaitable[End], init: Callable[[Receiving], Awaitable[None]]) -> None:
        """Every replica's workers join while the trainer's end opens (the rendezvous needs
        both sides at once)."""
        trainer = asyncio.ensure_future(trainer_end)
        try:
            await each(self.replicas, f"joining the {self.backend} group", init)
        except BaseException:
            # The trainer's rendezvous times out on its own; its end is closed if it forms.
            trainer.add_done_callback(_close_formed)
            raise
        self._end = await trainer

    async def update_while(self, info: dict[str, Any], send: Callable[[End], None]) -> None:
        """Every replica's `update_weights(info)` while `send(trainer's end)` runs on a
        thread: the workers' receive and the trainer's send meet inside the collective."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        end = self._end
        if end is None:
            raise RuntimeError(f"the {self.backend} lane of {[r.name for r in self.replicas]} "
                               "sends before it opened")
        request = WeightTransferUpdateRequest(update_info=info)
        sending = asyncio.ensure_future(asyncio.to_thread(send, end))
        try:
            await each(self.replicas, "update_weights", lambda r: r.llm.update_weights(request))
        except BaseException:
            # A replica is gone: end the group so the send errors instead of waiting.
            self.drop()
            sending.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        await sending

    def drop(self) -> None:
        """The trainer's end closed: a worker still inside a collective errors out."""
        if self._end is not None:
            self._end.close()
            self._end = None

    async def close(self) -> None:
        """Both sides of the group ended (the replicas that are still up)."""
        self.drop()
        await asyncio.gather(
            *(r.llm.shutdown_weight_transfer_engine() for r in self.replicas),
            return_exceptions=True,
        )


class OverGroup:
    """A lane's side that its `ReplicaGroup` (`self._group`) does: the replicas, and ending."""

    _group: ReplicaGroup[Any]

    @property
    def replicas(self) -> list[Receiving]:
        return self._group.replicas

    def end_sync(self) -> None:
        pass

    def drop(self) -> None:
        self._group.drop()

    async def close(self) -> None:
        await self._group.close()


class GroupLane(OverGroup):
    """Replicas in one process group with the trainer (`gloo` or `nccl`)."""

    def __init__(
        self, backend: Backend, replicas: Sequence[Receiving], open_trainer: OpenTrainer, address: str
    ) -> None:
        self._group: ReplicaGroup[Communicator] = ReplicaGroup(backend, replicas)
        self._open_trainer = open_trainer
        self._address = address

    @property
    def world_size(self) -> int:
        return 1 + sum(r.settings.tensor_parallel_size for r in self.replicas)

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        port, world = free_port(), self.world_size
        offsets = _offsets(self.replicas)

        def init(r: Receiving) -> Awaitable[None]:
            payload = engine_payload(self._address, port, offsets[id(r)], world)
            return r.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payload))

        backend = self._group.backend
        await self._group.join(asyncio.to_thread(self._open_trainer, backend, self._address, port, world), init)

    async def send(self, bucket: WeightBucket) -> None:
        tensors = [t for _, t in bucket]
        await self._group.update_while(dataclasses.asdict(update_info(bucket)),
                                       lambda comm: comm.broadcast(tensors))



@dataclasses.dataclass(frozen=True, slots=True)
class CudaIpc:
    """What the IPC lane needs of CUDA, numbered as the trainer's process sees the GPUs:
    `share`, `reduce_tensor`'s arguments for a tensor; `uuid`, a GPU's UUID; `put`, a
    tensor's copy on a GPU (itself where it lies there)."""

    share: Callable[[torch.Tensor], tuple[Any, ...]]
    uuid: Callable[[int], str]
    put: Callable[[torch.Tensor, int], torch.Tensor]
    device: int  # the trainer's own GPU: a replica without `devices` sits there


async def _open_handles(replicas: Sequence[Receiving]) -> None:
    """An IPC engine's init: one handle per tensor (unpacked), no rendezvous."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    request = WeightTransferInitRequest(init_info={"packed": False})
    await each(replicas, "init_weight_transfer_engine", lambda r: r.llm.init_weight_transfer_engine(request))


async def _update(replicas: Sequence[Receiving], info: dict[str, Any]) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    request = WeightTransferUpdateRequest(update_info=info)
    await each(replicas, "update_weights", lambda r: r.llm.update_weights(request))


class IpcLane:
    """Replicas with a worker on the trainer's GPU: each bucket's tensors handed over as
    CUDA IPC handles, one per GPU any of the replicas' workers runs on (vLLM's IPC
    engine opens the handle of its worker's own GPU UUID): the trainer's copy on its own
    GPU, a device-to-device copy on each other one. Held only until every replica's
    `update_weights` returned for that bucket: the workers have loaded them by then, and
    holding a whole sync's buckets would put the whole model on the GPUs once more."""

    backend = Backend.IPC

    def __init__(self, replicas: Sequence[Receiving], cuda: CudaIpc) -> None:
        self.replicas = list(replicas)
        self._cuda = cuda
        self.devices = sorted({d for r in self.replicas for d in (r.settings.devices or (cuda.device,))})

    async def open(self) -> None:
        await _open_handles(self.replicas)

    async def send(self, bucket: WeightBucket) -> None:
        tensors = [t.detach().contiguous() for _, t in bucket]
        handles = [{self._cuda.uuid(d): self._cuda.share(self._cuda.put(t, d)) for d in self.devices}
                   for t in tensors]
        info = {
            **dataclasses.asdict(update_info(bucket)),
            # pickled: the handles hold objects msgpack does not carry
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
        }
        del tensors, handles
        await _update(self.replicas, info)
        if torch.cuda.is_available():
            # Blocks freed here while a worker still had them open are parked by torch's
            # IPC ref-counting; the workers have closed them now.
            torch.cuda.ipc_collect()

    def end_sync(self) -> None:
        pass

    def drop(self) -> None:
        pass

    async def close(self) -> None:
        pass


class HostIpcLane:
    """CPU replicas on the trainer's machine (`cpu_ipc`, `rpk.sync.cpu_ipc`): the workers
    handed `{"shm": [path, offset]}` handles in vLLM's IPC update info, to each tensor
    in the trainer's shared parameters or in its bucket's staging file."""

    backend = Backend.CPU_IPC

    def __init__(self, replicas: Sequence[Receiving], staging: Staging) -> None:
        self.replicas = list(replicas)
        self._staging = staging  # the transport's: kept across lanes (layouts), mapped once
        self._index = 0

    async def open(self) -> None:
        await _open_handles(self.replicas)

    async def send(self, bucket: WeightBucket) -> None:
        handles = await asyncio.to_thread(self._staging.put, self._index, [t for _, t in bucket])
        self._index += 1
        await _update(self.replicas, {**dataclasses.asdict(update_info(bucket)), "ipc_handles": handles})

    def end_sync(self) -> None:
        self._index = 0  # the next sync writes the staging files from the first again

    def drop(self) -> None:
        self._index = 0

    async def close(self) -> None:
        self.drop()


class Lane(Protocol):
    """The replicas of one backend in a sync (`GroupLane`, `IpcLane`, `HostIpcLane`,
    `rpk.sync.m2n_lane.M2NLane`)."""

    @property
    def replicas(self) -> list[Receiving]: ...

    async def open(self) -> None: ...

    async def send(self, bucket: WeightBucket) -> None: ...

    def end_sync(self) -> None: ...

    def drop(self) -> None: ...

    async def close(self) -> None: ...


def _close_formed(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _offsets(replicas: Sequence[Receiving]) -> dict[int, int]:
    """Each replica's first worker rank: the trainer is 0, then each replica's TP ranks."""
    offsets, offset = {}, 1
    for r in replicas:
        offsets[id(r)] = offset
        offset += r.settings.tensor_parallel_size
    return offsets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooEnd:
    def __init__(self, group: ProcessGroup) -> None:
        self._group = group

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        broadcast(self._group, tensors)

    def close(self) -> None:
        close_group(self._group)


class _NcclEnd:
    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        stream = torch.cuda.current_stream()
        for t in tensors:
            self._comm.broadcast(t if t.is_contiguous() else t.contiguous(), src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        self._comm.destroy()


def open_trainer_end(backend: Backend, address: str, port: int, world_size: int) -> Communicator:
    """Rank 0 of a new group over the backend's wire: gloo (`rpk.sync.gloo`) or vLLM's NCCL."""
    wire = BACKENDS[backend].wire
    if wire is Wire.GLOO:
        return GlooEnd(open_group(address, port, 0, world_size))
    if wire is not Wire.NCCL:
        raise ValueError(f"weight transfer {backend} forms no group with the trainer")
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return _NcclEnd(trainer_init({"master_address": address, "master_port": port,
                                  "world_size": world_size}))


def cuda_ipc() -> CudaIpc:
    from torch.multiprocessing.reductions import reduce_tensor

    def put(t: torch.Tensor, device: int) -> torch.Tensor:
        return t if t.device.index == device else t.to(f"cuda:{device}")

    return CudaIpc(share=lambda t: reduce_tensor(t)[1],
                   uuid=lambda d: str(torch.cuda.get_device_properties(d).uuid),
                   put=put, device=torch.cuda.current_device())
