"""Weights into vLLM replicas through vLLM's weight-transfer engines, driven from rpk's
event loop: rpk's `gloo` (`rpk.engine.gloo_engine`) and `cpu_ipc`
(`rpk.engine.shm_engine`), and on GPU vLLM's `nccl` and `ipc`. One code path for all of
them; only the communicator differs.

Every sync follows vLLM's lifecycle on every replica: `start_weight_update`, one
`update_weights` per bucket, `finish_weight_update`; only then does a replica's
`weight_version` change (`weights_loaded`), so a sync that fails part-way never
serves as a new version.

The replicas of one sync are split into lanes by the backend each was started with
(`VLLMSettings.weight_transfer`, chosen per replica by `vllm_fleet.place_backend`):
- a group lane (`gloo`, `nccl`): one process group, the trainer at rank 0 and every
  worker of every replica after it; each tensor of a bucket is broadcast once and
  reaches them all;
- an IPC lane (`ipc`, replicas with a worker on the trainer's own GPU): CUDA IPC
  handles of each bucket's tensors, one per GPU of those replicas, opened in place;
  NCCL refuses two ranks on one device, so such a replica never joins a group;
- a shared-memory lane (`cpu_ipc`, CPU replicas on the trainer's machine): the same
  protocol with handles into /dev/shm, to the trainer's parameters where they live
  there, else to staging files;
- an m2n lane (`nccl_m2n`, a sharded trainer's replicas on GPUs no trainer rank uses,
  `rpk.engine.m2n`): every trainer rank sends its own shards, no rank gathers.
Every lane gets each bucket as it comes; the buckets are read once.

A group belongs to exactly the replicas it was formed with (held, not remembered by
`id`): a sync to any other set (a regroup to another layout, a restarted replica)
tears it down on both sides and forms one for the new set, sized from their TP.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import pickle
import socket
import time
from typing import Any, AsyncIterable, Awaitable, Callable, Mapping, Protocol, Sequence

import torch

from rpk.core.protocols import WeightBucket

GROUP_BACKENDS = ("gloo", "nccl")


class WeightSyncError(RuntimeError):
    """A replica failed during a weight sync; it is named, and no replica serves the
    new version."""


class Receiving(Protocol):
    """A replica these lanes update (`VLLMEngine`)."""

    name: str

    @property
    def llm(self) -> Any: ...

    @property
    def settings(self) -> Any: ...  # .tensor_parallel_size, .weight_transfer

    async def weights_loaded(self, version: int, started: float) -> None: ...


class Communicator(Protocol):
    """The trainer's end of a group: rank 0 of a broadcast."""

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


# (backend, address, port, world size) -> the trainer's end, once every rank has joined.
OpenTrainer = Callable[[str, str, int, int], Communicator]


async def _named(replica: Receiving, what: str, call: Awaitable[Any]) -> Any:
    try:
        return await call
    except Exception as e:
        raise WeightSyncError(
            f"weight sync: replica {replica.name} failed in {what}: {type(e).__name__}: {e}"
        ) from e


