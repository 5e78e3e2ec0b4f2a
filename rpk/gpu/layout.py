"""Where every process of a run sits and what it does, as validated arithmetic.

`ParallelLayout` is what every other part reads instead of raw environment variables:
the world (nodes x devices per node), this process's ranks, the trainer's mesh (FSDP
shard degree x HSDP replicate degree) and the rollout: which ranks host engines and at
which TP sizes. It checks itself when built, naming the offending values, and builds no
mesh: `rpk.gpu.launch` does that from it. One process per device; on a CPU machine a
"device" is a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rpk.core.errors import UserError


class LayoutError(UserError, ValueError):
    """The requested layout cannot be laid over these processes and devices."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    nnodes: int = 1
    nproc_per_node: int = 1  # processes (= devices) per node
    rank: int = 0
    dp_replicate: int = 1  # HSDP: replicas of the sharded model; 1 = plain FSDP
    # Rollout engines: on each node its local rank 0 hosts them (issue: an engine host
    # per node); `rollout_devices` of the node's devices serve them at these TP sizes.
    rollout_tp_sizes: tuple[int, ...] = (1,)
    rollout_devices: int = 1
    engine_nodes: tuple[int, ...] = field(default=(0,))  # nodes whose host runs engines

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "dp_replicate", "rollout_devices"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise LayoutError(
                f"rank {self.rank} is outside the world of {self.world_size} processes "
                f"({self.nnodes} nodes x {self.nproc_per_node})"
            )
        if self.world_size % self.dp_replicate:
            raise LayoutError(
                f"dp_replicate={self.dp_replicate} does not divide the world of "
                f"{self.world_size} processes"
            )
        if self.dp_replicate > 1 and self.dp_shard % self.nproc_per_node and self.nproc_per_node % self.dp_shard:
            raise LayoutError(
                f"an FSDP shard group of {self.dp_shard} processes (world {self.world_size} / "
                f"dp_replicate {self.dp_replicate}) must fill whole nodes or fit inside one "
                f"({self.nproc_per_node} per node)"
            )
        if not self.rollout_tp_sizes:
            raise LayoutError("rollout_tp_sizes is empty: give at least one TP size")
        for tp in self.rollout_tp_sizes:
            if not (isinstance(tp, int) and tp >= 1) or self.rollout_devices % tp:
                raise LayoutError(
                    f"tp={tp} does not divide {self.rollout_devices} rollout devices per node"
                )
        if self.nproc_per_node > 1 and self.rollout_devices > self.nproc_per_node:
            raise LayoutError(
                f"rollout_devices={self.rollout_devices} exceeds the node's "
                f"{self.nproc_per_node} devices (TP groups never cross a node)"
            )
        bad = [n for n in self.engine_nodes if not 0 <= n < self.nnodes]
        if bad or not self.engine_nodes:
            raise LayoutError(f"engine_nodes {list(self.engine_nodes)} must name nodes 0..{self.nnodes - 1}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp_shard(self) -> int:
        return self.world_size // self.dp_replicate

    @property
    def node(self) -> int:
        return self.rank // self.nproc_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.nproc_per_node

    @property
    def is_controller(self) -> bool:
        """Rank 0 runs the event loop: policy, rollout, reward, metrics, checkpoints."""
        return self.rank == 0

    @property
    def hosts_engines(self) -> bool:
        return self.local_rank == 0 and self.node in self.engine_nodes

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The trainer's device mesh: (shard,) for FSDP, (replicate, shard) for HSDP."""
        if self.dp_replicate == 1:
            return (self.dp_shard,)
        return (self.dp_replicate, self.dp_shard)

    def ranks_on(self, devices: Iterable[tuple[int, int]]) -> tuple[int, ...] | None:
        """The trainer ranks of `devices` ((node, local device) pairs: one process per
        device), when they make whole HSDP replicate groups, which can run forward and
        backward passes without the other ranks (their reduction deferred); None when
        they do not (plain FSDP: every pass needs every rank)."""
        ranks = {
            node * self.nproc_per_node + d for node, d in devices
            if 0 <= node < self.nnodes and 0 <= d < self.nproc_per_node
        }
        if not ranks or self.dp_replicate == 1:
            return None
        groups = {r // self.dp_shard for r in ranks}
        whole = {g * self.dp_shard + i for g in groups for i in range(self.dp_shard)}
        return tuple(sorted(ranks)) if ranks == whole else None

    def describe(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        return (
            f"{self.world_size} process(es) = {self.nnodes} node(s) x {self.nproc_per_node}; "
            f"trainer mesh {mesh} ({'HSDP' if self.dp_replicate > 1 else 'FSDP'}); rollout on "
            f"node(s) {list(self.engine_nodes)}"
        )


def launched_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def from_env(
    env: Mapping[str, str] = os.environ,
    *,
    dp_replicate: int = 1,
    rollout_tp_sizes: tuple[int, ...] = (1,),
    rollout_devices: int = 1,
    engine_nodes: tuple[int, ...] = (),
) -> ParallelLayout:
    """This process's layout from torchrun's variables (one process without them);
    `engine_nodes` empty: every node runs rollout replicas."""
    if not launched_by_torchrun(env):
        return ParallelLayout(
            dp_replicate=dp_replicate, rollout_tp_sizes=rollout_tp_sizes,
            rollout_devices=rollout_devices,
        )
    try:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        rank = int(env["RANK"])
    except (KeyError, ValueError) as e:
        raise LayoutError(f"torchrun's environment is incomplete or wrong: {e}") from None
    if world % local_world:
        raise LayoutError(
            f"WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local_world}"
        )
    nnodes = world // local_world
    return ParallelLayout(
        nnodes=nnodes, nproc_per_node=local_world, rank=rank,
        dp_replicate=dp_replicate, rollout_tp_sizes=rollout_tp_sizes,
        rollout_devices=rollout_devices, engine_nodes=engine_nodes or tuple(range(nnodes)),
    )
