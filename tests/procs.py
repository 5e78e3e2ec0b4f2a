"""Finding and ending the processes a test started, by PID (never by name)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """Every live process below `root` (children, grandchildren, ...)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (ppid := _parent_of(int(entry.name))) is not None:
            parents[int(entry.name)] = ppid
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """The pids still alive after up to `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def interrupt(pid: int, signum: int) -> None:
    """`signum` as a terminal or a scheduler sends it: Ctrl-C (SIGINT) to the whole process
    group, anything else to the process alone."""
    if signum == signal.SIGINT:
        os.killpg(pid, signum)
    else:
        os.kill(pid, signum)