async def _all(replicas: Sequence[Receiving], what: str, call: Callable[[Receiving], Awaitable[Any]]) -> None:
    """`call` on every replica at once; the first failure is raised, naming its replica."""
    tasks = [asyncio.ensure_future(_named(r, what, call(r))) for r in replicas]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class GroupLane:
    """Replicas in one process group with the trainer (`gloo` or `nccl`)."""

    def __init__(
        self, backend: str, replicas: Sequence[Receiving], open_trainer: OpenTrainer, address: str
    ) -> None:
        self.backend = backend
        self.replicas = list(replicas)
        self._open_trainer = open_trainer
        self._address = address
        self._comm: Any = None  # the trainer's end: a `Communicator`, or m2n's `ShardEnd`

    @property
    def world_size(self) -> int:
        return 1 + sum(r.settings.tensor_parallel_size for r in self.replicas)

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from rpk.engine.gloo_engine import engine_payload

        port, world = free_port(), self.world_size
        offsets = _offsets(self.replicas)

        def init(r: Receiving) -> Awaitable[None]:
            payload = engine_payload(self._address, port, offsets[id(r)], world)
            return r.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payload))

        await self._join(
            asyncio.to_thread(self._open_trainer, self.backend, self._address, port, world), init
        )

    async def _join(self, trainer_end: Awaitable[Any], init: Callable[[Receiving], Awaitable[None]]) -> None:
        """Every replica's workers join while the trainer's end opens (the rendezvous needs
        both sides at once)."""
        trainer = asyncio.ensure_future(trainer_end)
        try:
            await _all(self.replicas, f"joining the {self.backend} group", init)
        except BaseException:
            # The trainer's rendezvous times out on its own; its end is closed if it forms.
            trainer.add_done_callback(_close_formed)
            raise
        self._comm = await trainer

    async def send(self, bucket: WeightBucket) -> None:
        from rpk.engine.gloo_engine import update_info

        tensors = [t for _, t in bucket]
        await self._update_while(dataclasses.asdict(update_info(bucket)), lambda comm: comm.broadcast(tensors))

    async def _update_while(self, info: dict[str, Any], send: Callable[[Any], None]) -> None:
        """Every replica's `update_weights(info)` while `send(trainer's end)` runs on a
        thread: the workers' receive and the trainer's send meet inside the collective."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        assert self._comm is not None, "open the lane first"
        request = WeightTransferUpdateRequest(update_info=info)
        sending = asyncio.ensure_future(asyncio.to_thread(send, self._comm))
        try:
            await _all(self.replicas, "update_weights", lambda r: r.llm.update_weights(request))
        except BaseException:
            # A replica is gone: end the group so the broadcast errors instead of waiting.
            self.drop()
            sending.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        await sending

    def end_sync(self) -> None:
        pass

    def drop(self) -> None:
        """The trainer's end closed: a worker still inside a collective errors out."""
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    async def close(self) -> None:
        """Both sides of the group ended (the replicas that are still up)."""
        self.drop()
        await asyncio.gather(
            *(r.llm.shutdown_weight_transfer_engine() for r in self.replicas),
            return_exceptions=True,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class CudaIpc:
    """What the IPC lane needs of CUDA, numbered as the trainer's process sees the GPUs:
    `share`, `reduce_tensor`'s arguments for a tensor; `uuid`, a GPU's UUID; `put`, a
    tensor's copy on a GPU (itself where it lies there)."""

    share: Callable[[torch.Tensor], tuple[Any, ...]]
    uuid: Callable[[int], str]
    put: Callable[[torch.Tensor, int], torch.Tensor]
    device: int  # the trainer's own GPU: a replica without `devices` sits there


class IpcLane:
    """Replicas with a worker on the trainer's GPU: each bucket's tensors handed over as
    CUDA IPC handles, one per GPU any of the replicas' workers runs on (vLLM's IPC
    engine opens the handle of its worker's own GPU UUID): the trainer's copy on its own
    GPU, a device-to-device copy on each other one. Held only until every replica's
    `update_weights` returned for that bucket: the workers have loaded them by then, and
    holding a whole sync's buckets would put the whole model on the GPUs once more."""

    backend = "ipc"

    def __init__(self, replicas: Sequence[Receiving], cuda: CudaIpc) -> None:
        self.replicas = list(replicas)
        self._cuda = cuda
        self.devices = sorted({d for r in self.replicas for d in (r.settings.devices or (cuda.device,))})

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info={"packed": False})
        await _all(self.replicas, "init_weight_transfer_engine",
                   lambda r: r.llm.init_weight_transfer_engine(request))

    async def send(self, bucket: WeightBucket) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from rpk.engine.gloo_engine import update_info

        tensors = [t.detach().contiguous() for _, t in bucket]
        handles = [{self._cuda.uuid(d): self._cuda.share(self._cuda.put(t, d)) for d in self.devices}
                   for t in tensors]
        info = {
            **dataclasses.asdict(update_info(bucket)),
            # pickled: the handles hold objects msgpack does not carry
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
        }
        del tensors, handles
        request = WeightTransferUpdateRequest(update_info=info)
        await _all(self.replicas, "update_weights", lambda r: r.llm.update_weights(request))
        if torch.cuda.is_available():
            # Blocks freed here while a worker still had them open are parked by torch's
            # IPC ref-counting; the workers have closed them now.
            torch.cuda.ipc_collect()

    def end_sync(self) -> None:
        pass

    def drop(self) -> None:
        pass

    async def close(self) -> None:
        self.drop()


class ShmIpcLane:
    """CPU replicas on the trainer's machine (`cpu_ipc`, `rpk.engine.shm_engine`): the
    workers handed `{"shm": [path, offset]}` handles in vLLM's IPC update info, to each
    tensor in the trainer's shared parameters or in its bucket's staging file."""

    backend = "cpu_ipc"

    def __init__(self, replicas: Sequence[Receiving], staging: Any) -> None:
        self.replicas = list(replicas)
        self._staging = staging  # the transport's: kept across lanes (layouts), mapped once
        self._index = 0

    async def open(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info={"packed": False})
        await _all(self.replicas, "init_weight_transfer_engine",
                   lambda r: r.llm.init_weight_transfer_engine(request))

    async def send(self, bucket: WeightBucket) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from rpk.engine.gloo_engine import update_info

        handles = await asyncio.to_thread(self._staging.put, self._index, [t for _, t in bucket])
        self._index += 1
        info = {**dataclasses.asdict(update_info(bucket)), "ipc_handles": handles}
        request = WeightTransferUpdateRequest(update_info=info)
        await _all(self.replicas, "update_weights", lambda r: r.llm.update_weights(request))

    def end_sync(self) -> None:
        self._index = 0  # the next sync writes the staging files from the first again

    def drop(self) -> None:
        self._index = 0

    async def close(self) -> None:
        self.drop()


