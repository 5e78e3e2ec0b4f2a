"""A guard over the collectives rpk issues, so that the CPU suite sees a tensor sent over a
group that would not serve its device on the GPU box.

On the box a process group serves only the device types its backends name: the default
group is `rpk.gpu.launch.default_backend(True)`, and a plain "nccl" there would serve cuda
tensors alone ("No backend type associated with device type cpu"), while on CPU every
group is gloo, which serves both. The guard wraps torch.distributed's tensor collectives
and, for each call made from rpk's code, compares the device type its tensors would have
on the box with the device types the group would serve there.

Which device a tensor would have on the box cannot be read here: every tensor is a cpu
tensor. rpk's collective call sites are few, so each declares it (`SITES`: the function
that calls torch.distributed, and the device type of what it sends on the box). A call
from an undeclared rpk function is itself a violation, naming it: a new collective is
declared where it is written, which is where its author knows what it sends.

Not checked, because torch picks a device the group serves by itself: the object
collectives and barriers (host memory when the group has a cpu backend), and what torch's
FSDP, DTensor and DCP issue (the mesh's device type). vLLM's stateless groups (the weight
lanes) do not go through these functions.

Violations are recorded, not raised: raising on rank 0 before the collective would leave
the follower waiting in it. `collective_guard` (a fixture, tests/conftest.py) fails the
test at its end.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

RPK = Path(__file__).resolve().parents[1] / "rpk"

# (module path under rpk/, function) -> the device type of its tensors on the GPU box.
SITES: Mapping[tuple[str, str], str] = {
    ("train/fsdp.py", "all_sum"): "cpu",  # the step's counts and stat sums, on host
    ("train/load.py", "_broadcast_buffers"): "cuda",  # the policy's buffers, on its device
}

TENSOR_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "scatter", "gather", "reduce", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


def served(backend: str) -> frozenset[str]:
    """The device types a group made with `backend` (torch's syntax) serves."""
    return frozenset(BackendConfig(Backend(backend)).get_device_backend_map())


@dataclass
class Guard:
    """`world_backend`: the default group's backends on the box. Other groups keep the
    backend they were made with (rpk names it: the control group is "gloo")."""

    world_backend: str
    violations: list[str] = field(default_factory=list)
    checked: list[tuple[str, str]] = field(default_factory=list)  # (site, collective)

    def check(self, name: str, group: Any) -> None:
        site = _rpk_caller()
        if site is None:
            return
        where = f"rpk/{site[0]}:{site[1]}"
        device = SITES.get(site)
        if device is None:
            self.violations.append(f"{where} issues {name}, which collective_guard.SITES does not declare")
            return
        world = group is None or group is dist.group.WORLD
        backend = self.world_backend if world else dist.get_backend(group)
        self.checked.append((where, name))
        if device not in served(backend):
            self.violations.append(
                f"{where}: {name} of a {device} tensor over a group served by {backend!r} on the box"
            )

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.check(name, signature.bind(*args, **kwargs).arguments.get("group"))
            return fn(*args, **kwargs)

        return guarded


def _rpk_caller() -> tuple[str, str] | None:
    """The rpk function that called the collective (two frames up: past `guarded`);
    None for a caller outside rpk (torch's own, or a test's)."""
    frame = sys._getframe(3)
    path = Path(frame.f_code.co_filename).resolve()
    if not path.is_relative_to(RPK):
        return None
    return str(path.relative_to(RPK)), frame.f_code.co_name


@contextlib.contextmanager
def guarding(world_backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Guard]:
    guard = Guard(world_backend)
    with monkeypatch.context() as patch:
        for name in TENSOR_COLLECTIVES:
            patch.setattr(dist, name, guard.wrap(name, getattr(dist, name)))
        yield guard

