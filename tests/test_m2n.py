"""The `nccl_m2n` lane (`rpk.sync.m2n_lane`) and its plan (`rpk.sync.m2n_plan`) against
vLLM 0.32's m2n contract.

- The plan: for FSDP 2/4/8 x TP 1/2/4 over a Qwen2.5-0.5B-shaped parameter list, every
  worker receives its destination box of every parameter exactly once, each piece from
  a trainer rank that holds it (no rank sends more than its own shard: nothing is
  gathered), and the plan accepts and rejects what vLLM's own layout checks do.
- The lane with recording fakes: what it sent is rebuilt into vLLM's
  `M2NWeightTransferInitInfo` and `M2NWeightTransferUpdateInfo`, and validated with
  vLLM's worker-side layout checks; one group per replica, the version only after
  finish, a failing replica named.
- For real on CPU: a two-rank gloo `DistTrainer` (this process and a follower) sends
  its shards over gloo standing in for NCCL into a TP-1 and a TP-2 replica of
  `GlooM2NWorker`s (the receiving end of rpk's `gloo_m2n` engine) given GPU-like,
  partly sharded destinations; what they receive equals the trainer's gathered
  weights. Real vLLM replicas: tests/integration/test_m2n_sync.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from rpk.sync import m2n_plan as mp
from rpk.sync.backends import Backend, resolve
from rpk.sync.m2n_send import ShardBucket
from tests.replicas import FakeReplica

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

# Qwen2.5-0.5B (docs: /work/shared/GPU-BOX.md): hidden 896, 24 layers, 14/2 heads, 4864, 151936.
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 896, 14, 2, 4864, 151936
KV = HIDDEN // HEADS * KV_HEADS


def qwen_shapes(layers: int = 2) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (KV, HIDDEN), p + "self_attn.k_proj.bias": (KV,),
            p + "self_attn.v_proj.weight": (KV, HIDDEN), p + "self_attn.v_proj.bias": (KV,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        })
    shapes["model.norm.weight"] = (HIDDEN,)
    return shapes


def vllm_destination(name: str) -> mp.Placements | None:
    """Where vLLM's `resolve_parameter_destinations` puts a Qwen2 parameter: q/k/v and
    gate/up are parts of fused vLLM parameters (`qkv_proj`, `gate_up_proj`) and the
    embedding's loader is not one m2n writes directly, so they arrive whole for
    `load_weights`; a row-parallel weight (`o_proj`, `down_proj`) is sharded on dim 1 over
    the TP axis and written in place; a norm is replicated, whole."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (mp.REPLICATE, 1)
    return None


def fsdp_layouts(shapes: dict[str, tuple[int, ...]], dtype: str = "bfloat16") -> list[mp.ParamLayout]:
    return [mp.ParamLayout(n, dtype, s, (0, mp.REPLICATE)) for n, s in shapes.items()]


def _volume(box: mp.Box) -> int:
    return math.prod(b - a for a, b in box)


