"""Run directories and checkpoints.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding an ordinary HF model
(what vLLM and transformers load), the trainer's state (optimizer, RNG, version) and
`rpk_state.json` (step, scheduling-policy state and data cursor, and the fingerprint of
the run that made it). It is assembled under `.tmp-step_NNNNNN`, every file fsynced,
then renamed into place, so a crash never leaves a half checkpoint that looks complete:
`rpk_state.json`, written last, is the mark of a complete one.

A resumed run continues in the run directory of its checkpoint; `resume_point` finds
the checkpoint and `check_compatible` refuses one made by another kind of run, both
from the config alone, before anything slow starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from rpk.config import Config
from rpk.core.errors import UserError

STATE_FILE = "rpk_state.json"
KEEP_MARK = "KEEP"  # a file of this name in a checkpoint exempts it from pruning
_TMP = ".tmp-"


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


# -- what a checkpoint must match ---------------------------------------------------


def fingerprint(cfg: Config) -> dict[str, Any]:
    """The settings a checkpoint's state only makes sense under: the policy's queue and
    the data cursor index one dataset in one seeded order; the weights belong to one
    model. Config alone, nothing loaded."""
    if cfg.model.path is not None:
        model = str(Path(cfg.model.path).resolve())
    else:
        from rpk.tasks.tiny import cache_key

        model = f"tiny-{cache_key(cfg.model.tiny)}"
    data = (
        ",".join(str(Path(f).resolve()) for f in cfg.data.train_files)
        if cfg.data.train_files
        else f"built-in task, {cfg.data.builtin_size} prompts"
    )
    return {
        "rollout.policy": cfg.rollout.policy,
        "rollout.prompts_per_step": cfg.rollout.prompts_per_step,
        "rollout.responses_per_prompt": cfg.rollout.responses_per_prompt,
        "data.train_files": data,
        "data.shuffle": cfg.data.shuffle,
        "run.seed": cfg.run.seed,
        "model": model,
    }


def check_compatible(made_with: Mapping[str, Any], now: Mapping[str, Any], ckpt: Path) -> None:
    for key, value in now.items():
        if key in made_with and made_with[key] != value:
            raise CheckpointError(
                f"cannot resume from {ckpt}: it was made with {key}={made_with[key]!r}, "
                f"this run has {key}={value!r}"
            )


# -- finding one ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResumePoint:
    run_dir: Path
    checkpoint: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def resume_point(given: Path) -> ResumePoint:
    """The checkpoint `run.resume` names: a checkpoint directory, or a run directory
    (`runs/latest` included) whose newest complete checkpoint is taken."""
    where = f"run.resume={str(given)!r}"
    path = given.resolve()
    if path.name.startswith(_TMP):
        raise CheckpointError(
            f"{where}: {path.name} is a checkpoint whose write never finished (the run "
            f"stopped during it); name the run directory to take the newest complete one"
        )
    if (path / STATE_FILE).is_file():
        if path.parent.name != "checkpoints":
            raise CheckpointError(f"{where}: a checkpoint must sit in a run's checkpoints/")
        return ResumePoint(path.parent.parent, path, _load_state(path))
    if not path.is_dir():
        raise CheckpointError(f"{where}: no such run or checkpoint directory")
    ckpt = newest(path)
    if ckpt is None:
        raise CheckpointError(f"{where}: no complete checkpoint in {path}")
    return ResumePoint(path, ckpt, _load_state(ckpt))


def newest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in `run_dir`: what a resume would start from."""
    complete = [c for c in _checkpoints(run_dir / "checkpoints") if (c / STATE_FILE).is_file()]
    return complete[-1] if complete else None


def _load_state(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {STATE_FILE}: {e}") from None


def _checkpoints(root: Path) -> list[Path]:
    return sorted(root.glob("step_*")) if root.is_dir() else []


# -- writing one ----------------------------------------------------------------------


def clean_partial(run_dir: Path) -> list[Path]:
    """Remove the half-written checkpoints a crash left behind; returns them."""
    root = run_dir / "checkpoints"
    partial = sorted(root.glob(f"{_TMP}*")) if root.is_dir() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


async def save(
    run_dir: Path,
    step: int,
    save_model: Callable[[Path], Awaitable[None]],
    state: Mapping[str, Any],
    keep: int = 0,
) -> Path:
    """Write checkpoint `step` (`save_model(dir)` writes the model and trainer state),
    then keep only the newest `keep` checkpoints (0: all) and those marked KEEP."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"{_TMP}step_{step:06d}"

    def prepare() -> None:
        root.mkdir(exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def commit() -> None:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
        if keep:
            prune(root, keep)

    await asyncio.to_thread(prepare)
    await save_model(tmp)
    await asyncio.to_thread(commit)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep`, unless marked KEEP."""
    complete = [c for c in _checkpoints(root) if (c / STATE_FILE).is_file()]
    doomed = [c for c in complete[:-keep] if not (c / KEEP_MARK).exists()]
    for c in doomed:
        shutil.rmtree(c)
    return doomed


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
