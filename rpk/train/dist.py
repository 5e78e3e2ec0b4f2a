"""The trainer of a multi-process run: rank 0's event loop decides, every rank computes.

Rank 0 (the controller) owns the one asyncio loop and a `DistTrainer`, which is the
`Trainer` the loop already knows. Each of its calls sends one command to the other
ranks (the followers, in `follow`) over a gloo group kept for control, then does the
same work on rank 0's shard: every rank makes the same FSDP calls in the same order, and
the event loop never waits on a collective (the trainer runs on its own thread).

A chunk of completed groups is shared out by `rpk.train.packing.split_across`: balanced
by tokens, the same number of forward/backward passes on every rank. Each rank receives
only its own micro-batches (a scatter, not a broadcast).

Weights leave gathered (`Weights`: every rank takes part in each `full_tensor()`), or,
for vLLM's `nccl_m2n` (`rpk.sync.m2n_send`, the trainer's side of the path), as every
rank's own shards: `JoinShards` has each rank join every replica's group with its own
end, and until `Signal.LEAVE_SHARDS` the weights leave as `ShardBucket`s: each follower
reshards its shards into the groups while rank 0's go to the lane.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpk.core import modes
from rpk.core.errors import NodeFailure
from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample
from rpk.gpu.launch import Channel
from rpk.manifest import WriteFailed
from rpk.sync.backends import Wire
from rpk.sync.m2n_plan import Mesh, ParamLayout
from rpk.sync.m2n_send import Ends, ShardBucket, ShardGroup, open_ends
from rpk.sync.verify import digest
from rpk.train.packing import split_across
from rpk.train.trainer import TorchTrainer

# The commands that carry nothing, one member each: begin, finish or abandon the step,
# close this rank's m2n ends, end the follower.
Signal = enum.Enum("Signal", "BEGIN FINISH ABANDON LEAVE_SHARDS STOP")


@dataclass(frozen=True, slots=True)
class Build:
    """Load the model from `model_dir` (the run's model or a checkpoint) and shard it."""

    model_dir: str


@dataclass(frozen=True, slots=True)
class Accumulate:
    batches: tuple[tuple[TrainSample, ...], ...] = field(default=())  # this rank's passes


@dataclass(frozen=True, slots=True)
class Weights:
    """Gather the full weights bucket by bucket (every rank takes part in each); with
    `shards`, send this rank's own shards through its `nccl_m2n` ends instead."""

    max_bytes: int
    shards: bool = False


@dataclass(frozen=True, slots=True)
class JoinShards:
    """Join every replica's `nccl_m2n` group (`wire`: its communicator) as this rank."""

    wire: Wire
    groups: tuple[ShardGroup, ...]


@dataclass(frozen=True, slots=True)
class OffloadCommand:
    """The trainer state to host while vLLM generates (`TorchTrainer.offload`)."""

    what: modes.Offload


@dataclass(frozen=True, slots=True)
class Save:
    directory: str


@dataclass(frozen=True, slots=True)
class Load:
    directory: str


Command = Signal | Build | Accumulate | Weights | JoinShards | OffloadCommand | Save | Load


def follow(channel: Channel[Command], make_trainer: Callable[[str], TorchTrainer]) -> None:
    """A follower's whole life: execute rank 0's commands until it says `Signal.STOP`. An error
    here ends the process, and with it the run (torchrun stops the other ranks)."""
    trainer: TorchTrainer | None = None
    ends: Ends | None = None
    while True:
        try:
            command = channel.receive()
        except Exception as e:  # the channel's only peer is rank 0: its node is gone
            raise NodeFailure(0, f"rank {channel.rank} lost the controller (rank 0): {e}") from e
        if command is Signal.STOP:
            return
        if isinstance(command, Build):
            trainer = make_trainer(command.model_dir)
            continue
        if trainer is None:
            raise RuntimeError(f"command {command!r} before the trainer was built")
        if isinstance(command, JoinShards) or command is Signal.LEAVE_SHARDS:
            if ends is not None:
                ends.close()
            ends = join_shards(trainer, command, channel.rank) if isinstance(command, JoinShards) else None
            continue
        if isinstance(command, Weights) and command.shards:
            if ends is None:
                raise RuntimeError(f"rank {channel.rank}: weights as shards before joining a group")
            for bucket in trainer.weight_shards(command.max_bytes):
                ends.reshard(bucket)
            continue
        try:
            execute(trainer, command)
        except WriteFailed:
            # A failed checkpoint write is raised on every rank (rpk.train.state): rank 0
            # reports it and stops the run, which releases this rank.
            if not isinstance(command, Save):
                raise


def join_shards(trainer: TorchTrainer, command: JoinShards, rank: int) -> Ends:
    """This rank's ends of every replica's group (the same on rank 0 and the followers)."""
    mesh, layouts = trainer.shard_layout()
    return open_ends(command.wire, rank, mesh, layouts, command.groups)


def execute(trainer: TorchTrainer, command: Command) -> Any:
    """What one rank does for `command` (the same on rank 0 and the followers)."""
    match command:
        case Signal.BEGIN:
            return trainer.begin_step()
        case Accumulate(batches):
            return trainer.run_micro_batches(batches)
        case Signal.FINISH:
            return trainer.finish_step()
        case Signal.ABANDON:
            return trainer.abandon_step()
        case Weights(max_bytes):
            for _ in trainer.weight_buckets(max_bytes):
                pass
            return None
        case OffloadCommand(what):
            return trainer.offload(what)
        case Save(directory):
            return trainer.save(directory)
        case Load(directory):
            return trainer.load(directory)
    raise ValueError(f"not a trainer command: {command!r}")


class DistTrainer:
    """The `Trainer` of rank 0 in a multi-process run (see the module docstring).
    Blocking, like every trainer: the loop runs it on the trainer thread."""

    def __init__(self, channel: Channel[Command], make_trainer: Callable[[str], TorchTrainer], model_dir: str):
        self._channel = channel
        self._broken = False  # a command failed to reach the followers: the group is gone
        self._on: tuple[int, ...] | None = None  # ranks that compute chunks (None: all)
        self._ends: Ends | None = None  # rank 0's nccl_m2n ends, while its groups are open
        self._send_all(Build(model_dir))
        self.local = make_trainer(model_dir)  # rank 0's own share of every command

    @property
    def version(self) -> int:
        return self.local.version

    def _send_all(self, command: Command) -> None:
        self._send([command] * self._channel.world)

    def _send(self, commands: Sequence[Command]) -> Command:
        try:
            return self._channel.send(commands)
        except Exception:
            self._broken = True
            raise

    def _everywhere(self, command: Command) -> Any:
        self._send_all(command)
        return execute(self.local, command)

    def begin_step(self) -> None:
        self._everywhere(Signal.BEGIN)

    def compute_on(self, ranks: Sequence[int] | None) -> None:
        """Until the step ends, only `ranks` compute the chunks `accumulate` gets (None:
        every rank). The borrowing stream trainer's devices: whole HSDP replicate groups
        (`ParallelLayout.ranks_on`), whose passes need no other rank until the step's
        one reduction, which every rank joins in `finish_step`."""
        world = self._channel.world
        if ranks is not None and (not ranks or any(not 0 <= r < world for r in ranks)):
            raise ValueError(f"compute_on: ranks {list(ranks)} are not a subset of 0..{world - 1}")
        self._on = tuple(sorted(set(ranks))) if ranks is not None else None

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        scored, seen = self.local.select(samples)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in scored]
        on = self._on if self._on is not None else tuple(range(self._channel.world))
        shares = iter(split_across(lengths, len(on), self.local.micro_batch_tokens))
        per_rank = [next(shares) if r in on else [] for r in range(self._channel.world)]
        commands = [
            Accumulate(tuple(tuple(scored[i] for i in batch) for batch in batches))
            for batches in per_rank
        ]
        mine = self._send(commands)
        assert isinstance(mine, Accumulate)
        return self.local.run_micro_batches(mine.batches, seen)

    def finish_step(self) -> Mapping[str, float]:
        self._on = None
        return self._everywhere(Signal.FINISH)

    def abandon_step(self) -> None:
        """On a failure path: the followers drop the step too, unless they are gone (a
        lost node), when only this rank's step is dropped and the original error, not
        the group's, is what the run reports."""
        self._on = None
        with contextlib.suppress(Exception):  # only the channel can fail here: it is gone
            self._send_all(Signal.ABANDON)
        self.local.abandon_step()

    def weight_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        """The weights as they leave for the replicas, each bucket typed by what it holds:
        whole tensors (`whole_buckets`), or, between `open_shards` and `close_shards`,
        `ShardBucket`s of rank 0's own shards (`shard_buckets`)."""
        return self.shard_buckets(max_bytes) if self._ends is not None else self.whole_buckets(max_bytes)

    def whole_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        """The gathered weights (every rank joins each gather)."""
        self._send_all(Weights(max_bytes))
        return self.local.weight_buckets(max_bytes)

    def shard_buckets(self, max_bytes: int) -> Iterator[ShardBucket]:
        """Rank 0's own shards, while the followers send theirs into the open groups."""
        if self._ends is None:
            raise RuntimeError("shard_buckets with no nccl_m2n groups open (open_shards first)")
        self._send_all(Weights(max_bytes, shards=True))
        return self.local.weight_shards(max_bytes)

    def shard_layout(self) -> tuple[Mesh, list[ParamLayout]]:
        return self.local.shard_layout()

    def weight_digests(self, max_bytes: int) -> dict[str, str]:
        """sha256 per HF name of the whole weights, for `run.verify_sync` under m2n (the
        shards sent are no whole tensors to hash): every rank joins each gather, only
        when verifying."""
        return {name: digest(t) for bucket in self.whole_buckets(max_bytes) for name, t in bucket}

    def open_shards(self, wire: Wire, groups: Sequence[ShardGroup]) -> Ends:
        """Every rank joins the `nccl_m2n` groups of `groups` (blocking until they form:
        the replicas' workers join at the same time); rank 0's ends are returned."""
        self.close_shards()
        command = JoinShards(wire, tuple(groups))
        self._send_all(command)
        self._ends = join_shards(self.local, command, 0)
        return self._ends

    def close_shards(self) -> None:
        """Every rank leaves its groups; weights are gathered again."""
        if self._ends is not None:
            self._ends.close()
            self._ends = None
            self._send_all(Signal.LEAVE_SHARDS)

    def offload(self, what: modes.Offload) -> None:
        self._everywhere(OffloadCommand(what))

    def save(self, directory: Path) -> None:
        self._everywhere(Save(str(directory)))

    def load(self, directory: Path) -> None:
        self._everywhere(Load(str(directory)))

    def close(self) -> None:
        """Release the followers (they exit); the last call of a run. After a lost node
        there is no one to release: followers whose rank 0 is gone fail and exit."""
        if not self._broken:
            with contextlib.suppress(Exception):  # a follower gone since: nothing to release
                self._send_all(Signal.STOP)
