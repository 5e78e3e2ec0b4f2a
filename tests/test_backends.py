"""The weight path's backend table (`rpk.sync.backends`): what each backend is, how a
config's choice resolves, and that rpk's worker engines are registered by the names the
table gives, in the classes it names."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

from rpk.sync.backends import (
    BACKENDS,
    Backend,
    TrainerEnd,
    UnverifiableError,
    WeightPath,
    check_verifiable,
    for_replica,
    parse,
    reaches_nodes,
    resolve,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")


def test_every_backend_has_one_record_under_its_own_name() -> None:
    assert set(BACKENDS) == set(Backend)
    assert all(spec.backend is b for b, spec in BACKENDS.items())
    # Each engine a replica starts with is the backend's own name, or none at all.
    assert all(spec.engine in (None, b.value) for b, spec in BACKENDS.items())
    assert [b for b, s in BACKENDS.items() if s.trainer_end is TrainerEnd.SHARDS] == [
        Backend.NCCL_M2N, Backend.GLOO_M2N]
    assert [b for b, s in BACKENDS.items() if not s.verifiable] == [Backend.NCCL_M2N]


def test_the_unverifiable_backend_is_refused_once_naming_it() -> None:
    with pytest.raises(UnverifiableError, match=r"nccl_m2n cannot be verified \(run.verify_sync\)"):
        check_verifiable(Backend.NCCL_M2N)
    for b in Backend:
        if b is not Backend.NCCL_M2N:
            check_verifiable(b)
    with pytest.raises(ValueError, match=r"weight transfer 'nccl2' is none of \['shm', 'gloo'"):
        parse("nccl2")


def test_a_choice_resolves_to_one_backend() -> None:
    def local(*args: Any) -> Backend:
        return resolve(*args).local

    assert local("auto", "cpu", set(), 0) is Backend.CPU_IPC
    assert local("auto", "cuda", {0, 1}, 0) is Backend.CUDA
    assert local("auto", "cuda", {2, 3}, 0, (0, 1)) is Backend.NCCL_M2N
    assert local("m2n", "cpu", {0}, 0, (0,)) is Backend.GLOO_M2N
    assert local("shm", "cuda", {0}, 0) is Backend.SPOOL
    with pytest.raises(ValueError, match=r"weight_transfer=nccl with replicas on the trainer's GPUs \[0\]"):
        resolve("nccl", "cuda", {0, 1}, 0)
    with pytest.raises(ValueError, match=r"weight_transfer=m2n .* GPUs \[1\]"):
        resolve("m2n", "cuda", {1, 2}, 0, (0, 1))
    assert [for_replica(Backend.CUDA, d) for d in ((0,), (0, 1), (1,))] == [Backend.IPC, Backend.IPC, Backend.NCCL]
    assert for_replica(Backend.GLOO, (0,)) is Backend.GLOO


def test_other_nodes_take_gloo_or_the_http_spool() -> None:
    def remote(choice: str, platform: str) -> Backend:
        return resolve(choice, platform, {5}).remote

    assert [remote(c, "cpu") for c in ("auto", "cpu_ipc", "gloo", "shm")] == [
        Backend.GLOO, Backend.GLOO, Backend.GLOO, Backend.SPOOL]
    assert [remote(c, "cuda") for c in ("auto", "cpu_ipc", "gloo", "nccl")] == [
        Backend.SPOOL, Backend.SPOOL, Backend.GLOO, Backend.SPOOL]
    assert [c for c in ("shm", "gloo", "cpu_ipc", "auto", "ipc", "nccl", "m2n") if reaches_nodes(c)] == [
        "shm", "gloo", "cpu_ipc", "auto"]


def test_a_lora_runs_path_is_the_adapter_row_whatever_the_choice() -> None:
    """The adapter path is a row of the table, resolved with the rest: node 0's replicas
    and the other nodes' take adapter versions, no weight-transfer engine, verifiable."""
    for choice in ("auto", "shm", "gloo", "cpu_ipc"):
        path = resolve(choice, "cpu", {0}, adapter=True)
        assert path == WeightPath(Backend.ADAPTER, Backend.ADAPTER) and path.adapter and not path.sends_shards
    spec = BACKENDS[Backend.ADAPTER]
    assert spec.engine is None and spec.verifiable and spec.trainer_end is TrainerEnd.ADAPTER
    assert not resolve("auto", "cpu", {0}).adapter


