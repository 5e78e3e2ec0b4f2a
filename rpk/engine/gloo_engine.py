"""vLLM's dense NCCL weight-transfer engine, run over a gloo process group: the
weight path on CPU, and to engine hosts on other nodes.

It is vLLM's `WeightTransferEngine` protocol with vLLM's own dataclasses
(`NCCLWeightTransferInitInfo` at init, `NCCLWeightTransferUpdateInfo` per bucket):
a stateless process group (`stateless_init_torch_distributed_process_group(...,
backend="gloo")`) holds the trainer at rank 0 and every worker of every replica
after it (`rank_offset` + the worker's rank), and each tensor of a bucket is
broadcast from rank 0, in the order the update info lists them. Only the
communicator differs from the NCCL engine, so a CPU run drives the same control
flow a GPU run does.

`register()` (called by rpk's vLLM plugin in every vLLM process, and by rpk's own
process before it starts engines) puts the engines under the name `gloo` in vLLM's
`WeightTransferEngineFactory` and `WeightTransferTrainerFactory`.

The worker can record a sha256 per HF name of what it received
(`record_digests`), for `run.verify_sync` (`rpk.engine.verify`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Self, Sequence

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.nccl_common import (
    NCCLWeightTransferInitInfo,
    worker_init_payload,
)
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from rpk.engine.verify import digest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "gloo"
# A peer that stops answering (a dead replica, a lost node) fails the collective
# after this long instead of hanging the sync.
DEFAULT_TIMEOUT_S = 300.0


def open_group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ProcessGroup:
    """This process's place in a weight-transfer group (rank 0 hosts the store)."""
    import socket

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
    return NCCLWeightTransferUpdateInfo(
        names=[name for name, _ in bucket],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
    )


class GlooWeightTransferEngine(
    WeightTransferEngine[NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]
):
    """The worker side: joins the group at init, receives each bucket into fresh
    tensors and loads them through vLLM's layerwise reload (as the NCCL engine does)."""

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: ProcessGroup | None = None
        self.record_digests = False
        self.digests: dict[str, str] = {}  # HF name -> sha256, of the last update

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed:
            raise ValueError("the gloo weight-transfer engine sends tensors one by one: packed=True")
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError("the gloo weight-transfer engine needs master_address and master_port")
        close_group(self.group)  # a new group replaces the old one (a regroup, a new trainer)
        self.group = None
        p = self.parallel_config
        rank = p.data_parallel_index * p.world_size + p.rank + init_info.rank_offset
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size
        )

    def start_weight_update(self) -> None:
        self.digests = {}
        start_reload(self.model)

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        weights = []
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            weights.append((name, torch.empty(shape, dtype=getattr(torch, dtype_name))))
        broadcast(self.group, (t for _, t in weights))
        if self.record_digests:
            self.digests.update((name, digest(t)) for name, t in weights)
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        close_group(self.group)
        self.group = None


def repack_tied_head(model: torch.nn.Module) -> None:
    """A tied LM head shares the embedding's parameter, so vLLM's reload skips it as an
    alias and never re-processes it: on CPU it keeps computing logits from the GEMM
    weights packed at start-up. Re-pack it from the parameter's new values (a no-op on
    GPU, where the head reads the parameter itself)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and isinstance(
            module.quant_method, UnquantizedEmbeddingMethod
        ):
            module.quant_method.process_weights_after_loading(module)


def start_reload(model: torch.nn.Module) -> None:
    """Before the first bucket: vLLM's layerwise reload takes checkpoint-format weights."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    """After the last bucket: every layer processed (re-packed on CPU), the tied head too."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    repack_tied_head(model)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: the rendezvous the sender hosts as rank 0."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side for vLLM's synchronous client API (one engine behind a
    `VLLMWeightSyncClient`). rpk's own loop drives several replicas at once from its
    event loop (`rpk.engine.collective`) with the same pieces."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
        is_sender: bool = True,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: ProcessGroup | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port,
            rank_offset=1, world_size=init_info.world_size,
        )
        # The workers wait inside init for the rendezvous this side hosts.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, worker_init_payload(worker))
            engine.group = open_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size,
                init_info.timeout_s,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # the other ranks only join the gathers
                pass
            return
        assert self.group is not None, "trainer_init must run before send_weights"
        meta = self.source.metadata()
        info = NCCLWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(info))
            broadcast(self.group, (t for _, t in self.source))
            received.result()
        finally:
            # A failed broadcast leaves the worker inside its receive: do not join it.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        close_group(self.group)
        self.group = None


def engine_payload(address: str, port: int, rank_offset: int, world_size: int) -> dict[str, Any]:
    """`init_weight_transfer_engine`'s init info for a replica whose workers start at
    `rank_offset` (the same dict the NCCL engine takes)."""
    return worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=address, master_port=port, rank_offset=rank_offset, world_size=world_size,
    ))
