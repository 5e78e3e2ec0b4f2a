"""The small interfaces the loop is written against.

Each has a real implementation (vLLM, the torch trainer, a reward function) and a tiny
scripted fake in the tests; the loop cannot tell them apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterable, AsyncIterator, Iterator, Mapping, Protocol, Sequence

from rpk.core.records import GenDelta, GenRequest, Response, Scored, TrainSample

# Some of a model's weights: (HF parameter name, tensor) pairs.
WeightBucket = Sequence[tuple[str, Any]]


class Engine(Protocol):
    """A rollout engine: start a batch of requests (one response each) and stream each
    as deltas, abort one, load new weights, shut down."""

    @property
    def max_concurrency(self) -> int:
        """How many requests the engine decodes at once (vLLM's max_num_seqs)."""
        ...

    async def start(self, requests: Sequence[GenRequest]) -> Mapping[str, AsyncIterator[GenDelta]]:
        """Add `requests` so that they start decoding together; a stream per request id.
        A stream must be consumed to its end, closed, or its request aborted."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        """Serve the weights the buckets carry (HF names -> tensors), as version
        `version`, from the next request on. Called with no request running."""
        ...

    async def shutdown(self) -> None: ...


class Scorer(Protocol):
    """Scores one finished response. Per-response failures come back as a `Scored`
    with `error` set and reward 0; only a broken scorer raises."""

    async def score(self, response: Response) -> Scored: ...

    async def aclose(self) -> None: ...


class Trainer(Protocol):
    """The policy being trained. Blocking methods: the loop calls them in a thread.

    A step is `begin_step`, any number of `accumulate` calls (micro-batches, in any
    order), then `finish_step`, which normalises the summed gradient by what the step
    saw and takes exactly one optimizer step: so the result does not depend on how
    samples were split or in which order they arrived (streaming relies on this).
    `abandon_step` drops an open step's gradients without an update (a round failed
    or was interrupted); the trainer is then ready for `begin_step` again."""

    @property
    def version(self) -> int:
        """Optimizer steps taken: the version of the weights the engine should serve."""
        ...

    def begin_step(self) -> None: ...

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]: ...

    def finish_step(self) -> Mapping[str, float]: ...

    def abandon_step(self) -> None: ...

    def weight_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        """The full weights in HF names, in buckets of at most `max_bytes` (a tensor
        larger than that is a bucket of its own), gathered from wherever they live.
        Consume each bucket before asking for the next: a sharded trainer holds no more
        than one at a time, and every rank takes part in producing each."""
        ...

    def save(self, directory: Path) -> None:
        """Write the model (an HF directory) and the trainer state into `directory`."""
        ...

    def load(self, directory: Path) -> None:
        """Restore the trainer state `save` wrote (the weights were loaded at build)."""
        ...

    def close(self) -> None:
        """The run is over: release what the trainer holds (a multi-process trainer
        releases the other ranks)."""
        ...
