"""`run.verify_sync`: after every weight sync, each worker of each replica holds exactly
the trainer's weights.

The check is per HF name: the trainer hashes each tensor as its bucket passes to the
transport (sha256 of its bytes), and each worker reports the sha256 of what it
received and loaded under that name (`RpkWorkerExtension.rpk_weight_digests`, recorded
by the spool reload and by the gloo engine). vLLM's own `compute_weight_checksums`
hashes its fused kernel layout instead, which on CPU is an empty placeholder once the
linear layers have repacked their weights, so it cannot say anything there.

A mismatch stops the run naming the replica and the first tensor (in the trainer's
order) that differs; the replica's weights are then unknown (`weight_version` None).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import torch

from rpk.core.protocols import WeightBucket
from rpk.engine.replica import WeightTransport


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (on the trainer, and on a worker as received)."""
    flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy()).hexdigest()


class WeightMismatchError(RuntimeError):
    """A replica's weights differ from the trainer's after a sync."""


def first_difference(
    trainer: Mapping[str, str], worker: Mapping[str, str]
) -> tuple[str, str] | None:
    """The first tensor (trainer order) the worker lacks or holds other bytes of,
    with why; None when every tensor matches. A name only the worker has is a tensor
    the trainer never sent: a stale leftover is as wrong as a missing one."""
    for name, want in trainer.items():
        got = worker.get(name)
        if got is None:
            return name, "not received"
        if got != want:
            return name, f"sha256 {got[:12]}… != trainer's {want[:12]}…"
    extra = sorted(set(worker) - set(trainer))
    if extra:
        return extra[0], "received but not sent by the trainer in this sync"
    return None


class VerifiedTransport:
    """Another transport, each of whose syncs is checked. `expected`: the trainer's
    digests asked for after the sync, where its buckets are not whole tensors (m2n's
    shards: `rpk.engine.m2n.TrainerShards.digests`); else the buckets are hashed."""

    def __init__(
        self, inner: WeightTransport,
        expected: Callable[[], Awaitable[Mapping[str, str]]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.inner = inner
        self._expected = expected
        self.dtype = dtype  # what the buckets are cast to before they are hashed and sent

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Any], version: int
    ) -> None:
        if self.dtype is not None:
            buckets = cast(buckets, self.dtype)
        sent: dict[str, str] = {}
        if self._expected is None:
            await self.inner.push(_hashed(buckets, sent), replicas, version)
        else:
            await self.inner.push(buckets, replicas, version)
            sent = dict(await self._expected())
        reports = await asyncio.gather(
            *(r.llm.collective_rpc("rpk_weight_digests") for r in replicas)
        )
        for replica, workers in zip(replicas, reports):
            for rank, digests in enumerate(workers):
                diff = first_difference(sent, digests)
                if diff is not None:
                    replica.weight_version = None
                    name = getattr(replica, "name", "?")
                    raise WeightMismatchError(
                        f"run.verify_sync: after the sync of version {version}, replica "
                        f"{name} (worker {rank}) differs from the trainer at {diff[0]!r}: "
                        f"{diff[1]}"
                    )

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


async def _hashed(buckets: AsyncIterable[WeightBucket], into: dict[str, str]) -> AsyncIterator[WeightBucket]:
    def hash_bucket(bucket: WeightBucket) -> None:
        for name, tensor in bucket:
            into[name] = digest(tensor)

    async for bucket in buckets:
        await asyncio.to_thread(hash_bucket, bucket)
        yield bucket


async def cast(buckets: AsyncIterable[WeightBucket], dtype: torch.dtype) -> AsyncIterator[WeightBucket]:
    """The buckets in the replicas' dtype (`torch.Tensor.to`: a tensor already in it
    goes as itself)."""
    async for bucket in buckets:
        yield [(name, t.to(dtype)) for name, t in bucket]