def test_shm_names_the_spool_alone() -> None:
    """`shm` is the spool's files; cpu_ipc's handles are into host memory, under no name
    the user could take for the spool."""
    assert parse("shm") is Backend.SPOOL and BACKENDS[Backend.SPOOL].trainer_end is TrainerEnd.FILES
    assert BACKENDS[Backend.CPU_IPC].trainer_end is TrainerEnd.HOST_IPC
    assert [e.name for e in TrainerEnd if "SHM" in e.name] == []


@needs_vllm
def test_the_plugin_registers_each_worker_engine_the_table_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rpk.engine.plugin import register_weight_transfer
    from rpk.sync.worker.base import RpkWeightEngine

    registry: dict[str, Any] = {}
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", registry)
    register_weight_transfer()
    rpk_engines = {s.engine: s.worker for s in BACKENDS.values() if s.worker is not None}
    assert set(registry) == set(rpk_engines) == {"gloo", "cpu_ipc", "gloo_m2n"}
    for name, worker in rpk_engines.items():
        cls = getattr(importlib.import_module(worker.module), worker.cls)
        assert issubclass(cls, RpkWeightEngine), name
    register_weight_transfer()  # again: a no-op
    assert set(registry) == set(rpk_engines)


async def test_shards_are_hashed_by_asking_the_trainer_and_a_lane_of_shards_refuses_whole_tensors() -> None:
    from rpk.sync.m2n_lane import M2NLane
    from rpk.sync.m2n_send import ShardBucket
    from rpk.sync.verify import VerifiedTransport

    class Passing:
        async def push(self, buckets: Any, replicas: Any, version: int) -> None:
            async for _ in buckets:
                pass

        async def close(self) -> None:
            pass

    async def shards() -> Any:
        yield ShardBucket([("w", torch.zeros(2))])

    with pytest.raises(ValueError, match=r"version 3 went as shards \('w', \.\.\.\)"):
        await VerifiedTransport(Passing()).push(shards(), [], 3)
    lane = M2NLane([], senders=None, address="127.0.0.1", backend=Backend.GLOO_M2N)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"gloo_m2n lane sends this rank's shards, but got whole tensors \(\['w'\]"):
        await lane.send([("w", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"an m2n lane takes one of \['gloo_m2n', 'nccl_m2n'\], not 'gloo'"):
        M2NLane([], senders=None, address="127.0.0.1", backend=Backend.GLOO)  # type: ignore[arg-type]


def test_the_transport_is_the_tables_and_a_replica_carries_its_backend() -> None:
    """make_transport picks by the table's row: the adapter path wants the adapter's
    config and no other row takes one; a sync groups replicas by the `Backend` they were
    started with and refuses one with no weight-transfer engine, naming it."""
    import asyncio
    from types import SimpleNamespace

    from rpk.sync.adapter import AdapterTransport
    from rpk.sync.transport import CollectiveTransport, make_transport
    from rpk.sync.verify import VerifiedTransport

    with pytest.raises(ValueError, match="adapter needs the LoRA adapter's config"):
        make_transport(Backend.ADAPTER)
    with pytest.raises(ValueError, match="an adapter config with weight transfer gloo"):
        make_transport(Backend.GLOO, adapter={"r": 8})
    assert isinstance(make_transport(Backend.ADAPTER, adapter={"r": 8}), AdapterTransport)
    assert isinstance(make_transport(Backend.ADAPTER, verify=True, adapter={"r": 8}), VerifiedTransport)

    spooled = SimpleNamespace(name="tp1.0", settings=SimpleNamespace(backend=Backend.SPOOL))
    with pytest.raises(ValueError, match=r"replica tp1\.0 was started without a weight-transfer engine "
                                         r"\(its weights come as spool files, written once per sync\)"):
        asyncio.run(CollectiveTransport()._lanes_for([spooled]))
