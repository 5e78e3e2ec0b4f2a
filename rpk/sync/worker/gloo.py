"""vLLM's dense NCCL weight-transfer engine, run over a gloo process group
(`rpk.sync.gloo`): the weight path on CPU, and to engine hosts on other nodes.

It is vLLM's `WeightTransferEngine` protocol with vLLM's own dataclasses
(`NCCLWeightTransferInitInfo` at init, `NCCLWeightTransferUpdateInfo` per bucket):
the group holds the trainer at rank 0 and every worker of every replica after it
(`rank_offset` + the worker's rank), and each tensor of a bucket is broadcast from
rank 0, in the order the update info lists them. Only the communicator differs from
the NCCL engine, so a CPU run drives the same control flow a GPU run does. rpk's
vLLM plugin registers it as `gloo` (`rpk.sync.backends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from rpk.sync.gloo import broadcast, close_group, open_group
from rpk.sync.worker.base import RpkWeightEngine

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class GlooWeightTransferEngine(RpkWeightEngine[NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    """The worker side: joins the group at init, receives each bucket into fresh
    tensors and loads them through vLLM's layerwise reload (as the NCCL engine does)."""

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo
    group: ProcessGroup | None = None  # the one this worker joined, till it closes

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError("the gloo weight-transfer engine sends tensors one by one: packed=True")
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError("the gloo weight-transfer engine needs master_address and master_port")
        close_group(self.group)  # a new group replaces the old one (a regroup, a new trainer)
        self.group = None
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size
        )

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_transfer_engine first")
        weights = [
            (name, torch.empty(shape, dtype=getattr(torch, dtype_name)))
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        ]
        broadcast(self.group, (t for _, t in weights))
        for name, t in weights:
            self.record(name, t)
        self.load(weights)

    def shutdown(self) -> None:
        close_group(self.group)
        self.group = None
