"""vLLM's synchronous trainer API over rpk's gloo group: the trainer side of `gloo` as
vLLM's own `WeightTransferTrainerFactory` would drive it (one engine behind a
`VLLMWeightSyncClient`). rpk drives its replicas from its event loop instead
(`rpk.sync.transport`); this checks that rpk's group speaks vLLM's protocol. Registered
by `register` (a test's fixture), never by rpk."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from rpk.sync.gloo import BACKEND, DEFAULT_TIMEOUT_S, broadcast, close_group, open_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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
    event loop (`rpk.sync.transport`) with the same pieces."""

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




def register(monkeypatch: object) -> None:
    """`gloo` in vLLM's trainer factory for one test (`monkeypatch`: pytest's, which
    takes it out again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    registry = dict(WeightTransferTrainerFactory._registry)
    monkeypatch.setattr(WeightTransferTrainerFactory, "_registry", registry)  # type: ignore[attr-defined]
    WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")
