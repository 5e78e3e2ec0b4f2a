"""Child processes die with rpk's main process.

A run killed with SIGKILL gets no chance to stop its children: vLLM's engine core,
reward workers and sandbox launchers would run on, holding memory and cores. Each of
them asks Linux at start-up to SIGKILL it when its parent dies. Standard library only:
it runs first thing in fresh interpreters.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when the process (strictly: the thread) that started it
    exits. If the parent is already gone, exit now: the request would never fire."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