def _inside(inner: mp.Box, outer: mp.Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def _disjoint(a: mp.Box, b: mp.Box) -> bool:
    return any(a1 <= b0 or b1 <= a0 for (a0, a1), (b0, b1) in zip(a, b))


@pytest.mark.parametrize("ranks,tp", list(itertools.product([2, 4, 8], [1, 2, 4])))
def test_every_worker_gets_each_byte_once_from_a_rank_that_holds_it(ranks: int, tp: int) -> None:
    shapes = qwen_shapes()
    layouts = fsdp_layouts(shapes)
    src, dst = mp.trainer_mesh((ranks,)), mp.replica_mesh(ranks, tp)
    destinations = [vllm_destination(p.name) for p in layouts]
    plan = mp.plan(layouts, src, dst, destinations)
    for layout, destination, pieces in zip(layouts, destinations, plan):
        total = math.prod(layout.shape)
        for worker in range(tp):
            want = mp.held_box(layout.shape, dst, destination, dst.start + worker)
            got = [p for p in pieces if p.dst == worker]
            # contained, pairwise disjoint, and as large as the box: an exact tiling
            assert all(_inside(p.box, want) for p in got), layout.name
            assert all(_disjoint(a.box, b.box) for a, b in itertools.combinations(got, 2)), layout.name
            assert sum(p.numel for p in got) == _volume(want), layout.name
            for p in got:
                assert _inside(p.box, mp.held_box(layout.shape, src, layout.placements, p.src))
        # no full gather anywhere: each rank sends a worker at most its own shard
        for rank, worker in itertools.product(range(ranks), range(tp)):
            sent = sum(p.numel for p in pieces if p.src == rank and p.dst == worker)
            assert sent <= total // ranks
        # what a replica gets in all: the whole tensor per whole-destination worker, else once
        expected = total * (tp if destination is None else 1)
        assert sum(p.numel for p in pieces) == expected
    # the sharded destinations really are sharded: a row-parallel weight's worker box is 1/tp
    o = next(i for i, p in enumerate(layouts) if p.name.endswith("0.self_attn.o_proj.weight"))
    assert {_volume(mp.held_box(layouts[o].shape, dst, destinations[o], dst.start + w))
            for w in range(tp)} == {HIDDEN * HIDDEN // tp}


def test_pieces_rebuild_the_tensors_with_fsdp_on_a_2d_mesh_and_replicated_sources() -> None:
    """Small tensors moved for real by the plan: HSDP's (replicate, shard) mesh, a tensor
    every rank holds whole (sent round-robin by the ranks), a worker-sharded one."""
    gen = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(8, 6, generator=gen), "b": torch.randn(4, generator=gen),
            "c": torch.randn(4, 8, 2, generator=gen)}
    src = mp.trainer_mesh((2, 4))  # HSDP: 2 replicas of a 4-way shard
    layouts = [mp.ParamLayout("a", "float32", (8, 6), (mp.REPLICATE, 0)),
               mp.ParamLayout("b", "float32", (4,), None),
               mp.ParamLayout("c", "float32", (4, 8, 2), (mp.REPLICATE, 1))]
    tp = 2
    dst = mp.replica_mesh(src.size, tp)
    destinations: list[mp.Placements | None] = [(mp.REPLICATE, 1), None, (mp.REPLICATE, 0)]
    senders: set[int] = set()
    for layout, destination, pieces in zip(layouts, destinations, mp.plan(layouts, src, dst, destinations)):
        held = {r: mp.held_box(layout.shape, src, layout.placements, r) for r in range(src.size)}
        local = {r: full[layout.name][tuple(slice(a, b) for a, b in box)] for r, box in held.items()}
        for worker in range(tp):
            origin = mp.held_box(layout.shape, dst, destination, dst.start + worker)
            out = torch.full([b - a for a, b in origin], float("nan"))
            for p in (p for p in pieces if p.dst == worker):
                part = local[p.src][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(p.box, held[p.src]))]
                out[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(p.box, origin))] = part
                senders.add(p.src)
            assert torch.equal(out, full[layout.name][tuple(slice(a, b) for a, b in origin)])
    assert senders == set(range(src.size))  # the HSDP replicas share the sending


@needs_vllm
def test_the_plan_mirrors_vllms_own_bounds_and_checks() -> None:
    from vllm.distributed.weight_transfer import m2n_common as vm

    assert (mp.REPLICATE, mp.MAX_TENSOR_DIMS) == (vm.REPLICATE, vm.MAX_TENSOR_DIMS)
    assert (mp.MAX_SOURCE_SHARDS, mp.MAX_DEST_SHARDS) == (vm.MAX_SOURCE_SHARDS, vm.MAX_DEST_SHARDS)
    assert mp.SUPPORTED_DTYPES == {str(d).removeprefix("torch.") for d in vm.SUPPORTED_DTYPES}
    cases = [
        (mp.ParamLayout("ok", "bfloat16", (896, 64), (0, mp.REPLICATE)), 8, 2, (mp.REPLICATE, 1)),
        (mp.ParamLayout("uneven", "bfloat16", (10, 4), (0, mp.REPLICATE)), 4, 1, None),
        (mp.ParamLayout("uneven_tp", "bfloat16", (8, 6), (0, mp.REPLICATE)), 2, 4, (mp.REPLICATE, 1)),
        (mp.ParamLayout("fan_in", "float32", (64, 2), (0, mp.REPLICATE)), 32, 1, None),
        (mp.ParamLayout("fan_in_sharded", "float32", (64, 4), (0, mp.REPLICATE)), 32, 4, (mp.REPLICATE, 1)),
        (mp.ParamLayout("4d", "float32", (2, 2, 2, 2), (0, mp.REPLICATE)), 2, 1, None),
        (mp.ParamLayout("both_axes", "float32", (4, 4), (0, 1)), 2, 1, None),
    ]
    rejected = set()
    for layout, ranks, tp, destination in cases:
        src, dst = mp.trainer_mesh((ranks,)), mp.replica_mesh(ranks, tp)
        try:
            mp.check(layout, src, dst, destination)
            ours = None
        except mp.M2NPlanError as e:
            ours = str(e)
            assert repr(layout.name) in ours
        try:
            vm.check_transferable(layout.name, getattr(torch, layout.dtype), layout.shape)
            s = vm.resolve_layout(vm.M2NMesh(src.dims, 0), layout.placements)
            vm.validate_layout(*s, layout.shape, "source")
            d = vm.resolve_layout(vm.M2NMesh(dst.dims, dst.start), destination)
            vm.validate_layout(*d, layout.shape, "destination")
            vm.check_plan_limits(s, d, layout.name)
            theirs = None
        except ValueError as e:
            theirs = str(e)
        assert (ours is None) == (theirs is None), (layout.name, ours, theirs)
        if ours is not None:
            rejected.add(layout.name)
    assert rejected == {"uneven", "uneven_tp", "fan_in", "4d", "both_axes"}


