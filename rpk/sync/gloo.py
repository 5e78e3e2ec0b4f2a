"""A gloo process group of the weight path, the same on both ends: the trainer's
(`rpk.sync.lanes`, `rpk.sync.m2n_send`) and the workers' (`rpk.sync.worker`).

It is vLLM's stateless group (`stateless_init_torch_distributed_process_group(...,
backend="gloo")`): rank 0 hosts the rendezvous, and each tensor of a bucket is
broadcast from rank 0 in the order the update info lists them (vLLM's
`NCCLWeightTransferUpdateInfo`). vLLM is imported only when a group opens.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

BACKEND = "gloo"
# A peer that stops answering (a dead replica, a lost node) fails the collective
# after this long instead of hanging the sync.
DEFAULT_TIMEOUT_S = 300.0


def open_group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroup:
    """This process's place in a weight-transfer group (rank 0 hosts the store)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listen = None
    if rank == 0:
        # Rank 0 hosts the store on a socket of its own: under torchrun (and rpk's own
        # elastic agent) TORCHELASTIC_USE_AGENT_STORE makes torch's rendezvous open only
        # a client, and every rank would wait for a store nobody serves. All
        # interfaces: workers on other nodes reach it at the advertised address.
        listen = socket.create_server(("", port), family=socket.AF_INET, backlog=128)
    return stateless_init_torch_distributed_process_group(  # type: ignore[return-value]
        address, port, rank, world_size, backend=BACKEND, timeout=timedelta(seconds=timeout_s),
        listen_socket=listen,
    )


def broadcast(group: ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0 sends `tensors` (the receivers pass buffers of the same shapes), one
    broadcast each, in order."""
    for t in tensors:
        # gloo reads `numel` elements from the data pointer: a view must be made whole.
        group.broadcast(t if t.is_contiguous() else t.contiguous(), root=0).wait()


def close_group(group: ProcessGroup | None) -> None:
    """End a group; a peer still inside a collective of it gets an error, not a hang."""
    if group is not None:
        group.abort()


def update_info(bucket: Sequence[tuple[str, torch.Tensor]]) -> NCCLWeightTransferUpdateInfo:
    """What the workers are told of one bucket before it is broadcast."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    return NCCLWeightTransferUpdateInfo(
        names=[name for name, _ in bucket],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
    )


def engine_payload(address: str, port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
    """`init_weight_transfer_engine`'s init info for a replica whose workers start at
    `rank_offset` (the same dict the NCCL engine takes)."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    return worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size,
    ))
