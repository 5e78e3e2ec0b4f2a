"""The seams of the weight path: what carries an update (`WeightTransport`) and what
it is carried into (`Receiving`: a `VLLMEngine`, or another node's `RemoteReplica`)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Sequence
from typing import Any, Protocol

from rpk.core.protocols import WeightBucket
from rpk.sync.backends import Backend


class WeightEngineClient(Protocol):
    """The part of vLLM's `AsyncLLM` the lanes and the verifier call: its
    weight-transfer lifecycle and the workers' RPCs."""

    async def init_weight_transfer_engine(self, request: Any) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, request: Any) -> None: ...

    async def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    async def shutdown_weight_transfer_engine(self) -> None: ...

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ...) -> list[Any]: ...


class ReceivingSettings(Protocol):
    """What a lane reads of a replica's settings (`VLLMSettings`, `RemoteSettings`)."""

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def backend(self) -> Backend: ...  # the weight path it was started with

    @property
    def devices(self) -> tuple[int, ...]: ...  # its GPUs, as the trainer's rank 0 numbers them


class Receiving(Protocol):
    """A replica the lanes update."""

    name: str
    weight_version: int | None

    @property
    def llm(self) -> WeightEngineClient: ...

    @property
    def settings(self) -> ReceivingSettings: ...

    async def weights_loaded(self, version: int, started: float) -> None: ...


class WeightTransport(Protocol):
    """Carries one weight update (a stream of buckets, read once) into several replicas
    at once, and sets their `weight_version`; `close` ends what it holds open (groups,
    staging files) while the replicas still answer."""

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Any], version: int
    ) -> None: ...

    async def close(self) -> None: ...
