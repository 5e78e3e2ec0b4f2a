"""A two-rank gloo trainer for tests, kept for a whole test module: the pytest process is
rank 0 (it drives a `DistTrainer`), a subprocess is rank 1 (it runs `follow`); and the
helpers that compare a sharded step with an unsharded one.
`recording_phases` has a rank log its trainer's phases, for tests of their order."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rpk.gpu.launch import Joined, Sharding, join
from rpk.gpu.layout import ParallelLayout
from rpk.train import fsdp
from rpk.train.dist import DistTrainer, Signal, follow
from rpk.train.lora import ALL_LINEAR, LoraSettings
from rpk.train.offload import StateOffload
from rpk.train.trainer import TorchTrainer, TrainerSettings

MAX_TOKENS = 16
PHASES = ("begin_step", "run_micro_batches", "finish_step", "abandon_step", "weight_buckets", "offload")
# A follower recording its phases moves its state out this much later than rank 0 would:
# the race an offload without a completion barrier loses.
SLOW_OFFLOAD_S = 0.3
# float64, unclipped: a sharded step must equal an unsharded one to rounding.
SETTINGS = dict(lr=1e-2, clip_low=0.2, clip_high=0.28, torch_threads=1, grad_clip=0.0)


def make(
    directory: str | Path, sharding: Sharding | None, budget: int = 10_000, lora: dict[str, Any] | None = None,
    **extra: Any,
) -> TorchTrainer:
    """The test trainer; `extra`: more `TrainerSettings` fields (a KL penalty, ...);
    `lora`: `LoraSettings` fields (LoRA adapters on a frozen base)."""
    adapters = LoraSettings(**{**lora, "targets": tuple(lora.get("targets", (ALL_LINEAR,)))}) if lora else None
    return TorchTrainer(
        directory, TrainerSettings(micro_batch_tokens=budget, **SETTINGS, **extra), max_response_tokens=MAX_TOKENS,
        temperature=0.7, seed=0, dtype=torch.float64, sharding=sharding, adapters=adapters,
    )


def dist_trainer(joined: Joined, model_dir: Path, budget: int = 10_000) -> DistTrainer:
    """Rank 0's sharded test trainer over `joined` (the follower makes its own with `make`)."""
    return DistTrainer(joined.channel, lambda d: make(d, joined.sharding, budget), str(model_dir))


def full_weights(trainer: TorchTrainer | DistTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in trainer.weight_buckets(1 << 30) for name, t in bucket}


def one_step(trainer: TorchTrainer | DistTrainer, chunks: list[list]) -> dict[str, float]:
    trainer.begin_step()
    for chunk in chunks:
        trainer.accumulate(chunk)
    return dict(trainer.finish_step())


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Sharded and unsharded float64 weights: equal to rounding."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


@contextlib.contextmanager
def recording_phases(log: Path, slow_offload_s: float = 0.0) -> Iterator[None]:
    """Append one JSON line to `log` as each of this process's trainer phases (`PHASES`)
    starts, each gather of a weight sync (`gather`), and `state_out` once an offload's
    state is out (after `slow_offload_s`), each with its time on the machine's monotonic
    clock (the same in every process)."""

    def note(event: str) -> None:
        with log.open("a") as f:
            f.write(json.dumps({"event": event, "t": time.monotonic()}) + "\n")

    def phase(name: str, fn: Any) -> Any:
        def noted(*args: Any, **kwargs: Any) -> Any:
            note(name)
            return fn(*args, **kwargs)

        return noted

    real_offload = StateOffload.offload

    def slow_offload(self: StateOffload, what: Any) -> None:
        time.sleep(slow_offload_s)
        real_offload(self, what)
        note("state_out")

    with pytest.MonkeyPatch.context() as patch:
        for name in PHASES:
            patch.setattr(TorchTrainer, name, phase(name, getattr(TorchTrainer, name)))
        patch.setattr(StateOffload, "offload", slow_offload)
        patch.setattr(fsdp, "full", phase("gather", fsdp.full))  # each tensor a sync gathers
        yield


def read_phases(log: Path) -> list[tuple[str, float]]:
    return [(e["event"], e["t"]) for e in map(json.loads, log.read_text().splitlines())]


@contextlib.contextmanager
def two_ranks(
    dp_replicate: int = 1, extra: dict[str, Any] | None = None, probe: Path | None = None,
    phases: Path | None = None, env: dict[str, str] | None = None,
) -> Iterator[Joined]:
    """This process as rank 0 and a follower subprocess as rank 1 (`follower_main`),
    stopped and checked (exit 0, nothing left running) on the way out. `extra`: the
    follower's trainer settings beyond `SETTINGS`; `probe`: where the follower writes what
    `tests.load_probe` saw it load, once stopped; `phases`: where the follower records
    its phases (`recording_phases`, its offloads `SLOW_OFFLOAD_S` slow); `env`: more of
    the follower's environment (`tests.faults.FAULT_FILE_ENV`: its checkpoint writes
    shown to the fault that file holds)."""
    from tests.procs import descendants, wait_gone

    port = free_port()
    follower = subprocess.Popen(
        [sys.executable, "-m", "tests.dist_harness", str(port), str(dp_replicate), json.dumps(extra or {}),
         str(probe or ""), str(phases or "")],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )
    rendezvous(port)
    joined = join(ParallelLayout(nproc_per_node=2, rank=0, dp_replicate=dp_replicate), timeout_s=120)
    try:
        yield joined
    finally:
        joined.channel.send([Signal.STOP, Signal.STOP])
        joined.close()
        try:
            follower.wait(timeout=60)
        finally:
            children = descendants(follower.pid)
            follower.kill()
            assert not wait_gone(children, 10)
        assert follower.returncode == 0, follower.stderr.read() if follower.stderr else ""


def follower_main(
    port: int, dp_replicate: int, extra: dict[str, Any], probe: Path | None, phases: Path | None
) -> None:
    from tests.faults import FAULT_FILE_ENV, follower_faults
    from tests.load_probe import spying

    rendezvous(port)
    joined = join(ParallelLayout(nproc_per_node=2, rank=1, dp_replicate=dp_replicate), timeout_s=120)
    recording = recording_phases(phases, SLOW_OFFLOAD_S) if phases is not None else contextlib.nullcontext()
    fault_file = os.environ.get(FAULT_FILE_ENV)
    faults = follower_faults(Path(fault_file)) if fault_file else contextlib.nullcontext()
    try:
        with recording, faults, spying() if probe is not None else contextlib.nullcontext() as seen:
            follow(joined.channel, lambda d: make(d, joined.sharding, **extra))
        if probe is not None:
            torch.save(seen, probe)
    finally:
        joined.close()


if __name__ == "__main__":
    port, replicate, extra, probe, phases = [*sys.argv[1:], "1", "{}", "", ""][:5]
    follower_main(
        int(port), int(replicate), json.loads(extra), Path(probe) if probe else None,
        Path(phases) if phases else None,
    )