class Lane(Protocol):
    """The replicas of one backend in a sync (`GroupLane`, `IpcLane`, `ShmIpcLane`, and
    `rpk.engine.m2n.M2NLane` through `CollectiveTransport`'s `lanes`)."""

    replicas: list[Receiving]

    async def open(self) -> None: ...

    async def send(self, bucket: WeightBucket) -> None: ...

    def end_sync(self) -> None: ...

    def drop(self) -> None: ...

    async def close(self) -> None: ...


# A backend's lane for these replicas, beside the built-in ones (`nccl_m2n`).
LaneMaker = Callable[[list[Receiving]], Lane]


class CollectiveTransport:
    """The `WeightTransport` over vLLM's weight-transfer engines."""

    def __init__(
        self,
        open_trainer: OpenTrainer | None = None,
        address: str = "127.0.0.1",
        ipc: CudaIpc | None = None,
        lanes: Mapping[str, LaneMaker] | None = None,
    ) -> None:
        self._open_trainer = open_trainer or open_trainer_end
        self._makers = dict(lanes or {})
        self._address = address
        self._ipc = ipc  # None: CUDA as the trainer's process sees it
        self._lanes: dict[str, Lane] = {}
        self._staging: Any = None  # cpu_ipc's files in /dev/shm, made at its first sync

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Receiving], version: int
    ) -> None:
        started = time.perf_counter()
        lanes = await self._lanes_for(replicas)
        try:
            await _all(replicas, "start_weight_update", lambda r: r.llm.start_weight_update())
            async for bucket in buckets:
                await asyncio.gather(*(lane.send(bucket) for lane in lanes))
            await _all(replicas, "finish_weight_update",
                       lambda r: r.llm.finish_weight_update(str(version)))
        except BaseException:
            # Only this side: a replica may still be stuck in a receive, or dead.
            for lane in lanes:
                lane.drop()
            self._lanes.clear()
            raise
        finally:
            for lane in lanes:
                lane.end_sync()
        await asyncio.gather(*(r.weights_loaded(version, started) for r in replicas))

    async def _lanes_for(self, replicas: Sequence[Receiving]) -> list[Lane]:
        by_backend: dict[str, list[Receiving]] = {}
        for r in replicas:
            by_backend.setdefault(r.settings.weight_transfer, []).append(r)
        lanes = []
        for backend, members in by_backend.items():
            lane = self._lanes.get(backend)
            if lane is None or not _same(lane.replicas, members):
                if lane is not None:
                    await lane.close()
                lane = self._new_lane(backend, members)
                self._lanes.pop(backend, None)
                await lane.open()
                self._lanes[backend] = lane
            lanes.append(lane)
        return lanes

    def _new_lane(self, backend: str, members: list[Receiving]) -> Lane:
        if backend in self._makers:
            return self._makers[backend](members)
        if backend in GROUP_BACKENDS:
            return GroupLane(backend, members, self._open_trainer, self._address)
        if backend == "ipc":
            return IpcLane(members, self._ipc or _cuda_ipc())
        if backend == "cpu_ipc":
            if self._staging is None:
                from rpk.engine.shm_engine import Staging

                self._staging = Staging()
            return ShmIpcLane(members, self._staging)
        raise ValueError(f"no weight-transfer lane for backend {backend!r} "
                         f"(replicas {[r.name for r in members]})")

    async def close(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        await asyncio.gather(*(lane.close() for lane in lanes), return_exceptions=True)
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _close_formed(task: asyncio.Future[Communicator]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _same(held: Sequence[Receiving], wanted: Sequence[Receiving]) -> bool:
    return len(held) == len(wanted) and all(a is b for a, b in zip(held, wanted))


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


class _GlooEnd:
    def __init__(self, group: Any) -> None:
        self._group = group

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        from rpk.engine.gloo_engine import broadcast

        broadcast(self._group, tensors)

    def close(self) -> None:
        from rpk.engine.gloo_engine import close_group

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


def open_trainer_end(backend: str, address: str, port: int, world_size: int) -> Communicator:
    """Rank 0 of a new group: gloo (`rpk.engine.gloo_engine`) or vLLM's NCCL."""
    if backend == "gloo":
        from rpk.engine.gloo_engine import open_group

        return _GlooEnd(open_group(address, port, 0, world_size))
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return _NcclEnd(trainer_init({"master_address": address, "master_port": port,
                                  "world_size": world_size}))


def _cuda_ipc() -> CudaIpc:
    from torch.multiprocessing.reductions import reduce_tensor

    def put(t: torch.Tensor, device: int) -> torch.Tensor:
        return t if t.device.index == device else t.to(f"cuda:{device}")

    return CudaIpc(share=lambda t: reduce_tensor(t)[1],
                   uuid=lambda d: str(torch.cuda.get_device_properties(d).uuid),
                   put=put, device=torch.cuda.current_device())
