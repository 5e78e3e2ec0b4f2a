"""The config's `run` section (steps, seed, checkpoints, validation, records) and
`dist` (the processes: ranks, nodes, the engine nodes and their TLS)."""

from __future__ import annotations

from dataclasses import dataclass

from rpk.cli_config import ConfigError, bad
from rpk.config.fields import non_negative, opt, positive, whole
from rpk.core.names import TRACKERS


@dataclass(frozen=True, slots=True)
class RunConfig:
    steps: int = opt(60, "RL steps (one optimizer step each)")
    seed: int = opt(0, "seeds data order, sampling and the trainer")
    out_dir: str = opt("runs", "run directories go to OUT_DIR/<timestamp>/")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and always at the end); 0 = end only")
    resume: str | None = opt(
        None,
        "continue a run: its directory (runs/latest works; the newest complete checkpoint "
        "is taken) or one of its checkpoints; the run goes on in that directory",
    )
    keep_checkpoints: int = opt(
        0, "keep the newest N checkpoints, 0 = all; one holding a file named KEEP stays"
    )
    verify_checkpoint: bool = opt(
        True,
        "check the checkpoint run.resume takes against its manifest: file sizes always, "
        "their hashes too when true (reads every byte)",
    )
    samples_per_step: int = opt(
        3, "responses per step written to samples.jsonl (the shortest, the longest, others)"
    )
    show_samples: bool = opt(False, "print one sampled response per step on the console")
    verify_sync: bool = opt(
        False,
        "after every weight sync, check that each rollout worker holds exactly the "
        "trainer's weights (sha256 per tensor); a difference stops the run naming the "
        "replica and the tensor. Costs a hash of the weights on both sides per sync",
    )
    progress: bool = opt(True, "show the live progress display")
    uvloop: bool = opt(True, "use uvloop's event loop when installed")
    eval_every: int = opt(
        20, "validate every N steps, and always after the last one; 0 = after the last only"
    )
    eval_before_train: bool = opt(True, "validate before the first step (veRL's val_before_train)")
    eval_k: int = opt(
        4,
        "validation: sampled responses per prompt at rollout.temperature, for mean@k and "
        "pass@k (greedy pass@1 is always measured); 0 = greedy only",
    )
    trackers: tuple[str, ...] = opt(
        ("tensorboard",),
        f"where scalars, the config and sample texts go besides metrics.jsonl: any of "
        f"{', '.join(TRACKERS)} (optional extras: pip install 'rpk[wandb]'); empty = none",
    )
    project: str = opt("rpk", "the wandb project / MLflow experiment")
    name: str | None = opt(None, "the wandb / MLflow run name; unset = the run directory's name")
    dry_run: bool = opt(
        False,
        "print the resolved layout, the GPU memory plan and each vLLM replica's engine "
        "arguments as JSON, and start nothing (dist.gpus / dist.gpu_mem_gb ask it for a GPU "
        "box this machine does not have)",
    )

    def __post_init__(self) -> None:
        positive(self, "steps")
        non_negative(
            self, "checkpoint_every", "keep_checkpoints", "samples_per_step", "eval_every", "eval_k"
        )
        for tracker in self.trackers:
            if tracker not in TRACKERS:
                raise bad("trackers", f"{tracker!r} is not one of {', '.join(TRACKERS)}")
        if len(set(self.trackers)) != len(self.trackers):
            raise bad("trackers", f"lists a tracker twice: {list(self.trackers)!r}")
        if not self.project:
            raise bad("project", "must not be empty")


@dataclass(frozen=True, slots=True)
class DistConfig:
    """Processes: one per device. `torchrun` sets them for several nodes; on one machine
    `nproc` asks rpk to start them itself."""

    nproc: int = opt(
        0,
        "processes (ranks) on this machine: rank 0 runs the loop, rollout and a trainer "
        "shard, the others trainer shards; 0 = one per GPU where there are several, else 1",
    )
    dp_replicate: int = opt(
        1, "HSDP: replicas of the sharded trainer (1 = FSDP over every rank)"
    )
    timeout_s: float = opt(
        300.0,
        "a collective that waits longer fails the run (a hung or lost rank); the "
        "launcher stops every rank as soon as one exits",
    )
    engine_nodes: tuple[int, ...] = opt(
        (),
        "nodes that run rollout replicas (the rollout's layouts on each, over its "
        "rollout.devices), e.g. 0,1; empty = every node. Node 0's run in the controller, "
        "the others' in an engine host that the node's local rank 0 starts",
    )
    engine_start_timeout_s: float = opt(
        900.0, "the controller waits this long for every other node's engine host to serve"
    )
    heartbeat_s: float = opt(
        2.0,
        "the controller checks every other node's engine host this often; heartbeat_misses "
        "failed checks in a row stop the run, naming the node",
    )
    heartbeat_misses: int = opt(3, "failed host checks in a row that lose a node")
    tls_cert: str = opt(
        "",
        "engine hosts on other nodes serve TLS with this certificate (PEM; the same path "
        "on every node; it must name the address the controller reaches each host at); "
        "empty = plain HTTP",
    )
    tls_key: str = opt("", "the private key of dist.tls_cert (PEM; set both or neither)")
    tls_ca: str = opt(
        "",
        "the controller checks the hosts' certificates against this CA file (a "
        "self-signed dist.tls_cert itself will do); empty = the system's CAs",
    )
    gpus: int = opt(
        0, "run.dry_run: plan for this many GPUs per node (0 = the GPUs CUDA shows here)"
    )
    gpu_mem_gb: float = opt(
        0.0, "run.dry_run: memory of each GPU, GB (1e9 bytes); 0 = what CUDA reports here"
    )
    nodes: int = opt(1, "run.dry_run: nodes of dist.gpus GPUs each")

    def __post_init__(self) -> None:
        non_negative(self, "nproc", "gpus", "gpu_mem_gb")
        whole(self, "nodes")
        whole(self, "dp_replicate")
        positive(self, "timeout_s", "engine_start_timeout_s", "heartbeat_s")
        whole(self, "heartbeat_misses")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(
                f"dist.tls_cert={self.tls_cert!r} and dist.tls_key={self.tls_key!r}: set both or neither"
            )
        if self.tls_ca and not self.tls_cert:
            raise ConfigError(
                f"dist.tls_ca={self.tls_ca!r} without dist.tls_cert: the hosts would serve plain HTTP"
            )
        if any(n < 0 for n in self.engine_nodes) or len(set(self.engine_nodes)) != len(self.engine_nodes):
            raise ConfigError(
                f"dist.engine_nodes={list(self.engine_nodes)} must be distinct node indices >= 0"
            )
