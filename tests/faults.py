"""Faults for checkpoint writes (`rpk.manifest.FileHook`): picklable, so that one travels
to a follower rank inside its Save command."""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class Hooked:
    """A trainer whose saves show `hook` every file (what the loop sees as its trainer).
    `closes=False` keeps a `DistTrainer`'s followers for the next test (the harness
    releases them)."""

    def __init__(self, inner: Any, hook: Any, closes: bool = True) -> None:
        self.inner = inner
        self.hook = hook
        self.closes = closes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, directory: Path) -> None:
        self.inner.save(directory, self.hook)

    def close(self) -> None:
        if self.closes:
            self.inner.close()
