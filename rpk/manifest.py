"""What makes a checkpoint trustworthy: its manifest and the free space it needs.

A checkpoint's `manifest.json` lists every file in it (trainer shards included) with its
size and an xxh3-128 hash, and the checkpoint's step, version and config hash. It is the
last file written, after every other file is fsynced, so a checkpoint without a valid
manifest is incomplete by definition. `verify` checks a checkpoint against it: sizes
always (a stat per file), hashes unless told not to (a read of every byte).

Blocking throughout (file reads, fsyncs): callers on the event loop run it in a thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MANIFEST_FILE = "manifest.json"
FORMAT = 1
HASH = "xxh3_128"
_CHUNK = 8 * 2**20

# -- free space ----------------------------------------------------------------------


class WriteFailed(OSError):
    """A checkpoint write that failed, described already: on one rank of a sharded save,
    every rank raises it (`rpk.train.state`), so that all stop together."""

    def __init__(self, code: int | None, text: str) -> None:
        super().__init__(code, text)

    def __str__(self) -> str:
        return str(self.strerror)


class DiskFull(WriteFailed):
    def __init__(self, path: Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"disk full: {path} needs {needed:,} bytes, {free:,} free")
        self.path, self.needed, self.free = path, needed, free


def check_free(path: Path, needed: int) -> None:
    """Raise `DiskFull` when the filesystem holding `path` (or its nearest existing
    parent: the checkpoint's directory may not exist yet) has less than `needed` free."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise DiskFull(path, needed, free)


def describe(e: BaseException) -> str:
    """One phrase for a failed checkpoint write: a full disk as a full disk, with the path."""
    if isinstance(e, WriteFailed):
        return str(e)
    if isinstance(e, OSError):
        what = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        where = f" writing {e.filename}" if e.filename else ""
        code = errno.errorcode.get(e.errno or 0)
        return f"{what}{where}" + (f" ({code})" if code else "")
    return f"{type(e).__name__}: {e}"


# -- writing ---------------------------------------------------------------------------


def config_hash(fingerprint: Mapping[str, Any]) -> str:
    """The hash of the settings the checkpoint's state only makes sense under."""
    blob = json.dumps(dict(fingerprint), sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def seal(directory: Path, step: int, version: int, cfg_hash: str) -> int:
    """fsync and hash every file under `directory`, fsync its directories, then write the
    manifest (itself fsynced, with its directory): the checkpoint is complete. Returns
    the bytes listed."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST_FILE:
            continue
        size, digest = _hash(path, sync=True)
        files[rel] = {"size": size, "hash": digest}
    for sub in sorted({p for p in directory.rglob("*") if p.is_dir()}, reverse=True):
        fsync_path(sub)
    manifest = {
        "format": FORMAT, "step": step, "version": version, "config_hash": cfg_hash,
        "hash": HASH, "bytes": sum(f["size"] for f in files.values()), "files": files,
    }
    target = directory / MANIFEST_FILE
    with open(target, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(directory)
    return manifest["bytes"]


def _hash(path: Path, sync: bool = False) -> tuple[int, str]:
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- checking --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """A checkpoint checked against its manifest. `problem`: None when it verifies, else
    one phrase naming the file and what is wrong with it."""

    checkpoint: Path
    problem: str | None
    step: int | None = None
    files: int = 0
    bytes: int = 0
    hashed: bool = False

    @property
    def ok(self) -> bool:
        return self.problem is None


def read(ckpt: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None when it has none that parses (incomplete)."""
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def verify(ckpt: Path, hashes: bool = True) -> Verdict:
    manifest = read(ckpt)
    if manifest is None:
        what = "unreadable" if (ckpt / MANIFEST_FILE).exists() else "missing"
        return Verdict(ckpt, f"{MANIFEST_FILE} is {what}: the checkpoint is incomplete")
    if manifest.get("hash") != HASH:
        return Verdict(ckpt, f"{MANIFEST_FILE} uses hash {manifest.get('hash')!r}, not {HASH}")
    files: dict[str, dict[str, Any]] = manifest["files"]
    step = manifest.get("step")
    counted = Verdict(ckpt, None, step, len(files), int(manifest.get("bytes", 0)), hashes)
    for rel, want in sorted(files.items()):
        path = ckpt / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return _failed(counted, f"{rel} is missing")
        except OSError as e:
            return _failed(counted, f"{rel} cannot be read: {e.strerror or e}")
        if size != want["size"]:
            return _failed(
                counted, f"{rel} is {size:,} bytes, its manifest says {want['size']:,}"
                + (" (truncated)" if size < want["size"] else "")
            )
    if hashes:
        for rel, want in sorted(files.items()):
            try:
                _, digest = _hash(ckpt / rel)
            except OSError as e:
                return _failed(counted, f"{rel} cannot be read: {e.strerror or e}")
            if digest != want["hash"]:
                return _failed(counted, f"{rel} does not match its {HASH} hash (its bytes changed)")
    return counted


def _failed(counted: Verdict, problem: str) -> Verdict:
    return Verdict(counted.checkpoint, problem, counted.step, counted.files, counted.bytes, counted.hashed)
