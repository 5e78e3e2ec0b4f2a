"""`run.verify_sync`: after every weight sync, each worker of each replica holds exactly
the trainer's weights.

The check is per HF name: the trainer hashes each tensor as its bucket passes to the
transport (sha256 of its bytes), and each worker reports the sha256 of what it
received and loaded under that name (`RpkWorkerExtension.rpk_weight_digests`, recorded
by the spool reload and by rpk's worker engines, `rpk.sync.worker`). vLLM's own `compute_weight_checksums`
hashes its fused kernel layout instead, which on CPU is an empty placeholder once the
linear layers have repacked their weights, so it cannot say anything there.

A mismatch stops the run naming the replica and the first tensor (in the trainer's
order) that differs; the replica's weights are then unknown (`weight_version` None).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import torch

from rpk.core.protocols import WeightBucket
from rpk.sync.m2n_send import ShardBucket
from rpk.sync.protocols import Receiving, WeightTransport


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
    """Another transport, each of whose syncs is checked against the sha256 of each
    whole tensor as its bucket passes. Shards (`ShardBucket`, m2n) are no whole tensors
    to hash: after a sync of shards the trainer's digests are asked of `expected`
    (`rpk.sync.m2n_lane.TrainerShards.digests`, a gather)."""

    def __init__(
        self, inner: WeightTransport,
        expected: Callable[[], Awaitable[Mapping[str, str]]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.inner = inner
        self._expected = expected
        self.dtype = dtype  # what the buckets are cast to before they are hashed and sent

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[Receiving], version: int
    ) -> None:
        if self.dtype is not None:
            buckets = cast(buckets, self.dtype)
        sent: dict[str, str] = {}
        shards: list[str] = []  # the names sent as shards, unhashed
        await self.inner.push(_hashed(buckets, sent, shards), replicas, version)
        if shards:
            if self._expected is None:
                raise ValueError(f"run.verify_sync: version {version} went as shards ({shards[0]!r}, ...) "
                                 "and nothing was given to ask the trainer for its whole weights' digests")
            sent = dict(await self._expected())
        reports = await asyncio.gather(
            *(r.llm.collective_rpc("rpk_weight_digests") for r in replicas)
        )
        for replica, workers in zip(replicas, reports):
            for rank, digests in enumerate(workers):
                diff = first_difference(sent, digests)
                if diff is not None:
                    replica.weight_version = None
                    raise WeightMismatchError(
                        f"run.verify_sync: after the sync of version {version}, replica "
                        f"{replica.name} (worker {rank}) differs from the trainer at {diff[0]!r}: "
                        f"{diff[1]}"
                    )

    async def close(self) -> None:
        await self.inner.close()


async def _hashed(
    buckets: AsyncIterable[WeightBucket], into: dict[str, str], shards: list[str]
) -> AsyncIterator[WeightBucket]:
    def hash_bucket(bucket: WeightBucket) -> None:
        for name, tensor in bucket:
            into[name] = digest(tensor)

    async for bucket in buckets:
        if isinstance(bucket, ShardBucket):
            shards.extend(name for name, _ in bucket)
        else:
            await asyncio.to_thread(hash_bucket, bucket)
        yield bucket


async def cast(buckets: AsyncIterable[WeightBucket], dtype: torch.dtype) -> AsyncIterator[WeightBucket]:
    """The buckets in the replicas' dtype (`torch.Tensor.to`: a tensor already in it
    goes as itself)."""
    async for bucket in buckets:
        yield [(name, t.to(dtype)) for name, t in bucket]