# -- the lane against recording fakes ------------------------------------------------------


class RecordingEnd:
    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.Tensor]] = []
        self.closed = False

    def reshard(self, bucket: Any) -> None:
        assert not self.closed
        self.sent += bucket

    def close(self) -> None:
        self.closed = True


class FakeShards:
    """A sharded trainer of `ranks` FSDP ranks seen from rank 0: its layouts, its shards."""

    def __init__(self, full: dict[str, torch.Tensor], ranks: int) -> None:
        self.full, self.ranks = full, ranks
        self.mesh = mp.trainer_mesh((ranks,))
        self.opened: list[tuple[str, tuple[Any, ...]]] = []
        self.ends: list[RecordingEnd] = []
        self.closes = 0

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]:
        return self.mesh, [mp.ParamLayout(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), (0, mp.REPLICATE))
                           for n, t in self.full.items()]

    async def open_shards(self, backend: str, groups: Any) -> RecordingEnd:
        self.opened.append((backend, tuple(groups)))
        self.ends.append(RecordingEnd())
        return self.ends[-1]

    async def close_shards(self) -> None:
        self.closes += 1

    async def digests(self) -> dict[str, str]:
        from rpk.sync.verify import digest

        return {n: digest(t) for n, t in self.full.items()}

    async def buckets(self, per: int = 2):
        items = [(n, t.chunk(self.ranks)[0]) for n, t in self.full.items()]  # rank 0's shards
        for i in range(0, len(items), per):
            yield ShardBucket(items[i:i + per])


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randn(*s, generator=gen).to(torch.bfloat16)
            for n, s in {"model.embed_tokens.weight": (16, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
                         "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.norm.weight": (8,)}.items()}


def _transport(shards: Any, backend: Backend = Backend.NCCL_M2N) -> Any:
    from rpk.sync.transport import make_transport

    return make_transport(backend, shards=shards)


@needs_vllm
@pytest.mark.parametrize("ranks", [2, 4])
async def test_the_m2n_lane_sends_what_vllm_accepts(ranks: int) -> None:
    from vllm.distributed.weight_transfer import m2n_common as vm
    from vllm.distributed.weight_transfer.m2n_engine import (
        M2NWeightTransferInitInfo,
        M2NWeightTransferUpdateInfo,
    )


    full = _full()
    shards = FakeShards(full, ranks)
    a, b = FakeReplica("tp1.0", "nccl_m2n", tp=1), FakeReplica("tp2.0", "nccl_m2n", tp=2)
    transport = _transport(shards)
    await transport.push(shards.buckets(), [a, b], version=4)

    ((backend, groups),) = shards.opened
    assert backend == "nccl" and [g.tp for g in groups] == [1, 2]
    assert len({g.port for g in groups}) == 2  # one group per replica
    for r, g in zip((a, b), groups):
        info = M2NWeightTransferInitInfo(**r.llm.of("init")[0])  # vLLM's own checks
        assert (info.master_address, info.master_port) == (g.address, g.port)
        assert info.rank_offset == ranks and info.world_size == ranks + g.tp
        assert info.src_mesh_dims == [ranks, 1] and info.dst_mesh_dims == [1, g.tp]
        assert info.names == list(full)
        # the worker's own init-time checks (`M2NWeightTransferEngine.init_transfer_engine`)
        src_mesh = vm.M2NMesh(tuple(info.src_mesh_dims), 0)
        assert src_mesh.size == info.rank_offset
        for name, dtype, shape, placements in zip(info.names, info.dtype_names, info.shapes,
                                                  info.src_placements):
            vm.check_transferable(name, getattr(torch, dtype), shape)
            vm.validate_layout(*vm.resolve_layout(src_mesh, tuple(placements)), shape, "source")
            assert getattr(torch, dtype) == full[name].dtype and shape == list(full[name].shape)
        updates = [M2NWeightTransferUpdateInfo(**u) for u in r.llm.of("update")]
        assert [n for u in updates for n in u.names] == list(full)
        assert [w for w, _ in r.llm.calls] == ["init", "start", "update", "update", "finish"]
        assert r.weight_version == 4
    # rank 0 sent its own shards only, each once: 1/ranks of every tensor
    (end,) = shards.ends
    assert [n for n, _ in end.sent] == list(full)
    assert all(t.numel() * ranks == full[n].numel() for n, t in end.sent)

    await transport.push(shards.buckets(), [a, b], version=5)  # the same set keeps its groups
    assert len(shards.opened) == 1
    await transport.push(shards.buckets(), [b], version=6)  # a regroup: new groups
    assert end.closed and shards.closes == 1 and len(shards.opened) == 2
    assert a.llm.of("shutdown") == [None]


