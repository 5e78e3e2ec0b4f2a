"""The worker half of `nccl_m2n` with gloo standing in for NCCL: vLLM 0.32's
`M2NWeightTransferEngine`, registered as `gloo_m2n` by rpk's vLLM plugin, so that a CPU
run with a sharded trainer (every rank sending its own shards, none gathering) loads
them into real vLLM replicas.

It keeps vLLM's protocol whole: the same dataclasses (`M2NWeightTransferInitInfo` at
init, `M2NWeightTransferUpdateInfo`, names only, per update), the same group (trainer
ranks `[0, T)`, then the replica's workers), the destinations resolved by vLLM's own
`resolve_parameter_destinations` and published by the first worker, the others
checking theirs against it, and the same loading: a direct destination is written in
place, the others arrive whole and go through the model's `load_weights` under vLLM's
layerwise reload. Only the reshard differs: `nccl.m2n.reshard` is a CUDA collective,
so here each worker receives the pieces `rpk.sync.m2n_plan.pieces` assigns it, point
to point from the trainer ranks that hold them (`rpk.sync.m2n_send.GlooLink` sends them).

On CPU nothing is written in place: vLLM's CPU linear layers re-pack their weights when
they load and drop the parameter, so the kernels never read a parameter's storage;
every tensor takes the `load_weights` path (`allow_direct` off). The trainer's ranks
still each send only their own shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.m2n_engine import (
    M2NWeightTransferInitInfo,
    M2NWeightTransferUpdateInfo,
)

from rpk.sync import m2n_plan as mp
from rpk.sync.gloo import DEFAULT_TIMEOUT_S, close_group, open_group
from rpk.sync.worker.base import RpkWeightEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.m2n_layout import M2NDestination


def layouts_of(info: M2NWeightTransferInitInfo) -> list[mp.ParamLayout]:
    """The trainer's parameters as the init info announces them."""
    return [mp.ParamLayout(n, d, tuple(s), None if p is None else (p[0], p[1]))
            for n, d, s, p in zip(info.names, info.dtype_names, info.shapes, info.src_placements, strict=True)]


