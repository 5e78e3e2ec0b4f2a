"""A run's tiny-model build, in a child process that a signal stops at once.

A build is minutes of torch work. A thread (`asyncio.to_thread`) cannot be stopped:
cancelling the coroutine that awaits it leaves the thread running, and both the event
loop's close and the interpreter's exit wait for it, so SIGINT and SIGTERM would end a
run only when its build is done. A child process can be: a cancelled `build` kills the
child and removes its temporary directory, so the run exits within moments and the
cache holds no partial model. The child dies with rpk
(`rpk.lifetime`), and sits in a session of its own so that a Ctrl-C reaches rpk alone,
which stops it.

The parent sends (temporary directory, spec, recipe) pickled on the child's stdin; the
child answers one base64 pickle per line on its own stdout, ("log", text) as it goes and
("error", exception) if the build fails. Everything else the child writes goes to
stderr.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pathlib
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from rpk.lifetime import die_with_parent
from rpk.tasks import tiny
from rpk.tasks.specs import TinySpec


async def build(
    spec: TinySpec,
    cache_root: pathlib.Path,
    log: Callable[[str], None],
    recipe: tiny.Recipe | None = None,
) -> pathlib.Path:
    """`tiny.build_tiny_model`'s directory for `spec` and `recipe`, built on a cache
    miss in a child process; cancelled, the child is killed and its files removed."""
    recipe = recipe or tiny.ARITH
    target, tmp = tiny.start_build(spec, cache_root, recipe, log)
    if tmp is None:
        return target
    started = time.monotonic()
    try:
        await _in_child(tmp, spec, recipe, log)
        tiny.install(tmp, target, log)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny: built {target} in {time.monotonic() - started:.1f}s")
    return target


async def _in_child(tmp: pathlib.Path, spec: TinySpec, recipe: tiny.Recipe, log: Callable[[str], None]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    failure: BaseException | None = None
    try:
        proc.stdin.write(pickle.dumps((tmp, spec, recipe)))
        proc.stdin.close()
        async for line in proc.stdout:
            kind, payload = pickle.loads(base64.b64decode(line))
            if kind == "log":
                log(payload)
            else:
                failure = payload
        code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if failure is not None:
        raise failure
    if code != 0:
        raise RuntimeError(f"tiny: the build in {tmp} exited with code {code} (its output is above)")


def _send(out: BinaryIO, kind: str, payload: Any) -> None:
    out.write(base64.b64encode(pickle.dumps((kind, payload))) + b"\n")
    out.flush()


def _picklable(e: BaseException) -> BaseException:
    # An exception whose constructor takes other arguments than its args fails to
    # unpickle in the parent: send what it said instead.
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def main() -> int:
    die_with_parent()
    # Only the answers on the private copy of stdout: a library's print goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    tmp, spec, recipe = pickle.load(sys.stdin.buffer)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per save; the build logs its own progress
    try:
        tiny.build_into(tmp, spec, recipe, lambda text: _send(out, "log", text))
    except Exception as e:
        _send(out, "error", _picklable(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
