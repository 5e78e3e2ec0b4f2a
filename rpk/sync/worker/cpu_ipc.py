"""`cpu_ipc`, the workers' side: vLLM's IPC weight-transfer engine with handles into
/dev/shm (`rpk.sync.cpu_ipc`, the trainer's side), registered as `cpu_ipc` by rpk's vLLM
plugin. A worker keeps its mappings of the trainer's files open from sync to sync.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)

from rpk.sync.cpu_ipc import HANDLE_KEY, mapping
from rpk.sync.worker.base import RpkWeightEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig


class Mappings:
    """A receiver's mappings of the trainer's files, by path, kept open from sync to
    sync: a file is mapped, and its pages faulted in, once."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def view(self, handle: dict[str, Any], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The tensor a handle names, in place in the mapping."""
        if HANDLE_KEY not in handle:
            raise ValueError(f"not a cpu_ipc handle (no {HANDLE_KEY!r} key): {list(handle)}")
        path, offset = handle[HANDLE_KEY]
        size = os.path.getsize(path)
        data = self._maps.get(path)
        if data is None or data.numel() != size:
            data = self._maps[path] = mapping(path, size)
        n = dtype.itemsize * int(torch.Size(shape).numel())
        return data[offset:offset + n].view(dtype).view(shape)

    def prune(self) -> None:
        """Unmap the files the trainer has removed (their memory would stay pinned)."""
        self._maps = {p: m for p, m in self._maps.items() if os.path.exists(p)}

    def clear(self) -> None:
        self._maps.clear()

    def __len__(self) -> int:
        return len(self._maps)


class CpuIpcWeightTransferEngine(RpkWeightEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]):
    """The worker side: tensors viewed where the handles point (the trainer's shared
    parameters, or its staging files), loaded through vLLM's layerwise reload."""

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.mappings = Mappings()

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError("the cpu_ipc weight-transfer engine takes one handle per tensor: packed=True")

    def start_weight_update(self) -> None:
        self.mappings.prune()
        super().start_weight_update()

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        if not isinstance(update_info.ipc_handles, list):
            raise ValueError(f"cpu_ipc takes a list of handles, one per tensor, not "
                             f"{type(update_info.ipc_handles).__name__}")
        weights = [
            (name, self.mappings.view(handle, getattr(torch, dtype_name), shape))
            for name, dtype_name, shape, handle in zip(
                update_info.names, update_info.dtype_names, update_info.shapes,
                update_info.ipc_handles, strict=True,
            )
        ]
        for name, t in weights:
            self.record(name, t)
        self.load(weights)

    def shutdown(self) -> None:
        self.mappings.clear()
