"""`cpu_ipc`: vLLM's IPC weight-transfer engine for CPU replicas on the trainer's machine.

CUDA IPC hands a worker handles to the trainer's own device memory, which it opens in
place. Here the handles name shared memory: the trainer copies each bucket once into a
staging file in /dev/shm that it keeps from sync to sync (one per bucket index, mapped
once), and every worker of every replica maps the same file and loads the tensors
straight out of the mapping. The bytes move twice (into the staging file, out of it into
the model) and are never serialised, against five passes for the safetensors spool
(write, read back, load) and a TCP stream per receiver for gloo.

The engine speaks vLLM's IPC dataclasses unchanged (`IPCWeightTransferInitInfo`,
`IPCWeightTransferUpdateInfo`); each tensor's handle is `{"shm": [path, offset]}`. The
staging files stay untouched until the sync is finished (vLLM's layerwise reload may hold
views of them until then).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)

from rpk.engine.gloo_engine import finish_reload, start_reload
from rpk.engine.transfer import spool_file
from rpk.engine.verify import digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "cpu_ipc"
HANDLE_KEY = "shm"


def mapping(path: str, size: int) -> torch.Tensor:
    """The bytes of a shared file, mapped (changes are seen by every process)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class Staging:
    """The trainer's staging files, one per bucket index, grown as buckets need."""

    def __init__(self) -> None:
        self._files: list[tuple[str, int, torch.Tensor]] = []

    def put(self, index: int, tensors: list[torch.Tensor]) -> list[dict[str, list[Any]]]:
        """Copy `tensors` into bucket `index`'s file; a handle each."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        path, data = self._file(index, sum(sizes))
        handles, offset = [], 0
        for t, n in zip(tensors, sizes):
            data[offset:offset + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            handles.append({HANDLE_KEY: [path, offset]})
            offset += n
        return handles

    def _file(self, index: int, nbytes: int) -> tuple[str, torch.Tensor]:
        while len(self._files) <= index:
            self._files.append(("", 0, torch.empty(0, dtype=torch.uint8)))
        path, size, data = self._files[index]
        if size < nbytes:
            if path:
                os.unlink(path)
            # In /dev/shm when it has room (a mapping past a full tmpfs would kill the
            # writer with SIGBUS), else a file in the temp dir, mapped the same way.
            path = str(spool_file(nbytes, prefix="rpk-staging-", suffix=""))
            os.truncate(path, nbytes)
            size, data = nbytes, mapping(path, nbytes)
            self._files[index] = (path, size, data)
        return path, data

    def close(self) -> None:
        for path, _, _ in self._files:
            if path:
                Path(path).unlink(missing_ok=True)
        self._files = []


class CpuIpcWeightTransferEngine(
    WeightTransferEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]
):
    """The worker side: tensors viewed in the trainer's staging files, loaded through
    vLLM's layerwise reload."""

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._maps: dict[str, torch.Tensor] = {}
        self.record_digests = False
        self.digests: dict[str, str] = {}

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError("the cpu_ipc weight-transfer engine takes one handle per tensor: packed=True")

    def start_weight_update(self) -> None:
        self.digests = {}
        # A mapping of a file the trainer has removed would pin its memory for good.
        self._maps = {p: m for p, m in self._maps.items() if os.path.exists(p)}
        start_reload(self.model)

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def _view(self, handle: dict[str, Any], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        if HANDLE_KEY not in handle:
            raise ValueError(f"not a cpu_ipc handle (no {HANDLE_KEY!r} key): {list(handle)}")
        path, offset = handle[HANDLE_KEY]
        size = os.path.getsize(path)
        data = self._maps.get(path)
        if data is None or data.numel() != size:
            data = self._maps[path] = mapping(path, size)
        n = dtype.itemsize * int(torch.Size(shape).numel())
        return data[offset:offset + n].view(dtype).view(shape)

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        assert isinstance(update_info.ipc_handles, list)
        weights = [
            (name, self._view(handle, getattr(torch, dtype_name), shape))
            for name, dtype_name, shape, handle in zip(
                update_info.names, update_info.dtype_names, update_info.shapes,
                update_info.ipc_handles, strict=True,
            )
        ]
        if self.record_digests:
            self.digests.update((name, digest(t)) for name, t in weights)
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self._maps.clear()
