"""The small interfaces the loop is written against.

Each has a real implementation (vLLM, the torch trainer, a reward function) and a tiny
scripted fake in the tests; the loop cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rpk.core.drafts import DraftSource, PromptDrafts, SpecStats
from rpk.core.modes import Offload, RestLevel
from rpk.core.outcomes import MigrationReport, RegroupReport
from rpk.core.records import GenDelta, GenRequest, Prompt, ReplicaStats, Response, Scored, TrainSample

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


class MeteredScorer(Scorer, Protocol):
    """A Scorer whose state is worth columns in metrics.jsonl."""

    def metrics(self) -> dict[str, float]: ...


class GroupScorer(Protocol):
    """Scores the rows it names (`by_group`) a group at a time: the round hands it a
    prompt's R responses once the last of them has finished (group judging), and every
    other response to the `Scorer` one by one."""

    def by_group(self, prompt: Prompt) -> bool: ...

    async def score_group(self, responses: Sequence[Response]) -> list[Scored]:
        """A Scored for each of `responses`, in their order."""
        ...


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

    def compute_on(self, ranks: Sequence[int] | None) -> None:
        """Until the step ends, only `ranks` compute the chunks `accumulate` gets (None:
        every rank). A sharded trainer narrows (the borrowing stream trainer's devices,
        `rpk.train.dist.DistTrainer`); a trainer of one process has nothing to narrow."""
        ...

    def offload(self, what: Offload) -> None:
        """Colocated: the trainer's state to host (`none`, `optimizer`, `all`) while the
        engine generates; it comes back before the next micro-batch."""
        ...

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


class StepTrainer(Protocol):
    """The trainer as a step drives it: the `Trainer`'s step calls, awaited
    (`rpk.loop.trainer.AsyncTrainer`, whose compute part runs them on the trainer
    thread, or on virtual time in the simulator)."""

    @property
    def version(self) -> int: ...

    async def begin_step(self) -> None: ...

    async def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]: ...

    async def finish_step(self) -> Mapping[str, float]: ...

    async def abandon_step(self) -> None: ...

    async def compute_on(self, ranks: Sequence[int] | None) -> None: ...

    def weight_buckets(self, max_bytes: int) -> AsyncIterator[WeightBucket]: ...


class Lending(Protocol):
    """A fleet that lends replicas to the trainer for the rest of a round: the paper's
    stream trainer (`rpk.engine.fleet.Fleet`)."""

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight on each awake replica."""
        ...

    def replica_names(self, indices: Sequence[int]) -> list[str]:
        """The names of the awake replicas `indices` (`tp2.1`; `n1.tp2.1` on node 1)."""
        ...

    async def lend(self, indices: Sequence[int]) -> MigrationReport:
        """Move the requests of the replicas `indices` to the others, then put them to
        sleep so their devices can train."""
        ...

    async def reclaim(self) -> None:
        """After the round: wake the lent replicas (their weights were dropped)."""
        ...


class Resting(Protocol):
    """A fleet that shares its devices with the trainer (colocated, as veRL's hybrid
    engine): it sleeps while the trainer trains and wakes in two parts around the weight
    sync (`rpk.engine.fleet.Fleet.rest`)."""

    @property
    def rest_level(self) -> RestLevel | None:
        """vLLM's sleep level while the trainer trains; None: the fleet keeps its devices."""
        ...

    @property
    def resting(self) -> RestLevel | None:
        """The sleep level it rests at now; None: awake."""
        ...

    async def rest(self, level: RestLevel) -> None:
        """Sleep at `level` (`KEEP_WEIGHTS` on the host, or `DROP_WEIGHTS`)."""
        ...

    async def wake_from_rest(self) -> None:
        """Wake without a weight update (after a level-1 rest: the weights were kept)."""
        ...


class Regrouping(Protocol):
    """A fleet whose replicas regroup to another tensor-parallel size between rounds."""

    @property
    def tp(self) -> int: ...

    @property
    def version(self) -> int: ...

    async def regroup(
        self, tp: int, weights: Callable[[], AsyncIterable[WeightBucket]], version: int | None = None
    ) -> RegroupReport:
        """Route to the layout of `tp`, its weights brought to the fleet's version (or to
        `version`, read from `weights()`)."""
        ...


class RoundStatistics(Protocol):
    """An engine that counts what each replica's scheduler saw (preemptions, KV use)."""

    def take_round_stats(self) -> Mapping[str, ReplicaStats]:
        """Per replica: what it saw since the last call."""
        ...


class ElasticFleet(Regrouping, RoundStatistics, Protocol):
    """What elastic TP (`rpk.loop.elastic`) needs of the fleet."""


class Speculating(Protocol):
    """A fleet whose replicas speculate from draft texts rpk hands them
    (`rpk.loop.speculate`)."""

    def draft_targets(self) -> Mapping[str, int]:
        """The replicas a round runs on (awake, not lent): name -> max concurrency."""
        ...

    async def set_drafts(self, schedules: Mapping[str, Sequence[tuple[int, int, int]]],
                         sources: Sequence[DraftSource], prompts: Sequence[PromptDrafts]) -> None:
        """Before a round: each replica's draft-length schedule, the sources drafts may
        come from, the round's prompts and their draft texts (replacing the last round's)."""
        ...

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        """Mid-round: more draft texts (finished siblings)."""
        ...

    async def take_spec_stats(self) -> Mapping[str, SpecStats]:
        """Per replica: its speculative decoding since the last call."""
        ...

    def tail_rows(self, at: int) -> Mapping[str, tuple[int, ...]] | None:
        """With speculating twins: each request in flight on the plain replicas and its
        prompt tokens, empty while more than `at` run there (None without twins)."""
        ...

    async def hand_over(self, request_ids: Collection[str]) -> MigrationReport:
        """Move those requests of the plain replicas to the speculating twins."""
        ...
