"""Weights into vLLM replicas through vLLM's own CUDA weight-transfer engines, driven
from rpk's event loop. Not run yet: rpk's CI machine has no GPU (and no CUDA vLLM);
`bench/weight_transfer.py` is the check to run on one.

Both follow vLLM's update lifecycle on every replica: `start_weight_update`, one
`update_weights` per bucket, `finish_weight_update` (the worker finalises its layerwise
reload there); then rpk resets the prefix cache and records the version.

- `IpcTransport` (trainer and replicas on the same GPU): each bucket's tensors are
  shared as CUDA IPC handles, which the replica's workers open in place. No copy
  through the host; the tensors stay referenced until the update is finished.
- `NcclTransport` (replicas on other GPUs): one NCCL group per set of replicas (a
  layout), the trainer as rank 0 and every worker of every replica after it; each
  tensor is broadcast once and reaches all of them. The group is formed at the first
  update of those replicas (a rendezvous on a free local port).

The replicas must have been started with `VLLMSettings.weight_transfer` set to the same
backend name.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import socket
import time
from typing import Any, AsyncIterable, Protocol, Sequence

import torch

from rpk.core.protocols import WeightBucket


class Receiving(Protocol):
    """A replica these transports update (`VLLMEngine`): its `AsyncLLM`, its settings,
    and what it does once weights are in."""

    @property
    def llm(self) -> Any: ...

    @property
    def settings(self) -> Any: ...

    async def weights_loaded(self, version: int, started: float) -> None: ...


def _metadata(bucket: WeightBucket) -> dict[str, Any]:
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).split(".")[-1] for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


async def _each(replicas: Sequence[Receiving], method: str, *args: Any) -> None:
    await asyncio.gather(*(getattr(r.llm, method)(*args) for r in replicas))


async def _finish(replicas: Sequence[Receiving], version: int, started: float) -> None:
    await _each(replicas, "finish_weight_update", str(version))
    await asyncio.gather(*(r.weights_loaded(version, started) for r in replicas))


class IpcTransport:
    def __init__(self) -> None:
        self._ready: set[int] = set()  # replicas whose transfer engine is initialised

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Receiving], version: int
    ) -> None:
        from torch.multiprocessing.reductions import reduce_tensor
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest, WeightTransferUpdateRequest,
        )

        started = time.perf_counter()
        new = [r for r in replicas if id(r) not in self._ready]
        await asyncio.gather(*(
            r.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": False}))
            for r in new
        ))
        self._ready.update(id(r) for r in new)
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        await _each(replicas, "start_weight_update")
        alive: list[torch.Tensor] = []  # IPC views must outlive the update
        async for bucket in buckets:
            tensors = [t.detach().contiguous() for _, t in bucket]
            alive += tensors
            torch.cuda.current_stream().synchronize()
            handles = [{uuid: reduce_tensor(t)[1]} for t in tensors]
            info = {**_metadata(bucket),
                    # pickled: the handles hold objects msgpack does not carry
                    "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
            await _each(replicas, "update_weights", WeightTransferUpdateRequest(update_info=info))
        await _finish(replicas, version, started)
        del alive
        torch.cuda.ipc_collect()


class NcclTransport:
    def __init__(self, master_address: str = "127.0.0.1") -> None:
        self.master_address = master_address
        self._groups: dict[tuple[int, ...], Any] = {}  # replicas (by id) -> communicator

    async def _group(self, replicas: Sequence[Receiving]) -> Any:
        key = tuple(id(r) for r in replicas)
        if key in self._groups:
            return self._groups[key]
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo, trainer_init, worker_init_payload,
        )

        port = _free_port()
        world = 1 + sum(r.settings.tensor_parallel_size for r in replicas)
        inits = []
        offset = 1
        for r in replicas:
            info = NCCLWeightTransferInitInfo(
                master_address=self.master_address, master_port=port,
                rank_offset=offset, world_size=world,
            )
            inits.append(r.llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=worker_init_payload(info))
            ))
            offset += r.settings.tensor_parallel_size
        rendezvous = {"master_address": self.master_address, "master_port": port, "world_size": world}
        comm, *_ = await asyncio.gather(asyncio.to_thread(trainer_init, rendezvous), *inits)
        self._groups[key] = comm
        return comm

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Receiving], version: int
    ) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        started = time.perf_counter()
        comm = await self._group(replicas)
        await _each(replicas, "start_weight_update")
        async for bucket in buckets:
            request = WeightTransferUpdateRequest(update_info=_metadata(bucket))
            # The workers' receive and the trainer's broadcast meet inside NCCL: both
            # must be under way at once.
            await asyncio.gather(
                _each(replicas, "update_weights", request),
                asyncio.to_thread(_broadcast, comm, [t for _, t in bucket]),
            )
        await _finish(replicas, version, started)


def _broadcast(comm: Any, tensors: list[torch.Tensor]) -> None:
    torch.cuda.synchronize()  # the trainer's side stream has finished the update
    stream = torch.cuda.current_stream()
    for t in tensors:
        comm.broadcast(t.detach().contiguous(), src=0, stream=stream)
    stream.synchronize()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