@needs_vllm
@pytest.mark.parametrize("env, address", [
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.7"}, "10.0.0.7"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.7"}, "127.0.0.1"),
    ({}, "127.0.0.1"),
])
async def test_m2n_groups_meet_at_node_0_when_trainer_ranks_span_nodes(env: dict, address: str) -> None:
    """Issue 30, defect 10: a rank on node 1 told 127.0.0.1 would join its own localhost."""
    from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo

    from rpk.sync.transport import make_transport

    shards = FakeShards(_full(), 2)
    r = FakeReplica("tp1.0", "nccl_m2n")
    await make_transport(Backend.NCCL_M2N, shards=shards, env=env).push(shards.buckets(), [r], version=1)
    ((_, groups),) = shards.opened
    assert [g.address for g in groups] == [address]
    assert M2NWeightTransferInitInfo(**r.llm.of("init")[0]).master_address == address


def test_m2n_across_nodes_without_master_addr_is_refused_naming_the_sizes() -> None:
    from rpk.sync.transport import rendezvous_address

    with pytest.raises(ValueError, match=r"WORLD_SIZE=16, LOCAL_WORLD_SIZE=8.*MASTER_ADDR"):
        rendezvous_address({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})


@needs_vllm
async def test_a_replica_failing_in_an_m2n_sync_is_named_and_nobody_takes_the_version() -> None:
    from rpk.sync.lanes import WeightSyncError

    shards = FakeShards(_full(), 2)
    good, bad = FakeReplica("tp1.0", "nccl_m2n"), FakeReplica("tp1.1", "nccl_m2n", fail_on="update")
    with pytest.raises(WeightSyncError, match=r"replica tp1\.1 failed in update_weights"):
        await _transport(shards).push(shards.buckets(), [good, bad], version=2)
    assert good.weight_version == 0 and bad.weight_version == 0
    assert good.llm.of("finish") == [] and shards.ends[0].closed


@needs_vllm
async def test_a_verified_m2n_sync_compares_the_workers_with_the_trainers_whole_tensors() -> None:
    """The buckets are rank 0's shards, so the trainer's digests are asked for after
    the sync (a gather of whole tensors), not hashed from them."""
    from rpk.sync.transport import make_transport
    from rpk.sync.verify import WeightMismatchError, digest

    full = _full()
    shards = FakeShards(full, 2)
    good, bad = FakeReplica("tp1.0", "gloo_m2n"), FakeReplica("tp1.1", "gloo_m2n")
    good.llm.digests = {n: digest(t) for n, t in full.items()}
    bad.llm.digests = {**good.llm.digests, "model.norm.weight": digest(full["model.norm.weight"].chunk(2)[0])}
    transport = make_transport(Backend.GLOO_M2N, verify=True, shards=shards)
    await transport.push(shards.buckets(), [good], version=1)
    assert good.weight_version == 1
    with pytest.raises(WeightMismatchError, match=r"replica tp1\.1 \(worker 0\) differs from the trainer "
                                                  r"at 'model\.norm\.weight'"):
        await transport.push(shards.buckets(), [good, bad], version=2)
    assert bad.weight_version is None


def test_auto_takes_m2n_only_for_a_sharded_trainer_off_the_fleets_gpus() -> None:
    from rpk.engine.placement import fleet_plan
    from rpk.sync.backends import for_replica
    from rpk.sync.transport import make_transport
    from rpk.sync.verify import VerifiedTransport

    plan = fleet_plan((4, 5, 6, 7), (1, 2), 1, False)
    assert resolve("auto", "cuda", set(plan.devices), 0, (0, 1, 2, 3)).local == "nccl_m2n"
    assert for_replica(Backend.NCCL_M2N, (4,)) is Backend.NCCL_M2N
    # a replica on any trainer rank's GPU: NCCL would hold two ranks on one device
    assert resolve("auto", "cuda", set(plan.devices), 0, (0, 1, 2, 4)).local == "cuda"
    assert resolve("auto", "cuda", set(plan.devices), 0, (0,)).local == "cuda"  # not sharded
    assert resolve("auto", "cpu", set(plan.devices), 0, (0, 1)).local == "cpu_ipc"
    # asked for: vLLM's on GPU, the same protocol over gloo on CPU
    assert resolve("m2n", "cuda", set(plan.devices)).local == "nccl_m2n"
    assert resolve("m2n", "cpu", set(plan.devices)).local == "gloo_m2n"
    with pytest.raises(ValueError, match="nccl_m2n"):
        make_transport(Backend.NCCL_M2N)
    with pytest.raises(ValueError, match="gloo_m2n"):
        make_transport(Backend.GLOO_M2N)
    with pytest.raises(ValueError, match="nccl_m2n cannot be verified"):
        make_transport(Backend.NCCL_M2N, verify=True, shards=FakeShards(_full(), 2))
    verified = make_transport(Backend.GLOO_M2N, verify=True, shards=FakeShards(_full(), 2))
    assert isinstance(verified, VerifiedTransport)


