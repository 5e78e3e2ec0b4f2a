"""A two-rank gloo trainer for tests, kept for a whole test module: the pytest process is
rank 0 (it drives a `DistTrainer`), a subprocess is rank 1 (it runs `follow`)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import torch

from rpk.gpu.launch import Joined, Sharding, join
from rpk.gpu.layout import ParallelLayout
from rpk.train.dist import Stop, follow
from rpk.train.trainer import TorchTrainer, TrainerSettings

MAX_TOKENS = 16
# float64, unclipped: a sharded step must equal an unsharded one to rounding.
SETTINGS = dict(lr=1e-2, clip_low=0.2, clip_high=0.28, torch_threads=1, grad_clip=0.0)


def make(directory: str | Path, sharding: Sharding | None, budget: int = 10_000) -> TorchTrainer:
    return TorchTrainer(
        directory, TrainerSettings(micro_batch_tokens=budget, **SETTINGS), max_response_tokens=MAX_TOKENS,
        temperature=0.7, seed=0, dtype=torch.float64, sharding=sharding,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


@contextlib.contextmanager
def two_ranks(dp_replicate: int = 1) -> Iterator[Joined]:
    """This process as rank 0 and a follower subprocess as rank 1 (`follower_main`),
    stopped and checked (exit 0, nothing left running) on the way out."""
    from tests.procs import descendants, wait_gone

    port = free_port()
    follower = subprocess.Popen(
        [sys.executable, "-m", "tests.dist_harness", str(port), str(dp_replicate)],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )
    rendezvous(port)
    joined = join(ParallelLayout(nproc_per_node=2, rank=0, dp_replicate=dp_replicate), timeout_s=120)
    try:
        yield joined
    finally:
        joined.channel.send([Stop(), Stop()])
        joined.close()
        try:
            follower.wait(timeout=60)
        finally:
            children = descendants(follower.pid)
            follower.kill()
            assert not wait_gone(children, 10)
        assert follower.returncode == 0, follower.stderr.read() if follower.stderr else ""


def follower_main(port: int, dp_replicate: int = 1) -> None:
    rendezvous(port)
    joined = join(ParallelLayout(nproc_per_node=2, rank=1, dp_replicate=dp_replicate), timeout_s=120)
    try:
        follow(joined.channel, lambda d: make(d, joined.sharding))
    finally:
        joined.close()


if __name__ == "__main__":
    follower_main(int(sys.argv[1]), *map(int, sys.argv[2:]))
