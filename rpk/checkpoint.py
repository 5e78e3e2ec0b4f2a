"""Run directories and checkpoints.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding an ordinary HF model
(what vLLM and transformers load), the trainer's state (optimizer, RNG, version) and
`rpk_state.json` (step, scheduling-policy state, data cursor). It is assembled under a
temporary name and renamed into place, so a crash never leaves a half checkpoint that
looks complete; `rpk_state.json` is the mark of a complete one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from rpk.core.errors import UserError

STATE_FILE = "rpk_state.json"


class CheckpointError(UserError, ValueError):
    """A checkpoint to resume from is missing, incomplete or does not fit the run."""


def new_run_dir(out_dir: Path) -> Path:
    """`out_dir/<timestamp>/`, with `out_dir/latest` pointing at it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = out_dir / stamp
    n = 1
    while run_dir.exists():
        run_dir = out_dir / f"{stamp}-{n}"
        n += 1
    run_dir.mkdir()
    latest = out_dir / "latest"
    tmp_link = out_dir / f".latest-{os.getpid()}"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(run_dir.name)
    os.replace(tmp_link, latest)
    return run_dir


async def save(
    run_dir: Path,
    step: int,
    save_model: Callable[[Path], Awaitable[None]],
    state: Mapping[str, Any],
) -> Path:
    """Write checkpoint `step`; `save_model(dir)` writes the model and trainer state."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"

    def prepare() -> None:
        root.mkdir(exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def commit() -> None:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)

    await asyncio.to_thread(prepare)
    await save_model(tmp)
    await asyncio.to_thread(commit)
    return final


def find(path: Path) -> Path:
    """A checkpoint directory, or the newest complete one of a run directory."""
    if (path / STATE_FILE).exists():
        return path
    candidates = sorted((path / "checkpoints").glob("step_*")) if path.is_dir() else []
    complete = [c for c in candidates if (c / STATE_FILE).exists()]
    if not complete:
        raise CheckpointError(f"run.resume={str(path)!r}: no complete checkpoint there")
    return complete[-1]


def load_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())
