"""The fleet's `WeightTransport`s and the one place that makes them (`make_transport`).

`CollectiveTransport` drives vLLM's weight-transfer engines from rpk's event loop: rpk's
`gloo` and `cpu_ipc` (`rpk.sync.worker`), and on GPU vLLM's `nccl` and `ipc`, one code
path for all; only the lane differs (`rpk.sync.lanes`). Every sync follows vLLM's
lifecycle on every replica: `start_weight_update`, one `update_weights` per bucket
(every lane gets each bucket as it comes; the buckets are read once),
`finish_weight_update`; only then does a replica's `weight_version` change
(`weights_loaded`), so a sync that fails part-way never serves as a new version.

The replicas of one sync are split into lanes by the backend each was started with
(`VLLMSettings.backend`, chosen per replica by `rpk.sync.backends.for_replica`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import Any

import torch

from rpk.core.protocols import WeightBucket
from rpk.sync.adapter import AdapterTransport
from rpk.sync.backends import BACKENDS, Backend, TrainerEnd, check_verifiable, sends_shards
from rpk.sync.cpu_ipc import Staging
from rpk.sync.lanes import (
    CudaIpc,
    GroupLane,
    HostIpcLane,
    IpcLane,
    Lane,
    OpenTrainer,
    cuda_ipc,
    each,
    open_trainer_end,
)
from rpk.sync.m2n_lane import M2NLane, ShardSenders
from rpk.sync.protocols import Receiving, WeightTransport
from rpk.sync.spool import SpoolTransport
from rpk.sync.verify import VerifiedTransport, cast

# A backend's lane for these replicas, beside the built-in ones (`nccl_m2n`).
LaneMaker = Callable[[list[Receiving]], Lane]


class CollectiveTransport:
    """The `WeightTransport` over vLLM's weight-transfer engines."""

    def __init__(
        self,
        open_trainer: OpenTrainer | None = None,
        address: str = "127.0.0.1",
        ipc: CudaIpc | None = None,
        lanes: Mapping[Backend, LaneMaker] | None = None,
    ) -> None:
        self._open_trainer = open_trainer or open_trainer_end
        self._makers = dict(lanes or {})
        self._address = address
        self._ipc = ipc  # None: CUDA as the trainer's process sees it
        self._lanes: dict[Backend, Lane] = {}
        self._staging: Staging | None = None  # cpu_ipc's files in /dev/shm, made at its first sync

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Receiving], version: int
    ) -> None:
        started = time.perf_counter()
        lanes = await self._lanes_for(replicas)
        try:
            await each(replicas, "start_weight_update", lambda r: r.llm.start_weight_update())
            async for bucket in buckets:
                await asyncio.gather(*(lane.send(bucket) for lane in lanes))
            await each(replicas, "finish_weight_update",
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
        by_backend: dict[Backend, list[Receiving]] = {}
        for r in replicas:
            backend = r.settings.backend
            if BACKENDS[backend].engine is None:
                raise ValueError(f"replica {r.name} was started without a weight-transfer engine "
                                 f"(its weights come as {BACKENDS[backend].trainer_end.value})")
            by_backend.setdefault(backend, []).append(r)
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

    def _new_lane(self, backend: Backend, members: list[Receiving]) -> Lane:
        if backend in self._makers:
            return self._makers[backend](members)
        end = BACKENDS[backend].trainer_end
        if end is TrainerEnd.GROUP:
            return GroupLane(backend, members, self._open_trainer, self._address)
        if end is TrainerEnd.CUDA_IPC:
            return IpcLane(members, self._ipc or cuda_ipc())
        if end is TrainerEnd.HOST_IPC:
            if self._staging is None:
                self._staging = Staging()
            return HostIpcLane(members, self._staging)
        raise ValueError(f"no weight-transfer lane for backend {backend.value!r} "
                         f"(replicas {[r.name for r in members]})")

    async def close(self) -> None:
        lanes, self._lanes = list(self._lanes.values()), {}
        await asyncio.gather(*(lane.close() for lane in lanes), return_exceptions=True)
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _same(held: Sequence[Receiving], wanted: Sequence[Receiving]) -> bool:
    return len(held) == len(wanted) and all(a is b for a, b in zip(held, wanted))


class CastTransport:
    """Another transport, fed each bucket cast to the replicas' dtype: the trainer's
    float32 master copy would double the bytes sent and the workers' receive buffers,
    and vLLM casts on load anyway. A verified transport casts itself, before hashing
    (`VerifiedTransport`'s `dtype`), so `run.verify_sync` hashes what is sent."""

    def __init__(self, inner: WeightTransport, dtype: torch.dtype) -> None:
        self.inner = inner
        self.dtype = dtype

    async def push(self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Any], version: int) -> None:
        await self.inner.push(cast(buckets, self.dtype), replicas, version)

    async def close(self) -> None:
        await self.inner.close()


def rendezvous_address(env: Mapping[str, str] = os.environ) -> str:
    """Where trainer ranks reach rank 0 for an m2n group: node 0's address (torchrun's
    MASTER_ADDR) once the ranks span nodes (WORLD_SIZE beyond LOCAL_WORLD_SIZE), else
    loopback: a rank on another node would join its own localhost."""
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if world <= local:
        return "127.0.0.1"
    if not env.get("MASTER_ADDR"):
        raise ValueError(f"trainer ranks on more than one node (WORLD_SIZE={world}, "
                         f"LOCAL_WORLD_SIZE={local}) but no MASTER_ADDR to meet rank 0 at")
    return env["MASTER_ADDR"]


def make_transport(
    backend: Backend, verify: bool = False, shards: ShardSenders | None = None,
    env: Mapping[str, str] = os.environ, dtype: str | None = None,
    adapter: Mapping[str, Any] | None = None,
) -> WeightTransport:
    """`shards`: the trainer's ranks, for `nccl_m2n` / `gloo_m2n`
    (`rpk.sync.m2n_lane.TrainerShards`); `env`: the launch's, for their rendezvous;
    `dtype`: the replicas' (`VLLMSettings.dtype`), what whole-tensor buckets are cast to
    (m2n's shards keep the dtypes their layout announced at init); `adapter`: the
    adapter config of `Backend.ADAPTER`, a LoRA run's, whose syncs are adapter versions
    (`rpk.sync.adapter`)."""
    if BACKENDS[backend].trainer_end is TrainerEnd.ADAPTER:
        if adapter is None:
            raise ValueError("weight transfer adapter needs the LoRA adapter's config (adapter=)")
        lora = AdapterTransport(adapter)
        return VerifiedTransport(lora) if verify else lora
    if adapter is not None:
        raise ValueError(f"an adapter config with weight transfer {backend}: a LoRA run's path is adapter")
    if sends_shards(backend):
        if shards is None:
            raise ValueError(f"weight transfer {backend} needs the sharded trainer's ranks (shards=)")
        if verify:
            check_verifiable(backend)
        address = rendezvous_address(env)
        senders = shards
        m2n = CollectiveTransport(lanes={backend: lambda members: M2NLane(members, senders, address, backend)})
        # Verified, the trainer gathers once more to hash whole tensors: its buckets are shards.
        return VerifiedTransport(m2n, senders.digests) if verify else m2n
    transport: WeightTransport = (SpoolTransport() if BACKENDS[backend].trainer_end is TrainerEnd.FILES
                                  else CollectiveTransport())
    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"the replicas' dtype {dtype!r} is no torch dtype to cast the weights to")
    to = None if dtype is None else getattr(torch, dtype)
    if verify:
        return VerifiedTransport(transport, dtype=to)
    return transport if to is None else CastTransport(transport, to)
