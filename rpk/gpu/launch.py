"""Starting the processes of a run and joining them up.

`python -m rpk.run` alone is one process. Asked for N (`--dist.nproc N`, or on a machine
with several GPUs), it runs torch's elastic launcher in-process (`torch.distributed.run`,
standalone rendezvous), which starts N copies of `rpk.run` as ranks and supervises them:
the launcher's process is the one the user started, so Ctrl-C and exit codes stay
theirs, and a failed rank comes back as one line naming it. `torchrun ... -m rpk.run`
works as well (several nodes): every rank reads its place from torchrun's environment
(`rpk.gpu.layout.from_env`).

`join` makes a rank's process groups: the default one (`default_backend`: on GPU NCCL
for cuda tensors and gloo for host ones; gloo on CPU) with a bounded timeout, so that a
rank that hangs stops the run in seconds-to-minutes rather than NCCL's ten, and a gloo
group for control messages with a long one (followers wait there through a whole
rollout). Then the trainer's device mesh.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rpk.gpu.layout import ParallelLayout

# Followers wait for the next command across a whole rollout and weight sync.
_CONTROL_TIMEOUT = timedelta(days=7)


def relaunch(argv: Sequence[str], nproc: int, *, monitor_interval_s: float = 0.5) -> int:
    """Run `python -m rpk.run argv` as `nproc` ranks on this machine; returns the exit
    code to leave with. A rank that fails is named in one line (its own exit code, and
    its error when rpk's `record` caught one)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args = [
        "--standalone", "--nproc-per-node", str(nproc),
        "--monitor-interval", str(monitor_interval_s), "-m", "rpk.run", "--", *argv,
    ]
    try:
        torchrun(args)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items(), key=lambda kv: kv[1].timestamp)
        message = failure.message
        why = message.get("message", "") if isinstance(message, dict) else str(message or "")
        if not why or why.startswith("To enable traceback"):
            why = (
                f"killed by {failure.signal_name()}" if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
        print(f"rpk: rank {rank} failed: {why.strip().splitlines()[-1]}", file=sys.stderr)
        code = failure.exitcode
        return code if code > 0 else 128 - code
    except KeyboardInterrupt:
        return 130
    return 0


M = TypeVar("M")


class Channel(Generic[M]):
    """Rank 0 -> every rank, one message each (possibly a different one per rank): the
    trainer's commands (`rpk.train.dist`)."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world

    def send(self, messages: Sequence[M]) -> M:
        """On rank 0: `messages[r]` goes to rank r; returns rank 0's own."""
        if len(messages) != self.world:
            raise ValueError(f"{len(messages)} messages for {self.world} ranks")
        out: list[Any] = [None]
        dist.scatter_object_list(out, list(messages), src=0, group=self.group)
        return out[0]

    def receive(self) -> M:
        out: list[Any] = [None]
        dist.scatter_object_list(out, None, src=0, group=self.group)
        return out[0]


@dataclass(frozen=True, slots=True)
class Sharding:
    """Where this rank's trainer sits: the device mesh of the data-parallel ranks, the
    process group their counts are summed over, and the control group (gloo, no short
    timeout) for a wait as long as rank 0 reading a checkpoint."""

    mesh: DeviceMesh
    group: Any  # a torch.distributed ProcessGroup
    rank: int
    world: int
    control: Any


@dataclass(frozen=True, slots=True)
class Joined:
    """A rank's place in a multi-process run."""

    layout: ParallelLayout
    sharding: Sharding
    channel: Channel[Any]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def default_backend(cuda: bool) -> str:
    """The default group's backends, by the device type of the tensors they serve. On
    CUDA a plain "nccl" group serves only cuda tensors; a host tensor sent over it raises
    "No backend type associated with device type cpu". gloo takes host ones."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def join(layout: ParallelLayout, timeout_s: float) -> Joined:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(layout.local_rank)
    dist.init_process_group(
        backend=default_backend(cuda), timeout=timedelta(seconds=timeout_s),
        rank=layout.rank, world_size=layout.world_size,
    )
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    names = ("shard",) if layout.dp_replicate == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cuda" if cuda else "cpu", layout.mesh_shape, mesh_dim_names=names)
    sharding = Sharding(
        mesh=mesh, group=dist.group.WORLD, rank=layout.rank, world=layout.world_size, control=control,
    )
    return Joined(layout, sharding, Channel(control, layout.rank, layout.world_size))


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def record(fn: Any) -> Any:
    """torchelastic's error recording: a rank's uncaught exception reaches the launcher
    (its message is what `relaunch` prints)."""
    from torch.distributed.elastic.multiprocessing.errors import record as elastic_record

    return elastic_record(fn)
