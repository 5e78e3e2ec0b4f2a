"""Run directories and checkpoints.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding an ordinary HF model
(what vLLM and transformers load), the trainer's state (optimizer, RNG, version) and
`rpk_state.json` (a `RunState`: step, weight version, scheduling-policy state and data
cursor, the TP planner's state, and the fingerprint of the run that made it,
`rpk.assembly.settings.fingerprint`). It is assembled under `.tmp-step_NNNNNN`, every file fsynced,
then sealed by its manifest (`rpk.manifest`: every file's size and hash, written last)
and renamed into place, so a crash never leaves a half checkpoint that looks complete.
A write that fails (a full disk, an I/O error) stops the run with one line naming it;
the previous checkpoints stay as they were. Old ones are pruned only once the new one
verifies.

A resumed run continues in the run directory of its checkpoint; `resume_point` finds
the checkpoint, verifies it against its manifest (falling back to the newest one that
verifies when given a run directory) and `check_compatible` refuses one made by another
kind of run, before anything slow starts.

`python -m rpk.checkpoint verify RUN_DIR` checks every checkpoint of a run; `python -m
rpk.checkpoint merge RUN_DIR/checkpoints/step_N OUT` writes a LoRA checkpoint's adapter
merged into its base as an HF model. A LoRA run's checkpoint holds the adapter in PEFT's
format (`adapter_config.json`, naming the base, and `adapter_model.safetensors`) in place
of the HF model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpk import manifest
from rpk.core.errors import UserError
from rpk.manifest import Verdict
from rpk.train.lora import merge

STATE_FILE = "rpk_state.json"
KEEP_MARK = "KEEP"  # a file of this name in a checkpoint exempts it from pruning
_TMP = ".tmp-"


class CheckpointError(UserError, ValueError):
    """A checkpoint to resume from is missing, incomplete, damaged or does not fit the run."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written (a full disk, an I/O error): the run stops; the
    checkpoints before it are untouched."""


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


def check_compatible(made_with: Mapping[str, Any], now: Mapping[str, Any], ckpt: Path) -> None:
    for key, value in now.items():
        if key in made_with and made_with[key] != value:
            raise CheckpointError(
                f"cannot resume from {ckpt}: it was made with {key}={made_with[key]!r}, "
                f"this run has {key}={value!r}"
            )


# -- what a checkpoint's state file holds ----------------------------------------------


@dataclass(frozen=True, slots=True)
class RunState:
    """A checkpoint's `rpk_state.json`: the step it ends, the trainer's weight version,
    the scheduling policy's and the TP planner's states, and the fingerprint of the run
    that made it, which a resume must match. `save` is its one writer, `read_state` its
    one reader. Checkpoints from before the version, the planner or the fingerprint were
    kept read as 0 and empty."""

    step: int
    policy: Mapping[str, Any]
    version: int = 0
    tp_planner: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "step": self.step, "policy": self.policy, "tp_planner": self.tp_planner,
            "version": self.version, "fingerprint": self.fingerprint,
        }, indent=1)


def read_state(ckpt: Path) -> RunState:
    """`ckpt`'s state file, checked: a file that is not JSON, or a field missing or of
    the wrong type, is a `CheckpointError` naming the file and the field."""
    path = ckpt / STATE_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt}: unreadable {STATE_FILE}: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    kinds = {"step": int, "policy": dict, "version": int, "tp_planner": dict, "fingerprint": dict}
    for name in ("step", "policy"):
        if name not in raw:
            raise CheckpointError(f"{path}: no {name!r}")
    unknown = sorted(set(raw) - set(kinds))
    if unknown:
        raise CheckpointError(f"{path}: unknown fields {unknown}")
    for name, value in raw.items():
        if not isinstance(value, kinds[name]) or isinstance(value, bool):
            raise CheckpointError(f"{path}: {name!r} must be {kinds[name].__name__}, got {value!r}")
    return RunState(**raw)


# -- finding one ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResumePoint:
    run_dir: Path
    checkpoint: Path
    state: RunState
    rejected: tuple[Verdict, ...] = ()  # newer checkpoints that failed their check

    @property
    def step(self) -> int:
        return self.state.step


def resume_point(given: Path, hashes: bool = True) -> ResumePoint:
    """The checkpoint `run.resume` names, verified against its manifest (sizes, and
    hashes with `hashes`). A checkpoint directory must verify; a run directory
    (`runs/latest` included) gives its newest checkpoint that verifies, the newer ones
    that did not listed in `rejected`. Blocking (hashes read every byte)."""
    where = f"run.resume={str(given)!r}"
    path = given.resolve()
    if path.name.startswith(_TMP):
        raise CheckpointError(
            f"{where}: {path.name} is a checkpoint whose write never finished (the run "
            f"stopped during it); name the run directory to take the newest complete one"
        )
    if not path.is_dir():
        raise CheckpointError(f"{where}: no such run or checkpoint directory")
    if path.parent.name == "checkpoints" and path.name.startswith("step_"):
        verdict = manifest.verify(path, hashes)
        if not verdict.ok:
            raise CheckpointError(f"{where}: checkpoint {path.name} fails its check: {verdict.problem}")
        return ResumePoint(path.parent.parent, path, read_state(path))
    if (path / STATE_FILE).is_file() or (path / manifest.MANIFEST_FILE).is_file():
        raise CheckpointError(f"{where}: a checkpoint must sit in a run's checkpoints/")
    rejected: list[Verdict] = []
    for ckpt in reversed(_checkpoints(path / "checkpoints")):
        verdict = manifest.verify(ckpt, hashes)
        if verdict.ok:
            return ResumePoint(path, ckpt, read_state(ckpt), tuple(rejected))
        if manifest.read(ckpt) is not None:  # a damaged checkpoint, not an unfinished one
            rejected.append(verdict)
    damaged = f"; damaged: {'; '.join(_said(v) for v in rejected)}" if rejected else ""
    raise CheckpointError(f"{where}: no complete checkpoint in {path}{damaged}")


def _said(v: Verdict) -> str:
    return f"{v.checkpoint.name}: {v.problem}"


def newest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint in `run_dir` whose files have their listed sizes
    (cheap: a stat per file): what a resume would start from."""
    for ckpt in reversed(_checkpoints(run_dir / "checkpoints")):
        if manifest.verify(ckpt, hashes=False).ok:
            return ckpt
    return None