def test_m2n_asks_for_a_sharded_trainer() -> None:
    from rpk import assembly
    from rpk.config import ConfigError, from_argv
    from rpk.gpu.layout import ParallelLayout

    cfg = from_argv(["--rollout.weight_transfer", "m2n"])
    for layout in (None, ParallelLayout()):
        with pytest.raises(ConfigError, match=r"rollout\.weight_transfer.*needs a sharded trainer"):
            assembly.place(cfg.rollout, layout)
    two = assembly.place(cfg.rollout, ParallelLayout(nproc_per_node=2))
    assert two.layout is not None and two.layout.distributed


# -- for real on CPU: gloo trainer ranks, gloo standing in for NCCL -------------------------


class GlooReplicaLLM:
    """A replica's weight-sync surface over rpk's `GlooM2NWorker`s (the receiving end of
    the `gloo_m2n` engine) given Qwen's destinations on GPU (`vllm_destination`, some
    sharded): vLLM's init and update infos rebuilt from the requests, each worker in its
    own thread as a worker process would."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.workers: list[Any] = []
        self.received: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        self.calls: list[str] = []

    async def init_weight_transfer_engine(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo

        from rpk.sync.worker.gloo_m2n import GlooM2NWorker

        info = M2NWeightTransferInitInfo(**request.init_info)
        destinations = [vllm_destination(n) for n in info.names]
        self.workers = list(await asyncio.gather(
            *(asyncio.to_thread(GlooM2NWorker, info, w, destinations, 60.0) for w in range(self.tp))))
        self.calls.append("init")

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def update_weights(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferUpdateInfo

        names = M2NWeightTransferUpdateInfo(**request.update_info).names

        def receive(worker: Any) -> list[tuple[str, torch.Tensor]]:
            out = []
            for name in names:
                index = worker.index[name]
                layout = worker.layouts[index]
                buffer = torch.empty([b - a for a, b in worker.box(index)], dtype=getattr(torch, layout.dtype))
                worker.receive(index, buffer)
                out.append((name, buffer))
            return out

        got = await asyncio.gather(*(asyncio.to_thread(receive, w) for w in self.workers))
        for mine, parts in zip(self.received, got):
            mine.update(parts)
        self.calls.append("update")

    async def finish_weight_update(self, version: str | None = None) -> None:
        self.calls.append("finish")

    async def shutdown_weight_transfer_engine(self) -> None:
        for w in self.workers:
            w.close()
        self.calls.append("shutdown")


class ThreadRanks:
    """`ShardSenders` of a trainer whose FSDP ranks are threads of this process, each
    with its own real gloo ends (`open_ends`): rank 0's go to the lane, the others
    reshard their shards from their threads, as `follow` does."""

    def __init__(self, full: dict[str, torch.Tensor], ranks: int) -> None:
        self.full, self.ranks = full, ranks
        self.mesh = mp.trainer_mesh((ranks,))
        self.others: list[Any] = []
        self.threads: list[Any] = []

    def layouts(self) -> list[mp.ParamLayout]:
        return [mp.ParamLayout(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), (0, mp.REPLICATE))
                for n, t in self.full.items()]

    async def shard_layout(self) -> tuple[mp.Mesh, list[mp.ParamLayout]]:
        return self.mesh, self.layouts()

    async def open_shards(self, backend: str, groups: Any) -> Any:
        from rpk.sync.m2n_send import open_ends

        ends = await asyncio.gather(*(asyncio.to_thread(open_ends, backend, r, self.mesh, self.layouts(), groups, 30)
                                      for r in range(self.ranks)))
        self.others = list(ends[1:])
        return ends[0]

    async def close_shards(self) -> None:
        for end in self.others:
            end.close()

    def shards(self, rank: int) -> list[list[tuple[str, torch.Tensor]]]:
        items = [(n, t.chunk(self.ranks)[rank]) for n, t in self.full.items()]
        return [items[i:i + 2] for i in range(0, len(items), 2)]

    async def buckets(self):
        import threading

        for rank, end in enumerate(self.others, start=1):
            thread = threading.Thread(target=lambda e=end, r=rank: [e.reshard(b) for b in self.shards(r)])
            thread.start()
            self.threads.append(thread)
        for bucket in self.shards(0):
            yield ShardBucket(bucket)


@needs_vllm
@pytest.mark.parametrize("ranks", [2, 4])
async def test_gloo_trainer_ranks_as_threads_reshard_into_tp1_and_tp2_replicas(ranks: int) -> None:
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(2)
    full = {n: torch.randn(*s, generator=gen)
            for n, s in {"model.embed_tokens.weight": (16, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
                         "model.layers.0.self_attn.q_proj.weight": (8, 8),
                         "model.layers.0.mlp.down_proj.weight": (8, 16), "model.norm.weight": (8,)}.items()}
    trainer = ThreadRanks(full, ranks)
    replicas = []
    for name, tp in (("tp1.0", 1), ("tp2.0", 2)):
        replica = SimpleNamespace(name=name, llm=GlooReplicaLLM(tp), weight_version=0,
                                  settings=SimpleNamespace(tensor_parallel_size=tp, backend=Backend.GLOO_M2N))

        async def loaded(version: int, started: float, r: Any = replica) -> None:
            r.weight_version = version

        replica.weights_loaded = loaded
        replicas.append(replica)
    transport = _transport(trainer, Backend.GLOO_M2N)
    try:
        await asyncio.wait_for(transport.push(trainer.buckets(), replicas, version=1), 60)
    finally:
        await transport.close()
        for thread in trainer.threads:
            thread.join(10)
    for replica in replicas:
        assert replica.weight_version == 1
        for worker, got in enumerate(replica.llm.received):
            assert got.keys() == full.keys()
            for n, t in got.items():
                want = full[n] if vllm_destination(n) is None else full[n].chunk(replica.llm.tp, dim=1)[worker]
                assert torch.equal(t, want), (replica.name, worker, n)


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Any]:
    from tests.dist_harness import two_ranks as harness_two_ranks

    with harness_two_ranks() as joined:
        yield joined


@pytest.fixture(scope="module")
def odd_vocab_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A vocabulary of 63 rows, which FSDP2 shards unevenly over 2 ranks (it pads)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    path = tmp_path_factory.mktemp("odd-vocab")
    torch.manual_seed(8)
    config = Qwen2Config(vocab_size=63, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(63)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    return path


@needs_vllm
@pytest.mark.parametrize("model", ["tied_model_dir", "odd_vocab_model_dir"])
async def test_two_gloo_trainer_ranks_send_their_shards_into_tp1_and_tp2_replicas(
    two_ranks: Any, model: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an odd vocabulary the embedding alone is gathered and sent whole (m2n moves
    only even shards); every other tensor still leaves as each rank's own shard."""
    from types import SimpleNamespace

    from rpk.loop.trainer import AsyncTrainer
    from rpk.sync.m2n_lane import TrainerShards
    from rpk.train.dist import DistTrainer
    from tests.dist_harness import make

    model_dir: Path = request.getfixturevalue(model)
    trainer = DistTrainer(two_ranks.channel, lambda d: make(d, two_ranks.sharding), str(model_dir))
    driven = AsyncTrainer(trainer)
    ready = asyncio.get_running_loop().create_future()
    ready.set_result(driven)

    def buckets():
        return driven.weight_buckets(4_000)

    replicas = []
    for name, tp in (("tp1.0", 1), ("tp2.0", 2)):
        llm = GlooReplicaLLM(tp)
        replica = SimpleNamespace(name=name, llm=llm, weight_version=0,
                                  settings=SimpleNamespace(tensor_parallel_size=tp, backend=Backend.GLOO_M2N))

        async def loaded(version: int, started: float, r: Any = replica) -> None:
            r.weight_version = version

        replica.weights_loaded = loaded
        replicas.append(replica)
    transport = _transport(TrainerShards(ready), Backend.GLOO_M2N)
    with monkeypatch.context() as patch:
        import rpk.train.fsdp as fsdp

        gathered: list[tuple[int, ...]] = []
        full_tensor = DTensor.full_tensor

        def no_gather(t: torch.Tensor) -> torch.Tensor:
            raise AssertionError("a gathered weight bucket during an nccl_m2n sync")

        def counted(t: Any) -> torch.Tensor:
            gathered.append(tuple(t.shape))
            return full_tensor(t)

        patch.setattr(fsdp, "full", no_gather)  # rank 0's; the follower runs the same code
        patch.setattr(DTensor, "full_tensor", counted)
        try:
            await asyncio.wait_for(transport.push(buckets(), replicas, version=1), 120)
            await asyncio.wait_for(transport.push(buckets(), replicas, version=2), 120)
        finally:
            await transport.close()
            driven.compute.close()
    # the groups are gone and the trainer gathers again: the reference weights
    full = {n: t.clone() for bucket in trainer.weight_buckets(1 << 30) for n, t in bucket}
    mesh, layouts = trainer.shard_layout()
    assert mesh.dims == (2, 1) and [p.name for p in layouts] == list(full)
    whole = [p.name for p in layouts if p.placements is None]
    if model == "odd_vocab_model_dir":  # 63 rows: gathered, once a sync
        assert whole == ["model.embed_tokens.weight"] and gathered == [(63, 32)] * 2
    else:
        assert whole == [] and gathered == []
    for replica in replicas:
        assert replica.weight_version == 2
        lifecycle = [w for w, _ in itertools.groupby(replica.llm.calls)]
        assert lifecycle == ["init", "start", "update", "finish", "start", "update", "finish", "shutdown"]
        assert replica.llm.calls.count("update") > 2  # several buckets a sync
        tp = replica.llm.tp
        for worker, got in enumerate(replica.llm.received):
            assert got.keys() == full.keys()
            for name, t in got.items():
                destination = vllm_destination(name)
                want = full[name] if destination is None else full[name].chunk(tp, dim=1)[worker]
                assert torch.equal(t, want), (replica.name, worker, name)


