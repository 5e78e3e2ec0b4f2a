"""Fake replicas. `ScriptReplica` stands behind an engine host (rpk.cluster.host) in place
of vLLM; `FakeReplica` (its `FakeLLM`) and `Opener` (its `FakeComm`s) record what the
weight-transfer lanes (rpk.sync) send, on CPU, for the tests to rebuild as vLLM would."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

from rpk.core.drafts import DraftSource, SourceCounts, SpecStats
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.sync.backends import Backend
from rpk.sync.lanes import CudaIpc

TOKEN = "s3cret"  # the engine host's token in the tests that serve one


# What `ScriptReplica.take_spec_stats` reports: one round's speculative counters.
SPEC = SpecStats(drafts=3, draft_tokens=9, accepted=4, drafted_by_pos=(3, 3, 3), accepted_by_pos=(2, 1, 1),
                 spec_steps=2, spec_step_tokens=7, spec_step_rows=3, steps=5,
                 by_source={DraftSource.PARTIAL: SourceCounts(3, 9, 4)})


class ScriptReplica:
    """Each request yields its prompt's tokens one by one (log-prob -token/10); a prompt
    starting with 0 never ends until aborted."""

    def __init__(self) -> None:
        self.weight_version: int | None = 0
        self.is_paused = False
        self.added_while_paused: list[bool] = []
        self.aborted: list[str] = []
        self.loaded: list[tuple[list[dict], int]] = []
        self.sleeping = False
        self.closed_early: list[str] = []  # streams closed before their end (VLLMEngine aborts these)
        self._abort: dict[str, asyncio.Event] = {}

    @property
    def max_concurrency(self) -> int:
        return 8

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False

    async def add(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        self.added_while_paused.append(self.is_paused)
        for r in requests:
            self._abort[r.request_id] = asyncio.Event()
        return {r.request_id: self._run(r) for r in requests}

    async def _run(self, r: GenRequest) -> AsyncIterator[GenDelta]:
        stop = self._abort[r.request_id]
        ended = False
        try:
            if r.prompt_token_ids[0] == 0:
                await stop.wait()
                ended = True
                yield GenDelta(r.request_id, (7,), (-0.5,), finished=True, finish_reason=FinishReason.ABORT)
                return
            last = len(r.prompt_token_ids) - 1
            for i, t in enumerate(r.prompt_token_ids):
                await asyncio.sleep(0.001)
                ended = i == last
                yield GenDelta(r.request_id, (t,), (-t / 10,), text=str(t), finished=ended,
                               finish_reason=FinishReason.STOP if ended else None)
        finally:
            if not ended:
                self.closed_early.append(r.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort[request_id].set()

    async def sleep(self) -> None:
        self.sleeping, self.weight_version = True, None

    async def wake(self) -> None:
        self.sleeping = False

    def take_stats(self) -> ReplicaStats:
        return ReplicaStats(preemptions=1, kv_usage_max=0.25, tokens_generated=3)

    async def load_weight_files(self, paths: Sequence[Path], version: int) -> None:
        self.loaded.append(([load_file(str(p)) for p in paths], version))
        self.weight_version = version

    async def set_drafts(self, schedule, sources, prompts) -> None:
        self.spec_rounds = getattr(self, "spec_rounds", []) + [(list(schedule), list(sources), list(prompts))]

    async def add_drafts(self, prompts) -> None:
        self.spec_added = getattr(self, "spec_added", []) + [list(prompts)]

    async def take_spec_stats(self) -> SpecStats:
        return SPEC

    async def shutdown(self) -> None:
        pass


async def drain(stream: AsyncIterator[GenDelta]) -> list[GenDelta]:
    return [d async for d in stream]


# -- the weight-transfer lanes' fakes ----------------------------------------


class FakeLLM:
    """The weight-sync surface of `AsyncLLM`, recording every call."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on = fail_on
        self.digests: dict[str, str] = {}

    async def _call(self, what: str, arg: Any = None) -> None:
        await asyncio.sleep(0)
        self.calls.append((what, arg))
        if what == self.fail_on:
            raise RuntimeError("EngineDeadError: the engine core died")

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self._call("init", request.init_info)

    async def start_weight_update(self) -> None:
        await self._call("start")

    async def update_weights(self, request: Any) -> None:
        await self._call("update", request.update_info)

    async def finish_weight_update(self, version: str | None = None) -> None:
        await self._call("finish", version)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._call("shutdown")

    async def collective_rpc(self, method: str) -> list[dict[str, str]]:
        assert method == "rpk_weight_digests"
        return [self.digests]

    def of(self, what: str) -> list[Any]:
        return [arg for w, arg in self.calls if w == what]


class FakeReplica:
    def __init__(
        self, name: str, backend: str, tp: int = 1, fail_on: str | None = None, devices: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.settings = SimpleNamespace(tensor_parallel_size=tp, backend=Backend(backend), devices=devices)
        self.llm = FakeLLM(fail_on)
        self.weight_version: int | None = 0

    async def weights_loaded(self, version: int, started: float) -> None:
        self.weight_version = version


class FakeComm:
    def __init__(self, backend: str, address: str, port: int, world: int) -> None:
        self.opened = (backend, address, port, world)
        self.sent: list[torch.Tensor] = []
        self.closed = False

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        assert not self.closed
        self.sent += tensors

    def close(self) -> None:
        self.closed = True


class Opener:
    def __init__(self) -> None:
        self.comms: list[FakeComm] = []

    def __call__(self, backend: str, address: str, port: int, world: int) -> FakeComm:
        self.comms.append(FakeComm(backend, address, port, world))
        return self.comms[-1]


def small_weights() -> dict[str, torch.Tensor]:
    """Four tensors of three dtypes, one a non-contiguous view."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(4, generator=gen),
        "model.norm.weight": torch.randn(4, 4, generator=gen)[:, 0],  # a non-contiguous view
    }


async def in_buckets(weights: dict[str, torch.Tensor], per: int = 2) -> AsyncIterator[list]:
    items = list(weights.items())
    for i in range(0, len(items), per):
        yield items[i:i + per]


def fake_cuda(share: Callable[[torch.Tensor], tuple[Any, ...]], device: int = 0) -> Any:
    """CUDA as the trainer's rank 0 would see it, on CPU: GPU d is "GPU-fake-uuid-d"."""
    return CudaIpc(share=share, uuid=lambda d: f"GPU-fake-uuid-{d}", put=lambda t, d: t.clone(),
                   device=device)
