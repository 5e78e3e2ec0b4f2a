"""Trainer memory between the phases of a colocated step (rpk.gpu.plan plans them).

- `StateOffload`: while vLLM generates, the trainer's AdamW moments (and, where the plan
  says so, its parameter shards) wait in host memory; they come back before the first
  micro-batch. The gradients are dropped, not moved: a step starts from none.
- `recompute_layers`: each decoder layer keeps only its input for backward and runs its
  forward again there (activation checkpointing), so a long sequence's activations are
  one layer's, not every layer's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from rpk.core.modes import Offload


class StateOffload:
    """Moves a trainer's state between its device and host memory. On a CPU trainer the
    calls run and the tensors stay where they are (host is where they live)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.where: Offload = Offload.NONE
        self.moved_bytes = 0  # of the last offload

    def offload(self, what: Offload) -> None:
        """Drop the gradients and move `what` to host. Waits for the copies: the memory
        must be free when this returns (vLLM's KV cache wakes into it next)."""
        if self.where is not Offload.NONE:
            raise RuntimeError(f"offload while already offloaded ({self.where.value})")
        self.optimizer.zero_grad(set_to_none=True)
        host = torch.device("cpu")
        moved = 0
        if what.moves_optimizer:
            moved += _move_optimizer(self.optimizer, host)
        if what.moves_params:
            moved += sum(_nbytes(p) for p in self.module.parameters())
            self.module.to(host)
        release_cache(self.device)
        self.where, self.moved_bytes = what, moved

    def restore(self) -> None:
        """Bring back what `offload` moved; a no-op when nothing is away."""
        if self.where is Offload.ALL:
            self.module.to(self.device)
        if self.where is not Offload.NONE:
            _move_optimizer(self.optimizer, self.device)
        self.where = Offload.NONE


def release_cache(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to CUDA once the device's queued
    work is done: vLLM (another process) wakes into that memory, and a block this process
    still reserves is not free there. A no-op where CUDA was never initialised."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor shard: its own bytes
    return local.numel() * local.element_size()


def _move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    moved = 0
    pinned = device.type == "cpu" and torch.cuda.is_available()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0:
                copy = value.to(device, non_blocking=True)
                state[key] = _pinned(copy) if pinned else copy
                moved += _nbytes(value)
    return moved


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """`t` in page-locked memory (the next trip back to the GPU runs asynchronously). A
    DTensor shard is pinned through its local tensor: torch 2.11's DTensor has no
    sharding rule for `is_pinned`/`pin_memory` (seen on an H200)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t if t.is_pinned() else t.pin_memory()
    local = t.to_local()
    if local.is_pinned():
        return t
    return DTensor.from_local(local.pin_memory(), t.device_mesh, t.placements,
                              run_check=False, shape=t.shape, stride=t.stride())


def recompute_layers(layers: Sequence[torch.nn.Module]) -> None:
    """Activation checkpointing per decoder layer (non-reentrant, so keyword arguments
    and FSDP2's hooks work). The module's call, and so FSDP's gather around it, is kept;
    only the forward inside it is checkpointed."""
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
