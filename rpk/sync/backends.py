"""Every way weights reach a replica, in one table: a `Backend` and its record.

A run names its weight path as a string (`rollout.weight_transfer`, config stays a
leaf); `resolve` parses it once, at assembly, into the run's `WeightPath` (node 0's
backend, the other nodes', and whether syncs are LoRA adapters), and everything
downstream carries the typed `Backend` and asks this table instead of comparing names:
- `SPOOL` (`shm`, the one thing the name means): safetensors files in /dev/shm,
  reloaded by every replica (`rpk.sync.spool`); to other nodes, the HTTP upload of
  those files;
- `GLOO`, `NCCL`: one process group, the trainer at rank 0 (`rpk.sync.lanes.GroupLane`);
- `IPC`: CUDA IPC handles to the trainer's GPU memory; `CPU_IPC`: the same protocol
  with handles into host memory (`rpk.sync.cpu_ipc`);
- `NCCL_M2N`, `GLOO_M2N`: every trainer rank sends its own shards (`rpk.sync.m2n_lane`);
- `CUDA`: not an engine but the fleet's path on GPU: each replica `IPC` or `NCCL` by
  where it sits (`for_replica`);
- `ADAPTER`: a LoRA run's: every sync a new adapter version, written once as PEFT files
  and loaded by every replica, on this node or another (`rpk.sync.adapter`); the base
  weights never move after start.

Pure: no torch, no vLLM (rpk's vLLM plugin reads the worker engines from it in every
vLLM process).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rpk.core.modes import TransferChoice


class Backend(enum.StrEnum):
    SPOOL = "shm"
    GLOO = "gloo"
    CPU_IPC = "cpu_ipc"
    IPC = "ipc"
    NCCL = "nccl"
    NCCL_M2N = "nccl_m2n"
    GLOO_M2N = "gloo_m2n"
    CUDA = "cuda"
    ADAPTER = "adapter"


class Wire(enum.StrEnum):
    """The communicator of a group (and of m2n's groups): what the trainer's end opens."""

    GLOO = "gloo"
    NCCL = "nccl"


class TrainerEnd(enum.Enum):
    """What the trainer holds open for a lane of the backend."""

    FILES = "spool files, written once per sync"
    GROUP = "rank 0 of a broadcast group"
    CUDA_IPC = "CUDA IPC handles to its GPU memory"
    HOST_IPC = "handles into its host memory"
    SHARDS = "every rank's own shards, one group per replica"
    PER_REPLICA = "IPC or a group, by where each replica sits"
    ADAPTER = "adapter files, written once per sync"


@dataclass(frozen=True, slots=True)
class WorkerEngine:
    """rpk's own vLLM weight-transfer engine, registered under the backend's name in the
    workers' factory (`rpk.engine.plugin`)."""

    module: str
    cls: str


@dataclass(frozen=True, slots=True)
class BackendSpec:
    backend: Backend
    platforms: frozenset[str]  # where it applies: "cpu", "cuda"
    trainer_end: TrainerEnd
    # The replica's vLLM weight-transfer engine (`rpk.engine.vllm_settings.engine_kwargs`); None:
    # no engine (the spool reloads files through rpk's worker extension).
    engine: str | None
    worker: WorkerEngine | None  # rpk's worker engine; None: vLLM's own (or none)
    # The group's communicator, for a group or shards end.
    wire: Wire | None = None
    # Why `run.verify_sync` is refused with it; None: its workers report digests.
    unverifiable: str | None = None
    # It can feed other nodes' replicas (over gloo or HTTP), chosen in the config.
    reaches_nodes: bool = False

    @property
    def verifiable(self) -> bool:
        return self.unverifiable is None

    @property
    def pickles_handles(self) -> bool:
        """Its update info carries CUDA IPC handles, pickled (vLLM must allow it)."""
        return self.trainer_end in (TrainerEnd.CUDA_IPC, TrainerEnd.PER_REPLICA)


_ANY, _CPU, _CUDA = frozenset({"cpu", "cuda"}), frozenset({"cpu"}), frozenset({"cuda"})
_WORKER = "rpk.sync.worker"

BACKENDS: Mapping[Backend, BackendSpec] = {s.backend: s for s in (
    BackendSpec(Backend.SPOOL, _ANY, TrainerEnd.FILES, None, None, reaches_nodes=True),
    BackendSpec(Backend.GLOO, _ANY, TrainerEnd.GROUP, "gloo",
                WorkerEngine(f"{_WORKER}.gloo", "GlooWeightTransferEngine"), wire=Wire.GLOO,
                reaches_nodes=True),
    BackendSpec(Backend.CPU_IPC, _CPU, TrainerEnd.HOST_IPC, "cpu_ipc",
                WorkerEngine(f"{_WORKER}.cpu_ipc", "CpuIpcWeightTransferEngine"), reaches_nodes=True),
    BackendSpec(Backend.IPC, _CUDA, TrainerEnd.CUDA_IPC, "ipc", None),
    BackendSpec(Backend.NCCL, _CUDA, TrainerEnd.GROUP, "nccl", None, wire=Wire.NCCL),
    BackendSpec(Backend.NCCL_M2N, _CUDA, TrainerEnd.SHARDS, "nccl_m2n", None, wire=Wire.NCCL,
                unverifiable="vLLM's m2n engine reports no digests of what its workers received; "
                             "verify with rollout.weight_transfer nccl"),
    BackendSpec(Backend.GLOO_M2N, _CPU, TrainerEnd.SHARDS, "gloo_m2n",
                WorkerEngine(f"{_WORKER}.gloo_m2n", "GlooM2NWeightTransferEngine"), wire=Wire.GLOO),
    BackendSpec(Backend.CUDA, _CUDA, TrainerEnd.PER_REPLICA, None, None),
    BackendSpec(Backend.ADAPTER, _ANY, TrainerEnd.ADAPTER, None, None),
)}

# The config's choices that are no backend of their own: resolved per run.
AUTO, M2N = TransferChoice.AUTO, TransferChoice.M2N
# What other nodes' replicas start with: a gloo group, the HTTP upload of the spool,
# or a LoRA run's adapters (uploaded too).
REMOTE = (Backend.GLOO, Backend.SPOOL, Backend.ADAPTER)


@dataclass(frozen=True, slots=True)
class WeightPath:
    """How a run's weights reach its replicas, resolved once at assembly (`resolve`):
    node 0's fleet's backend (`local`) and the other engine nodes' (`remote`); `note`:
    the one line saying why `local` is not what the choice resolves to where this
    machine cannot run that (`rpk.sync.runtime.runnable`), "" when it is."""

    local: Backend
    remote: Backend
    note: str = ""

    @property
    def adapter(self) -> bool:
        """Every sync is a LoRA adapter version (`Backend.ADAPTER`)."""
        return self.local is Backend.ADAPTER

    @property
    def sends_shards(self) -> bool:
        return sends_shards(self.local)


class UnverifiableError(ValueError):
    """`run.verify_sync` with a backend whose workers report no digests."""


def spec(backend: Backend) -> BackendSpec:
    return BACKENDS[backend]


def parse(name: str) -> Backend:
    """A backend by its name, refused naming the choices."""
    try:
        return Backend(name)
    except ValueError:
        raise ValueError(f"weight transfer {name!r} is none of {[b.value for b in Backend]}") from None


def sends_shards(backend: Backend) -> bool:
    return BACKENDS[backend].trainer_end is TrainerEnd.SHARDS


def check_verifiable(backend: Backend) -> None:
    """The one refusal of `run.verify_sync` for a backend that cannot be verified."""
    why = BACKENDS[backend].unverifiable
    if why is not None:
        raise UnverifiableError(f"weight transfer {backend.value} cannot be verified (run.verify_sync): {why}")


def resolve(
    choice: str, platform: str, fleet_devices: set[int], trainer_device: int = 0,
    trainer_devices: Sequence[int] = (), adapter: bool = False,
) -> WeightPath:
    """The run's weight path for the config's `choice`, its fleet on `fleet_devices`:
    `shm` (spool files, any device), rpk's `gloo` (any device) and `cpu_ipc` (CPU),
    vLLM's `ipc` / `nccl` (CUDA); `m2n`, a sharded trainer's ranks each sending their own
    shards: vLLM's `nccl_m2n` on CUDA, rpk's `gloo_m2n` on CPU (the same protocol over
    gloo). `auto`: `cpu_ipc` on CPU; on GPU `cuda`, each replica IPC or NCCL by where it
    sits (`for_replica`), or `nccl_m2n` for a sharded trainer (`trainer_devices`: its
    ranks' GPUs, more than one) whose fleet sits wholly on other GPUs: every rank then
    sends its own shards and none gathers. m2n puts every trainer rank and a replica's
    workers in one NCCL group, and NCCL refuses two ranks on one device; while m2n's
    groups are open the trainer hands out shards, so a fleet takes m2n whole or not at
    all. `adapter`: a LoRA run, whose syncs are adapters whatever the choice."""
    if adapter:
        return WeightPath(Backend.ADAPTER, Backend.ADAPTER)
    asked = None if choice in (AUTO, M2N) else parse(choice)
    return WeightPath(_local(choice, asked, platform, fleet_devices, trainer_device, trainer_devices),
                      _remote(choice, asked, platform))


def _local(
    choice: str, asked: Backend | None, platform: str, fleet_devices: set[int], trainer_device: int,
    trainer_devices: Sequence[int],
) -> Backend:
    if asked is not None:
        if platform == "cuda" and BACKENDS[asked].wire is Wire.NCCL:
            _refuse_shared(choice, fleet_devices,
                           {trainer_device} if asked is Backend.NCCL else set(trainer_devices))
        return asked
    if choice == M2N:
        if platform == "cuda":
            _refuse_shared(choice, fleet_devices, set(trainer_devices))
        return next(b for b, s in BACKENDS.items()
                    if s.trainer_end is TrainerEnd.SHARDS and platform in s.platforms)
    if platform == "cpu":
        # cpu_ipc: 3.1 s a sync of a 0.5B model against 4.2 (gloo) and 5.5 (spool) on a
        # 2-core CPU, its transfer 0.3 s, 1.9x a memcpy (bench/weight_transfer.py).
        return Backend.CPU_IPC
    if len(trainer_devices) > 1 and not fleet_devices & set(trainer_devices):
        return Backend.NCCL_M2N
    return Backend.CUDA


def _remote(choice: str, asked: Backend | None, platform: str) -> Backend:
    """How weights reach other nodes' replicas: `GLOO` (every CPU run but `shm`, and
    `gloo` asked for), or `SPOOL`, the HTTP upload fallback."""
    if asked is Backend.GLOO or (platform == "cpu" and (choice == AUTO or asked is Backend.CPU_IPC)):
        return Backend.GLOO
    return Backend.SPOOL


def _refuse_shared(choice: str, fleet_devices: set[int], joining: set[int]) -> None:
    # NCCL refuses two ranks on one device: the trainer's (all of them for m2n) and a worker's.
    if shared := sorted(fleet_devices & joining):
        raise ValueError(f"rollout.weight_transfer={choice} with replicas on the trainer's "
                         f"GPUs {shared} (trainer {sorted(joining)}): NCCL refuses two ranks on "
                         "one GPU; take auto or ipc")


def for_replica(backend: Backend, devices: Sequence[int], trainer_device: int = 0) -> Backend:
    """The transfer engine one replica is started with. Under `CUDA`, CUDA IPC for a
    replica with a worker on the trainer's GPU (NCCL refuses two ranks on one device;
    the IPC lane hands a handle for each of its GPUs) and NCCL for the others, in the
    same sync."""
    if backend is not Backend.CUDA:
        return backend
    return Backend.IPC if trainer_device in devices else Backend.NCCL


def reaches_nodes(choice: str) -> bool:
    """Whether the config's `choice` can feed other nodes' replicas (over gloo or HTTP)."""
    return choice == AUTO or (choice != M2N and BACKENDS[parse(choice)].reaches_nodes)
