"""Faults for checkpoint writes: each file a save writes is shown to a hook just before
it is written, through the writers rpk's checkpoint code calls, patched for the test
(`shown_writes`). A follower rank takes its fault from a file the test writes
(`FAULT_FILE_ENV`), since it lives in a process of its own for many tests."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FAULT_FILE_ENV = "RPK_TEST_FAULT_FILE"  # where a follower rank reads the fault in force

KINDS = ("ENOSPC", "EIO", "kill")


@dataclass(frozen=True)
class Fault:
    """Fail the write of `file` (a path inside the checkpoint, as it is opened for
    writing) in the save of checkpoint `step`: raise ENOSPC or EIO, or SIGKILL the process."""

    file: str
    kind: str
    step: int

    def __call__(self, path: Path) -> None:
        if f"step_{self.step:06d}" not in str(path.parent) or not path.as_posix().endswith(f"/{self.file}"):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        code = getattr(errno, self.kind)
        raise OSError(code, os.strerror(code), str(path))


@dataclass
class Recorder:
    """Records every file a save opens for writing, relative to its checkpoint directory."""

    seen: list[str] = field(default_factory=list)

    def __call__(self, path: Path) -> None:
        parts = path.parts
        at = next(i for i, p in enumerate(parts) if "step_" in p)
        self.seen.append("/".join(parts[at + 1:]))


Hook = Callable[[Path], None]


def _in_checkpoint(path: Path) -> bool:
    return any(part.startswith(("step_", ".tmp-step_")) for part in path.parts)


@contextlib.contextmanager
def shown_writes(hook: Hook | None) -> Iterator[None]:
    """Within the block, `hook` sees every file of a checkpoint just before it is
    written: the safetensors weights, the HF config, the copied tokenizer files, the
    JSON files (the trainer's meta, rpk_state.json), DCP's shards and metadata, and the
    manifest. Files outside a checkpoint are not shown."""
    if hook is None:
        yield
        return
    import transformers
    from torch.distributed.checkpoint.filesystem import FileSystem

    from rpk import manifest
    from rpk.train import state

    def shown(real: Callable[..., Any], at: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            path = Path(at(*args, **kwargs))
            if _in_checkpoint(path):
                hook(path)
            return real(*args, **kwargs)
        return call

    def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and _in_checkpoint(Path(file)):
            hook(Path(file))
        return builtins.open(file, mode, *args, **kwargs)

    real_stream = FileSystem.create_stream

    def create_stream(self: Any, path: Any, mode: str) -> Any:
        if "w" in mode:
            hook(Path(path))
        return real_stream(self, path, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(state, "save_file", shown(state.save_file, lambda tensors, name, **kw: name))
        patch.setattr(transformers.PretrainedConfig, "save_pretrained", shown(
            transformers.PretrainedConfig.save_pretrained, lambda config, d, *a, **kw: Path(d) / "config.json"))
        patch.setattr(shutil, "copy2", shown(shutil.copy2, lambda src, dst, *a, **kw: dst))
        patch.setattr(Path, "write_text", shown(Path.write_text, lambda path, *a, **kw: path))
        patch.setattr(FileSystem, "create_stream", create_stream)
        patch.setattr(manifest, "open", opened, raising=False)
        yield


def follower_faults(fault_file: Path) -> contextlib.AbstractContextManager[None]:
    """A follower rank's writes shown to the fault the test last wrote to `fault_file`
    (none while the file is empty or missing)."""

    def hook(path: Path) -> None:
        try:
            text = fault_file.read_text()
        except FileNotFoundError:
            return
        if text:
            Fault(**json.loads(text))(path)

    return shown_writes(hook)


def set_follower_fault(fault_file: Path, fault: Fault | None) -> None:
    fault_file.write_text(json.dumps(dataclasses.asdict(fault)) if fault is not None else "")


class KeptOpen:
    """A trainer as the loop sees it; `closes=False` keeps a `DistTrainer`'s followers
    for the next test (the harness releases them)."""

    def __init__(self, inner: Any, closes: bool = True) -> None:
        self.inner = inner
        self.closes = closes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        if self.closes:
            self.inner.close()
