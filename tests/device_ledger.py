"""A device-memory ledger driven by the code: what rpk's own code allocates and frees,
counted storage by storage, with nothing real allocated.

Why this and not torch's tools on a CUDA build: the project's venv is torch's CPU build,
which cannot create CUDA tensors (fake ones go no further than `torch.empty`: a
module's `uniform_` init or `.to("cuda")` fails, "not linked with support for cuda
devices"), and a second, CUDA-linked torch (gigabytes of CUDA libraries) would be a
venv the suite does not run in. `torch.distributed._tools`' MemTracker/FSDPMemTracker
run here on fake CPU tensors, but model no caching allocator (no reserved memory, no
`empty_cache`), which is the half of defect 3 a test must see. So:

- `FakeTensorMode` makes every tensor a fake (shapes, dtypes, no storage behind them): a
  14B model's float32 gathers cost nothing. Fake CPU tensors stand for the GPU's; a fake
  process group (`FakeStore`) lets FSDP2 and DTensor run their collectives as no-ops.
- `DeviceLedger`, a `TorchDispatchMode` inside it, sees the output of every op, and
  records each storage it has not seen (its bytes rounded up to the CUDA caching
  allocator's 512-byte blocks). A weakref finaliser on the storage takes it off again
  when it dies (torch keeps one Python object per storage, so the finaliser runs when
  the storage itself is freed). A storage resized in place (FSDP2 allocates and frees
  its unsharded parameters so) is counted at its new size. A DTensor holds no bytes of
  its own: its local tensor is counted. A collective's `wait_tensor` returns its input
  on a GPU but a new fake here: the bytes move to the output rather than doubling.
- Reserved memory is modelled as the allocator's cache: it grows to the peak allocated
  and never shrinks by itself; `empty_cache` (a test patches `torch.cuda.empty_cache`
  to the ledger's) returns it to what is allocated.

What it does not see: work done on another thread (a dispatch mode is thread-local, so a
test drives the code on its own thread), and fragmentation (reserved is the peak, not
the segments the real allocator would keep).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

BLOCK = 512  # the CUDA caching allocator's smallest block; every size rounds up to it


# Ops that return their input on a GPU but a new fake tensor here (a collective's wait).
_IN_PLACE = frozenset([torch.ops._c10d_functional.wait_tensor.default])


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


class DeviceLedger(TorchDispatchMode):
    """Current, peak and reserved bytes of the storages on `device` that ops produced
    while the mode was active (storages made before it are not counted)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device).type
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self._live: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._resize: Callable[..., Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _IN_PLACE and isinstance(out, torch.Tensor):
            self._moved(args[0].untyped_storage(), out.untyped_storage())
        for t in _plain(tree_flatten(out)[0]):
            if t.device.type == self.device:
                self._count(t.untyped_storage())
        return out

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache`: the allocator's unused blocks go back to the driver."""
        self.reserved = self.allocated

    def reset_peak(self) -> None:
        self.peak = self.allocated

    @contextlib.contextmanager
    def tracing(self) -> Iterator[DeviceLedger]:
        """The mode, with in-place storage resizes counted at their new size."""
        original = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            ledger._count(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        try:
            with self:
                yield self
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = rounded(storage.nbytes())
        if key not in self._live:
            weakref.finalize(storage, self._free, key)
            self._live[key] = 0
        self._add(size - self._live[key])
        self._live[key] = size

    def _moved(self, old: torch.UntypedStorage, new: torch.UntypedStorage) -> None:
        """`new` is `old` on a GPU: the bytes are counted once, for as long as `new` lives."""
        if id(old) != id(new) and id(old) in self._live:
            self._add(-self._live[id(old)])
            self._live[id(old)] = 0
            self._count(new)

    def _free(self, key: int) -> None:
        self._add(-self._live.pop(key, 0))

    def _add(self, delta: int) -> None:
        self.allocated += delta
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated)


def _plain(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors holding bytes among `values`: a wrapper (a DTensor) holds none of its
    own, its inner tensors do (made by ops run under the wrapper's dispatch, which this
    mode, then off, does not see)."""
    for t in values:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from _plain(getattr(t, n) for n in names)
        elif isinstance(t, torch.Tensor):
            yield t