def _checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []


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
    state: RunState,
    save_model: Callable[[Path], Awaitable[None]],
    keep: int = 0,
) -> Path:
    """Write the checkpoint of `state.step` (`save_model(dir)` writes the model and
    trainer state), seal it with its manifest (which hashes every byte once), then, once
    its files have their listed sizes, keep only the newest `keep` checkpoints (0: all)
    and those marked KEEP. A failed write raises
    `CheckpointWriteError` and leaves no trace but what a kill would (nothing a resume
    picks)."""
    root = run_dir / "checkpoints"
    final = root / f"step_{state.step:06d}"
    tmp = root / f"{_TMP}step_{state.step:06d}"

    def prepare() -> None:
        root.mkdir(exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def commit() -> None:
        (tmp / STATE_FILE).write_text(state.to_json())
        manifest.seal(tmp, state.step, state.version, manifest.config_hash(state.fingerprint))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        manifest.fsync_path(root)

    def check_and_prune() -> None:
        # `seal` hashed every byte as it fsynced it, and a re-read now would come from
        # the page cache, not the disk: what the rename can have lost is whole files or
        # their lengths, which the sizes show.
        verdict = manifest.verify(final, hashes=False)
        if not verdict.ok:
            raise CheckpointWriteError(
                f"checkpoint {final} does not verify right after its write: {verdict.problem}"
                " (the filesystem lost data); older checkpoints are kept"
            )
        if keep:
            prune(root, keep)

    try:
        await asyncio.to_thread(prepare)
        await save_model(tmp)
        await asyncio.to_thread(commit)
    except OSError as e:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        last = await asyncio.to_thread(newest, run_dir)
        raise CheckpointWriteError(
            f"checkpoint {final.name} not written: {manifest.describe(e)}; "
            + (f"the last good one is {last}" if last else "there is no earlier checkpoint")
        ) from None
    await asyncio.to_thread(check_and_prune)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep`, unless marked KEEP.
    The caller has verified the newest: the last good checkpoint is never among them."""
    complete = [c for c in _checkpoints(root) if manifest.read(c) is not None]
    doomed = [c for c in complete[:-keep] if not (c / KEEP_MARK).exists()]
    for c in doomed:
        shutil.rmtree(c)
    return doomed


# -- `python -m rpk.checkpoint verify RUN_DIR` -------------------------------------------


def verify_run(run_dir: Path, hashes: bool = True) -> list[Verdict]:
    """Every checkpoint of `run_dir` (half-written ones aside), oldest first."""
    return [manifest.verify(c, hashes) for c in _checkpoints(run_dir / "checkpoints")]


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    rows = [("checkpoint", "step", "files", "bytes", "check")]
    for v in verdicts:
        check = ("ok" if v.hashed else "ok (sizes)") if v.ok else f"FAILED: {v.problem}"
        step = "?" if v.step is None else str(v.step)
        rows.append((v.checkpoint.name, step, str(v.files), f"{v.bytes:,}", check))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}"
        for r in rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rpk.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("verify", help="check every checkpoint of a run against its manifest")
    check.add_argument("run_dir", type=Path, help="a run directory (runs/latest works)")
    check.add_argument("--sizes-only", action="store_true", help="skip the hashes (fast)")
    merge = sub.add_parser("merge", help="a LoRA checkpoint's adapter merged into its base: an HF model")
    merge.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/step_N of a LoRA run")
    merge.add_argument("out", type=Path, help="the HF model directory to write")
    args = parser.parse_args(argv)
    if args.command == "merge":
        return _merge(args.checkpoint.resolve(), args.out)
    run_dir = args.run_dir.resolve()
    verdicts = verify_run(run_dir, hashes=not args.sizes_only)
    if not verdicts:
        print(f"rpk: no checkpoints in {run_dir}", file=sys.stderr)
        return 1
    print(verdict_table(verdicts))
    if not verdicts[-1].ok:
        good = [v for v in verdicts if v.ok]
        fallback = f"; a resume takes {good[-1].checkpoint.name}" if good else "; none verifies"
        print(f"rpk: the newest checkpoint, {verdicts[-1].checkpoint.name}, fails{fallback}",
              file=sys.stderr)
        return 1
    return 0


def _merge(ckpt: Path, out: Path) -> int:
    try:
        merge(ckpt, out)
    except FileNotFoundError as e:
        print(f"rpk: {e}", file=sys.stderr)
        return 2
    print(f"rpk: {ckpt.name} merged into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