# -- the trainer commands, without processes ------------------------------------------------


class ScriptedChannel:
    """Rank 0's sends recorded, or a follower's receives scripted."""

    def __init__(self, rank: int = 0, world: int = 2, script: list[Any] | None = None) -> None:
        self.rank, self.world = rank, world
        self.sent: list[list[Any]] = []
        self._script = list(script or [])

    def send(self, messages: list[Any]) -> Any:
        self.sent.append(list(messages))
        return messages[0]

    def receive(self) -> Any:
        return self._script.pop(0)


class ShardedLocal:
    """A rank's trainer with the surface the commands use; a gather is an error."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def weight_shards(self, max_bytes: int):
        yield ShardBucket([("w", torch.full((2,), float(self.rank)))])
        yield ShardBucket([("b", torch.full((1,), float(self.rank)))])

    def weight_buckets(self, max_bytes: int):
        raise AssertionError("a gather while nccl_m2n groups are open")

    def shard_layout(self) -> Any:
        return mp.trainer_mesh((2,)), []


def test_every_rank_joins_sends_its_own_shards_and_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    import rpk.train.dist as d
    from rpk.sync.m2n_send import ShardGroup

    joined: list[tuple[int, Any]] = []

    def join(trainer: Any, command: Any, rank: int) -> RecordingEnd:
        joined.append((rank, command))
        return RecordingEnd()

    monkeypatch.setattr(d, "join_shards", join)
    groups = (ShardGroup("127.0.0.1", 1234, 2),)

    # rank 0: the commands it sends and what it hands the lane
    channel = ScriptedChannel()
    trainer = d.DistTrainer(channel, lambda _: ShardedLocal(0), "model")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no nccl_m2n groups open"):
        trainer.shard_buckets(100)
    end = trainer.open_shards("gloo", groups)
    assert channel.sent[-1] == [d.JoinShards("gloo", groups)] * 2 and joined == [(0, d.JoinShards("gloo", groups))]
    buckets = list(trainer.weight_buckets(100))
    assert channel.sent[-1] == [d.Weights(100, shards=True)] * 2
    assert [n for b in buckets for n, _ in b] == ["w", "b"]
    assert all(isinstance(b, ShardBucket) for b in buckets)  # typed as shards, for the lane and the verifier
    trainer.close_shards()
    assert end.closed and channel.sent[-1] == [d.Signal.LEAVE_SHARDS] * 2
    trainer.close_shards()  # closed once: nothing more is sent
    assert len(channel.sent) == 4  # Build, JoinShards, Weights, LeaveShards

    # a follower: joins, reshards its own shards through its end, leaves
    follower_ends: list[RecordingEnd] = []
    monkeypatch.setattr(d, "join_shards", lambda t, c, r: follower_ends.append(RecordingEnd()) or follower_ends[-1])
    script = [d.Build("model"), d.JoinShards("gloo", groups), d.Weights(100, shards=True),
              d.Signal.LEAVE_SHARDS, d.Signal.STOP]
    d.follow(ScriptedChannel(rank=1, script=script), lambda _: ShardedLocal(1))  # type: ignore[arg-type]
    (fend,) = follower_ends
    assert [n for n, _ in fend.sent] == ["w", "b"] and all(torch.all(t == 1.0) for _, t in fend.sent)
    assert fend.closed

    with pytest.raises(RuntimeError, match="before joining"):
        d.follow(ScriptedChannel(rank=1, script=[d.Build("m"), d.Weights(1, shards=True)]),
                 lambda _: ShardedLocal(1))  # type: ignore[arg-type]


# -- the NCCL branch, CUDA patched out: the same reshards as vLLM's own trainer engine ------


class FakeM2N:
    """`nccl.m2n` recording each `reshard` (the package is CUDA-only and not installed)."""

    def __init__(self) -> None:
        from dataclasses import make_dataclass

        self.Mesh = make_dataclass("Mesh", ["dims", "start_rank"], frozen=True)
        self.Shard = make_dataclass("Shard", ["dim"], frozen=True)
        self.Replicate = make_dataclass("Replicate", [], frozen=True)
        self.Config = make_dataclass("Config", ["max_cta"], frozen=True)
        self.calls: list[dict[str, Any]] = []
        self.destroyed = 0
        fake = self

        class Handle:
            @staticmethod
            def create(config: Any) -> Any:
                return Handle()

            def destroy(self) -> None:
                fake.destroyed += 1

        self.Handle = Handle

    def reshard(self, src: Any, dst: Any, comm: int, stream: Any, **kw: Any) -> None:
        self.calls.append({"src": src.clone(), "dst": dst, "comm": comm, **kw})


@needs_vllm
@pytest.mark.parametrize("ranks,tp", [(2, 1), (4, 2), (8, 4)])
def test_the_nccl_branch_reshards_as_vllms_trainer_engine_does(
    monkeypatch: pytest.MonkeyPatch, ranks: int, tp: int,
) -> None:
    import vllm.distributed.weight_transfer.m2n_common as vm
    import vllm.distributed.weight_transfer.m2n_trainer as vt
    import vllm.distributed.weight_transfer.nccl_common as vn
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

    from rpk.sync.backends import Wire
    from rpk.sync.m2n_send import ShardGroup, open_ends

    fake = FakeM2N()
    monkeypatch.setattr(vm, "import_m2n", lambda: fake)
    stream = SimpleStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    comms: list[Any] = []

    def trainer_init(info: dict, rank: int = 0) -> Any:
        from types import SimpleNamespace

        comms.append(SimpleNamespace(comm=1000 + len(comms), info=info, rank=rank,
                                     destroy=lambda: comms.append("destroyed")))
        return comms[-1]

    monkeypatch.setattr(vn, "trainer_init", trainer_init)
    # Qwen's parameter list at 1/8 of its width, so that it divides over 8 ranks and TP 4
    gen = torch.Generator().manual_seed(3)
    small = {n: torch.randn(*(d // 64 * 8 for d in s), generator=gen) for n, s in qwen_shapes(layers=1).items()}
    destinations = [vllm_destination(n) for n in small]
    monkeypatch.setattr(vm, "publish_destination_placements",
                        lambda comm, first, mine, n: list(destinations) if mine is None and n == len(small) else None)
    layouts = fsdp_layouts({n: tuple(t.shape) for n, t in small.items()}, "float32")
    src = mp.trainer_mesh((ranks,))
    rank = ranks - 1  # the last rank: a follower, whose sends are its own shards too
    local = [(n, t.chunk(ranks)[rank]) for n, t in small.items()]

    end = open_ends(Wire.NCCL, rank, src, layouts, [ShardGroup("10.0.0.1", 29500, tp)])
    end.reshard(local[:3])
    end.reshard(local[3:])
    ours = list(fake.calls)
    (comm,) = comms
    assert comm.info == {"master_address": "10.0.0.1", "master_port": 29500, "world_size": ranks + tp}
    assert comm.rank == rank
    end.close()
    assert fake.destroyed == 1 and comms[-1] == "destroyed"

    # vLLM's own trainer engine, on the same rank with the same shards and plan
    class Source(M2NWeightSource):
        def mesh(self) -> Any:
            return vm.M2NMesh(src.dims, 0)

        def metadata(self) -> list[Any]:
            return [vm.M2NParamMeta(p.name, torch.float32, p.shape, p.placements) for p in layouts]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(local)

    fake.calls.clear()
    engine = vt.M2NTrainerWeightTransferEngine(client=None, source=Source(), is_controller=False,  # type: ignore[arg-type]
                                               num_trainer_ranks=ranks)
    engine._m2n, engine.group, engine._handle = fake, comm, fake.Handle.create(None)
    engine._src_mesh, engine._dst_mesh = vm.M2NMesh(src.dims, 0), vm.M2NMesh((1, tp), ranks)
    engine._metas, engine._dst_placements = Source().metadata(), list(destinations)
    engine._send()
    theirs = fake.calls
    assert len(ours) == len(theirs) == len(layouts)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.pop("src"), b.pop("src"))
        assert isinstance(a.pop("handle"), fake.Handle) and isinstance(b.pop("handle"), fake.Handle)
        assert a == b
    # each call carries only this rank's shard: nothing gathered
    assert all(c["dst"] is None for c in ours)


class SimpleStream:
    def synchronize(self) -> None:
        pass