class GlooM2NWorker:
    """One worker's end of a replica's m2n group over gloo: it joins (group rank
    `rank_offset + worker`), agrees on the destinations with the other workers (the
    first publishes, as vLLM's `publish_destination_placements` does), and receives
    its box of each parameter from the trainer ranks the plan names, each piece tagged
    with the parameter's index."""

    def __init__(self, info: M2NWeightTransferInitInfo, worker: int,
                 mine: Sequence[mp.Placements | None], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.layouts = layouts_of(info)
        self._src = mp.Mesh((info.src_mesh_dims[0], info.src_mesh_dims[1]))
        if self._src.size != info.rank_offset:
            raise ValueError(f"gloo_m2n: the trainer's mesh {info.src_mesh_dims} covers {self._src.size} "
                             f"ranks, but rank_offset says {info.rank_offset} trainer ranks")
        self._dst = mp.Mesh((info.dst_mesh_dims[0], info.dst_mesh_dims[1]), info.rank_offset)
        if not 0 <= worker < self._dst.size:
            raise ValueError(f"gloo_m2n: worker {worker} is outside the replica's mesh {info.dst_mesh_dims}")
        self._worker = worker
        assert info.master_address is not None and info.master_port is not None
        self._group = open_group(info.master_address, info.master_port, info.rank_offset + worker,
                                 info.world_size, timeout_s=timeout_s)
        try:
            rows = torch.tensor(mp.encode_destinations(mine), dtype=torch.int64).reshape(-1, 2)
            self._group.broadcast(rows, root=info.rank_offset).wait()
            self.destinations = mp.decode_destinations(rows.tolist())
            if self.destinations != list(mine):
                first = next(p.name for p, a, b in zip(self.layouts, mine, self.destinations) if a != b)
                raise RuntimeError(f"gloo_m2n: the replica's workers resolved different destinations "
                                   f"(first mismatch: {first!r}); they must run the same model and layout")
            self._plan = mp.plan(self.layouts, self._src, self._dst, self.destinations)
        except BaseException:
            close_group(self._group)
            raise
        self.index = {p.name: i for i, p in enumerate(self.layouts)}

    def box(self, index: int) -> mp.Box:
        """This worker's box of parameter `index` (full-tensor coordinates)."""
        layout = self.layouts[index]
        return mp.held_box(layout.shape, self._dst, self.destinations[index], self._dst.start + self._worker)

    def receive(self, index: int, buffer: torch.Tensor) -> None:
        """Parameter `index`'s box into `buffer` (its shape), from every rank that sends
        a piece of it."""
        origin = self.box(index)
        mine = [p for p in self._plan[index] if p.dst == self._worker]
        parts = [torch.empty([b - a for a, b in p.box], dtype=buffer.dtype) for p in mine]
        works = [self._group.recv([t], p.src, index) for p, t in zip(mine, parts)]
        for p, t, w in zip(mine, parts, works):
            w.wait()
            buffer[mp.slices(p.box, origin)] = t

    def close(self) -> None:
        close_group(self._group)


class GlooM2NWeightTransferEngine(RpkWeightEngine[M2NWeightTransferInitInfo, M2NWeightTransferUpdateInfo]):
    """vLLM's `M2NWeightTransferEngine` over `GlooM2NWorker` (see the module docstring);
    its digests are those of each whole tensor received."""

    init_info_cls = M2NWeightTransferInitInfo
    update_info_cls = M2NWeightTransferUpdateInfo
    # The destinations are resolved against this engine's model.
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker: GlooM2NWorker | None = None
        self._destinations: list[M2NDestination] = []
        self._uses_load_weights = False

    def init_transfer_engine(self, init_info: M2NWeightTransferInitInfo) -> None:
        from vllm.distributed.weight_transfer.m2n_layout import resolve_parameter_destinations

        self.shutdown()  # a new group replaces the old one (a regroup, a new trainer)
        layouts = layouts_of(init_info)
        p = self.parallel_config
        dst_dims = init_info.dst_mesh_dims
        allow_direct = (self.device.type != "cpu" and getattr(self.model_config, "quantization", None) is None
                        and p.pipeline_parallel_size == 1)
        self._destinations = resolve_parameter_destinations(
            self.model, [x.name for x in layouts], [getattr(torch, x.dtype) for x in layouts],
            [x.shape for x in layouts], num_workers=dst_dims[0] * dst_dims[1],
            shard_axis_size=dst_dims[1], allow_direct=allow_direct,
        )
        self._uses_load_weights = any(not d.direct for d in self._destinations)
        self.worker = GlooM2NWorker(init_info, p.data_parallel_index * p.world_size + p.rank,
                                    [d.placements for d in self._destinations])

    @property
    def reloads(self) -> bool:
        return self._uses_load_weights

    def receive_weights(self, update_info: M2NWeightTransferUpdateInfo) -> None:
        worker = self.worker
        if worker is None:
            raise RuntimeError("gloo_m2n weight transfer not initialised: call init_transfer_engine first")
        requested = []
        for name in update_info.names:
            index = worker.index.get(name)
            if index is None:
                raise ValueError(f"gloo_m2n: parameter {name!r} was not announced at init; the trainer "
                                 f"must send the parameters it announced")
            requested.append((name, index))

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            # Lazily, as vLLM's engine does: one `load_weights` sees every fallback
            # tensor without all of them held at once.
            for name, index in requested:
                destination = self._destinations[index]
                layout = worker.layouts[index]
                buffer = destination.tensor
                if buffer is None:
                    buffer = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype), device=self.device)
                worker.receive(index, buffer)
                if worker.destinations[index] is None:
                    self.record(name, buffer)
                if destination.tensor is None:
                    yield name, buffer

        if any(self._destinations[i].tensor is None for _, i in requested):
            self.load(received())
        else:
            for _ in received():
                pass

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self._destinations = []
