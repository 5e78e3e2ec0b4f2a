"""A vLLM general plugin (pyproject's `vllm.general_plugins` entry point): vLLM runs it
in every process it starts (the engine core, each TP worker) before any model work, and
in rpk's own process, where it does nothing.

In vLLM's processes it makes two promises of `rpk.run` hold:
- a run killed with SIGKILL leaves no engine behind: each process dies with its parent
  (the engine core with rpk's process, a TP worker with its engine core);
- Ctrl-C in a terminal reaches the whole process group, but the engine stops when rpk
  shuts it down (after aborting what runs), not on its own in the middle of a step.
"""

from __future__ import annotations

import os
import signal

from rpk.lifetime import die_with_parent

# Set by rpk to its own pid while it starts an engine; vLLM's processes inherit it.
OWNER_ENV = "RPK_ENGINE_OWNER"


def on_vllm_process() -> None:
    owner = os.environ.get(OWNER_ENV)
    if owner is None or int(owner) == os.getpid():
        return
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
