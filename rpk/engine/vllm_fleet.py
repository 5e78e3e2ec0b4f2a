"""The rollout fleet on vLLM: every layout's replicas started on their devices, the
ones not awake put to sleep, and the weight path the config names.

Replicas are started one after another from the event loop's thread (an `AsyncLLM`
made in a thread that then ends loses its engine core). A replica of TP t gets t times
`max_num_seqs` (it is per device) and t workers, each with the per-worker KV budget, so
a larger TP holds more KV per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from typing import Any, AsyncIterable, Callable, Literal, Mapping, Sequence

import torch

from rpk.engine.fleet import Fleet, Rest
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.engine.placement import FleetPlan, Platform, device_env
from rpk.engine.adapter import AdapterTransport
from rpk.engine.collective import CollectiveTransport
from rpk.engine.m2n import COMMUNICATORS, M2NLane, ShardSenders
from rpk.core.protocols import WeightBucket
from rpk.engine.replica import WeightTransport
from rpk.engine.transfer import SpoolTransport
from rpk.engine.verify import VerifiedTransport, cast
from rpk.engine.vllm_engine import VLLMEngine, VLLMSettings

Transfer = Literal["shm", "gloo", "cpu_ipc", "auto", "ipc", "nccl", "m2n", "nccl_m2n", "gloo_m2n"]
Switch = Literal["sleep", "restart"]


def transfer_backend(
    transfer: Transfer, plan: FleetPlan, platform: Platform, trainer_device: int,
    trainer_devices: Sequence[int] = (),
) -> str:
    """The fleet's weight path: `shm` (spool files, any device), rpk's `gloo` (any
    device) and `cpu_ipc` (CPU), vLLM's `ipc` / `nccl` (CUDA); `m2n`, a sharded
    trainer's ranks each sending their own shards: vLLM's `nccl_m2n` on CUDA, rpk's
    `gloo_m2n` on CPU (the same protocol over gloo). `auto`: `cpu_ipc` on CPU;
    on GPU `cuda`, each replica IPC or NCCL by where it sits (`place_backend`), or
    `nccl_m2n` for a sharded trainer (`trainer_devices`: its ranks' GPUs, more than one)
    whose fleet sits wholly on other GPUs: every rank then sends its own shards and none
    gathers. m2n puts every trainer rank and a replica's workers in one NCCL group, and
    NCCL refuses two ranks on one device; while m2n's groups are open the trainer hands
    out shards, so a fleet takes m2n whole or not at all."""
    fleet_devices = {d for places in plan.layouts().values() for p in places for d in p.devices}
    if platform == "cuda" and transfer in ("nccl", "m2n", "nccl_m2n"):
        # NCCL refuses two ranks on one device: the trainer's (all of them for m2n) and a worker's.
        joining = {trainer_device} if transfer == "nccl" else set(trainer_devices)
        if shared := sorted(fleet_devices & joining):
            raise ValueError(f"rollout.weight_transfer={transfer} with replicas on the trainer's "
                             f"GPUs {shared} (trainer {sorted(joining)}): NCCL refuses two ranks on "
                             "one GPU; take auto or ipc")
    if transfer == "m2n":
        return "gloo_m2n" if platform == "cpu" else "nccl_m2n"
    if transfer != "auto":
        return transfer
    if platform == "cpu":
        # cpu_ipc: 3.1 s a sync of a 0.5B model against 4.2 (gloo) and 5.5 (spool) on a
        # 2-core CPU, its transfer 0.3 s, 1.9x a memcpy (bench/weight_transfer.py).
        return "cpu_ipc"
    if len(trainer_devices) > 1 and not fleet_devices & set(trainer_devices):
        return "nccl_m2n"
    return "cuda"


def place_backend(backend: str, devices: Sequence[int], trainer_device: int = 0) -> str:
    """The transfer engine one replica is started with. Under `cuda`, CUDA IPC for a
    replica with a worker on the trainer's GPU (NCCL refuses two ranks on one device;
    the IPC lane hands a handle for each of its GPUs) and NCCL for the others, in the
    same sync."""
    if backend != "cuda":
        return backend
    return "ipc" if trainer_device in devices else "nccl"


def replica_settings(
    settings: VLLMSettings, tp: int, transfer: str = "shm", devices: Sequence[int] = (),
) -> VLLMSettings:
    """A TP-`tp` replica's settings: `max_num_seqs` is per device; `transfer`: its
    weight-transfer engine (`place_backend`), none for the spool; `devices`: its GPUs."""
    return dataclasses.replace(
        settings, tensor_parallel_size=tp, max_num_seqs=settings.max_num_seqs * tp,
        weight_transfer=None if transfer == "shm" else transfer, devices=tuple(devices),
    )


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
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


def make_transport(
    backend: str, verify: bool = False, shards: ShardSenders | None = None,
    env: Mapping[str, str] = os.environ, dtype: str | None = None,
    adapter: Mapping[str, Any] | None = None,
) -> WeightTransport:
    """`shards`: the trainer's ranks, for `nccl_m2n` / `gloo_m2n`
    (`rpk.engine.m2n.TrainerShards`); `env`: the launch's, for their rendezvous;
    `dtype`: the replicas' (`VLLMSettings.dtype`), what whole-tensor buckets are cast to
    (m2n's shards keep the dtypes their layout announced at init); `adapter`: a LoRA
    run's adapter config, whose syncs are adapter versions (`rpk.engine.adapter`)
    whatever the backend."""
    if adapter is not None:
        lora = AdapterTransport(adapter)
        return VerifiedTransport(lora) if verify else lora
    if backend in COMMUNICATORS:
        if shards is None:
            raise ValueError(f"weight transfer {backend} needs the sharded trainer's ranks (shards=)")
        if verify and backend == "nccl_m2n":
            raise ValueError("weight transfer nccl_m2n cannot be verified (verify=True): vLLM's m2n "
                             "engine reports no digests of what its workers received")
        address = rendezvous_address(env)
        m2n = CollectiveTransport(lanes={backend: lambda members: M2NLane(members, shards, address, backend)})
        # Verified, the trainer gathers once more to hash whole tensors: its buckets are shards.
        return VerifiedTransport(m2n, shards.digests) if verify else m2n
    transport: WeightTransport = SpoolTransport() if backend == "shm" else CollectiveTransport()
    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"the replicas' dtype {dtype!r} is no torch dtype to cast the weights to")
    to = None if dtype is None else getattr(torch, dtype)
    if verify:
        return VerifiedTransport(transport, dtype=to)
    return transport if to is None else CastTransport(transport, to)


async def launch_fleet(
    settings: VLLMSettings,
    plan: FleetPlan,
    *,
    platform: Platform,
    backend: str = "shm",
    verify: bool = False,
    switch: Switch = "sleep",
    version: int = 0,
    log: Callable[[str], None] = lambda line: None,
    shards: ShardSenders | None = None,
    adapter: Mapping[str, Any] | None = None,
    rest: Rest | None = None,
) -> Fleet:
    """Start the layouts of `plan` (only the awake one with restart-on-switch) serving
    the model in `settings` as weight version `version`; `verify`: every sync is
    checked against the trainer's weights (`rpk.engine.verify`); `shards`: the sharded
    trainer's ranks, for an m2n backend; `adapter`: a LoRA run's adapter config (its
    replicas take adapters, `settings.max_lora_rank`; with backend `shm` they have no
    weight-transfer engine); `rest`: how the fleet shares its devices with the trainer."""
    places = plan.layouts()
    transport = make_transport(backend, verify, shards, dtype=settings.dtype, adapter=adapter)  # before any replica starts: it may refuse
    started: list[VLLMEngine] = []
    # The IPC handles travel pickled.
    env_extra = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend in ("ipc", "cuda") else {}

    async def launch_layout(tp: int, version: int | None = version) -> Sequence[VLLMEngine]:
        replicas = []
        for place in places[tp]:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env = {**(device_env(place, platform, visible) if plan.pinned else {}), **env_extra}
            s = replica_settings(settings, tp, place_backend(backend, place.devices), place.devices)
            t0 = time.perf_counter()
            replica = await VLLMEngine.launch(
                s, env=env, version=version, name=place.name, verify=verify
            )
            started.append(replica)
            replicas.append(replica)
            if len(places) > 1 or plan.pinned:
                on = "device" if len(place.devices) == 1 else "devices"
                ids = ",".join(map(str, place.devices))
                log(f"rollout replica {place.name} on {on} {ids}: up in {time.perf_counter() - t0:.1f}s")
        return replicas

    # The layouts that wait start first, each put to sleep before the next starts, and
    # the awake one last: on a GPU only one layout ever holds weights and a KV cache
    # (vLLM sizes its cache from the memory free when it starts).
    order = [tp for tp in places if tp != plan.tp and switch == "sleep"] + [plan.tp]
    try:
        layouts = {tp: Layout(tp, tuple(p.name for p in places[tp]), [], LayoutState.STOPPED)
                   for tp in places}
        for tp in order:
            layouts[tp].replicas = list(await launch_layout(tp))
            layouts[tp].move(LayoutState.AWAKE)
            if tp != plan.tp:
                await asyncio.gather(*(r.sleep() for r in layouts[tp].replicas))
                layouts[tp].move(LayoutState.ASLEEP)
        # A LoRA replica started anew serves the base alone: stale until the regroup sends
        # it the adapter (the first start's replicas serve `version`: a resumed run
        # installs the checkpoint's adapter before any round).
        restart = (lambda tp: launch_layout(tp, None)) if adapter is not None else launch_layout
        relaunch = restart if switch == "restart" else None
        return Fleet(Layouts(list(layouts.values()), relaunch), transport, version=version, rest=rest)
    except BaseException:
        await asyncio.gather(*(r.shutdown() for r in started), return_exceptions=True)
        raise
