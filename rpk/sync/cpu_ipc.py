"""`cpu_ipc`, the trainer's side: vLLM's IPC weight-transfer protocol for CPU replicas on
the trainer's machine (the workers' engine: `rpk.sync.worker.cpu_ipc`).

CUDA IPC hands a worker handles to the trainer's own device memory, which it opens in
place. Here the handles name shared memory, in the same way: the trainer's parameters
live in one file in /dev/shm (`share_weights`, once, when the trainer is built), so a
bucket's handles point at the live parameters themselves and every worker of every
replica loads them straight out of its mapping of that file, which it keeps open from
sync to sync. A sync moves the bytes once (out of the mapping into the model) and
serialises nothing; the trainer copies nothing.

A tensor that is not in such a file (a sharded trainer's gathered weights, a dtype cast,
a trainer whose /dev/shm had no room) is copied into a staging file the trainer keeps
from sync to sync (one per bucket index, mapped once): two copies, still against five
passes for the safetensors spool (write, read back, load) and a TCP stream per receiver
for gloo. `Staging.copied_bytes` counts what was copied.

The engine speaks vLLM's IPC dataclasses unchanged (`IPCWeightTransferInitInfo`,
`IPCWeightTransferUpdateInfo`); each tensor's handle is `{"shm": [path, offset]}`. The
staging files stay untouched until the sync is finished (vLLM's layerwise reload may hold
views of them until then).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from rpk.sync.spool import spool_file

HANDLE_KEY = "shm"
# The files `share_weights` makes: a tensor in one of them travels as a handle alone.
SHARED_PREFIX = "rpk-shared-weights-"
SHM_DIR = Path("/dev/shm")
_ALIGN = 64  # each tensor's offset in a shared file: whole cache lines, any dtype's size


def mapping(path: str, size: int) -> torch.Tensor:
    """The bytes of a shared file, mapped (changes are seen by every process)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def share_weights(module: torch.nn.Module, directory: Path = SHM_DIR) -> Path | None:
    """Move `module`'s parameters, in place, into one new file in `directory` (RAM), so
    that `cpu_ipc` hands workers handles to them instead of copies. Each parameter keeps
    its identity (an optimizer holding it is unaffected); its `.data` becomes a view of
    the file, which the optimizer then updates in place. The file is removed when the
    module is collected or the process exits.

    None, and nothing moved, when a parameter is not a whole CPU tensor (a sharded
    trainer's DTensors, a GPU) or `directory` lacks room for twice the bytes (a
    container's 64 MiB /dev/shm): a file on disk would put every optimizer step through
    the page cache to the disk."""
    params = list(module.parameters())
    if not params or any(p.device.type != "cpu" or p.layout != torch.strided
                         or isinstance(p, DTensor) for p in params):
        return None
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    if not (directory.is_dir() and os.access(directory, os.W_OK)
            and shutil.disk_usage(directory).free > 2 * total):
        return None
    fd, name = tempfile.mkstemp(prefix=SHARED_PREFIX, dir=directory)
    os.close(fd)
    weakref.finalize(module, Path(name).unlink, missing_ok=True)
    os.truncate(name, total)
    data = mapping(name, total)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = data[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p)
            p.data = view
    return Path(name)


def shared_handle(tensor: torch.Tensor) -> dict[str, list[Any]] | None:
    """A handle to `tensor` where it lies, when it lies whole in a `share_weights` file
    that still exists; else None (it must be copied to be handed over)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    path = storage.filename
    if path is None or not Path(path).name.startswith(SHARED_PREFIX) or not os.path.exists(path):
        return None
    return {HANDLE_KEY: [path, tensor.data_ptr() - storage.data_ptr()]}


class Staging:
    """The trainer's staging files, one per bucket index, grown as buckets need, for
    the tensors that are not already in shared memory."""

    def __init__(self) -> None:
        self._files: list[tuple[str, int, torch.Tensor]] = []
        self.copied_bytes = 0  # into staging files, over every `put`

    def put(self, index: int, tensors: list[torch.Tensor]) -> list[dict[str, list[Any]]]:
        """A handle to each of `tensors`: where it lies (`shared_handle`), or to a copy
        in bucket `index`'s staging file."""
        handles = [shared_handle(t) for t in tensors]
        staged = [t for t, h in zip(tensors, handles) if h is None]
        if not staged:
            return handles  # type: ignore[return-value]
        sizes = [t.numel() * t.element_size() for t in staged]
        path, data = self._file(index, sum(sizes))
        copies, offset = [], 0
        for t, n in zip(staged, sizes):
            data[offset:offset + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            copies.append({HANDLE_KEY: [path, offset]})
            offset += n
        self.copied_bytes += offset
        it = iter(copies)
        return [h if h is not None else next(it) for h in handles]

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
