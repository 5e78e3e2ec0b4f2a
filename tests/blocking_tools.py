"""Blocking (plain-function) tools, as a user writes them, for the tool-worker tests:
one that hangs until its test opens `GATE`, one that sleeps its thread, one that never
returns (for a process that is interrupted)."""

from __future__ import annotations

import threading
import time

GATE = threading.Event()


def hang(x: int) -> str:
    """Blocks until the test opens the gate.

    Args:
        x: ignored
    """
    GATE.wait()
    return "released"


def slow(seconds: float) -> str:
    """Sleeps, blocking its thread.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "slept"


def hang_forever(x: int) -> str:
    """Never returns (an hour is forever to a test).

    Args:
        x: ignored
    """
    time.sleep(3600)
    return "woke"
