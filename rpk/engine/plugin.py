"""A vLLM general plugin (pyproject's `vllm.general_plugins` entry point): vLLM runs it
in every process it starts (the engine core, each TP worker) before any model work, and
in rpk's own process.

In every one of them it registers rpk's worker weight-transfer engines (`gloo`,
`cpu_ipc`, `gloo_m2n`: `rpk.sync.worker`, each under its backend's name in
`rpk.sync.backends`) with vLLM's workers' factory, lazily (nothing is imported until
an engine is made). In vLLM's processes it also makes
two promises of `rpk.run` hold:
- a run killed with SIGKILL leaves no engine behind: each process dies with its parent
  (the engine core with rpk's process, a TP worker with its engine core);
- Ctrl-C in a terminal reaches the whole process group, but the engine stops when rpk
  shuts it down (after aborting what runs), not on its own in the middle of a step.
"""

from __future__ import annotations

import os
import signal

from rpk.lifetime import die_with_parent
from rpk.sync.backends import BACKENDS

# Set by rpk to its own pid while it starts an engine; vLLM's processes inherit it.
OWNER_ENV = "RPK_ENGINE_OWNER"


def on_vllm_process() -> None:
    register_weight_transfer()
    owner = os.environ.get(OWNER_ENV)
    if owner is None or int(owner) == os.getpid():
        return
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def register_weight_transfer() -> None:
    """rpk's worker engines of `rpk.sync.backends` in vLLM's workers' factory (rpk
    drives their trainer side, `rpk.sync.transport`); again is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for spec in BACKENDS.values():
        if spec.worker is not None and spec.engine not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(spec.engine, spec.worker.module, spec.worker.cls)
