"""Whether this machine can run a weight path, asked when the run is planned, not at its
first sync a whole step later.

vLLM's `nccl_m2n` (every trainer rank sends its own shards) needs what vLLM does not
install: the `nccl-extensions` package (`nccl.m2n`, with its `nccl4py`), NCCL 2.30.5 or
newer, and `VLLM_NCCL_SO_PATH` naming the libnccl.so that libnccl_m2n.so links, since the
communicator handle vLLM passes it means nothing in another copy of NCCL
(`vllm/distributed/weight_transfer/m2n_common.py`: `import_m2n`, `comm_ptr`). Without
them, `auto`, which picked m2n only because no trainer rank shares a rollout GPU, falls
back to NCCL broadcast from rank 0 (legal for the same reason) and says so in one line;
m2n asked for by name is refused in one line. Every other backend needs only what rpk
and vLLM install.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rpk.core.modes import TransferChoice
from rpk.sync.backends import Backend

# The first NCCL with the reshard collective m2n calls (NCCL_VERSION_CODE: major * 10000
# + minor * 100 + patch).
M2N_NCCL = 23005


def m2n_missing() -> str | None:
    """What this machine lacks for `nccl_m2n`, in words; None: nothing."""
    try:
        import nccl.m2n  # noqa: F401
    except ImportError as e:
        return f"the nccl-extensions package (nccl.m2n, with nccl4py) is not installed ({e})"
    so_path = os.environ.get("VLLM_NCCL_SO_PATH")
    if not so_path:
        return ("VLLM_NCCL_SO_PATH is unset: vLLM would load its own libnccl, not the one "
                "libnccl_m2n.so links, and m2n cannot use its communicator")
    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        code = NCCLLibrary(so_path).ncclGetRawVersion()
    except Exception as e:  # a library that does not load is as missing as an absent one
        return f"VLLM_NCCL_SO_PATH={so_path} does not load as NCCL ({type(e).__name__}: {e})"
    if code < M2N_NCCL:
        return f"VLLM_NCCL_SO_PATH={so_path} is NCCL {_version(code)}; m2n needs {_version(M2N_NCCL)} or newer"
    return None


def _version(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def runnable(backend: Backend, choice: str, missing: Callable[[], str | None] | None = None
             ) -> tuple[Backend, str]:
    """The backend this machine runs for `backend` (resolved from the config's `choice`),
    and the one line that says why it is another ("" when it is the same). Raises
    `ValueError` (the config's refusal) when the choice named m2n and it cannot run.
    `missing`: the probe (this machine's, `m2n_missing`, by default)."""
    if backend is not Backend.NCCL_M2N or (why := (missing or m2n_missing)()) is None:
        return backend, ""
    if choice != TransferChoice.AUTO:
        raise ValueError(f"rollout.weight_transfer={choice}: vLLM's nccl_m2n cannot run here: {why}; "
                         "take auto (NCCL broadcast from rank 0) or install it (docs/weights.md)")
    return Backend.NCCL, (f"weights: NCCL broadcast from trainer rank 0, not nccl_m2n (each rank's own "
                          f"shards), since {why}")
