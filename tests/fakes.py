"""Scripted stand-ins for the engine and the trainer: tiny, deterministic, no device."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import zlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest, Prompt, Response, Scored, TrainSample
from rpk.loop.trainer import AsyncTrainer, Inline
from rpk.sim.trainer import NullTrainer


def mean_centred(rewards: Sequence[float]) -> list[float]:
    m = sum(rewards) / len(rewards)
    return [r - m for r in rewards]


def make_prompts(n: int) -> list[Prompt]:
    """Prompts p0.. whose token ids (7, i) carry their index into every request."""
    return [Prompt(f"p{i}", (7, i), "test", str(i)) for i in range(n)]


class ScriptedEngine:
    """Generates `length_of(request)` tokens per request, `chunk` tokens per delta, one
    event-loop turn apart: requests interleave as in a real continuous-batching engine.
    With `text_of`, a request's response is that text, one character per token.
    Records every request it saw, every abort, which requests are running and the most
    that ever ran at once."""

    def __init__(
        self,
        length_of: Callable[[GenRequest], int],
        chunk: int = 4,
        max_concurrency: int = 64,
        fail_on: Callable[[GenRequest], bool] | None = None,
        text_of: Callable[[GenRequest], str] | None = None,
    ) -> None:
        self.length_of = length_of
        self.text_of = text_of
        self.peak_running = 0
        self.chunk = chunk
        self._max_concurrency = max_concurrency
        self.fail_on = fail_on
        self.seen: list[GenRequest] = []
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.weights_version = 0
        self.closed = False

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        return {r.request_id: self.generate(r) for r in requests}

    async def generate(self, request: GenRequest) -> AsyncIterator[GenDelta]:
        self.seen.append(request)
        self.running.add(request.request_id)
        self.peak_running = max(self.peak_running, len(self.running))
        text = self.text_of(request) if self.text_of else None
        try:
            target = min(len(text) if text is not None else self.length_of(request), request.max_tokens)
            done = 0
            while done < target:
                await asyncio.sleep(0)
                if self.fail_on and self.fail_on(request) and done > 0:
                    raise RuntimeError(f"engine failed on {request.request_id}")
                n = min(self.chunk, target - done)
                done += n
                last = done >= target
                reason = None
                if last:
                    reason = FinishReason.LENGTH if target >= request.max_tokens else FinishReason.STOP
                yield GenDelta(
                    request.request_id,
                    tuple(range(done - n, done)),
                    tuple([-0.5] * n),
                    text=text[done - n : done] if text is not None else "x" * n,
                    finished=last,
                    finish_reason=reason,
                )
        finally:
            self.running.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        self.weights = {name: t async for bucket in buckets for name, t in bucket}
        self.weights_version = version

    async def shutdown(self) -> None:
        self.closed = True


class LengthScorer:
    """Reward 1 for responses shorter than `threshold` tokens, else 0."""

    def __init__(self, threshold: int = 10) -> None:
        self.threshold = threshold
        self.scored: list[Response] = []

    async def score(self, response: Response) -> Scored:
        await asyncio.sleep(0)
        self.scored.append(response)
        ok = len(response.token_ids) < self.threshold
        return Scored(response, float(ok), ok)

    async def aclose(self) -> None:
        return None


class RecordingTrainer(NullTrainer):
    """Counts what it was fed; `finish_step` is one 'optimizer step'."""


@contextlib.asynccontextmanager
async def recording_runner() -> AsyncIterator[AsyncTrainer]:
    """A `RecordingTrainer` driven from the event loop, its thread ended on exit."""
    runner = AsyncTrainer(RecordingTrainer())
    try:
        yield runner
    finally:
        await runner.aclose()


async def one_bucket(named: dict) -> AsyncIterator[WeightBucket]:
    """`named` as the single bucket of an engine weight update."""
    yield list(named.items())


def build_settings(cfg) -> dict:
    """What `rpk.assembly.start_parts` gives a run's components from the config besides the parts
    themselves, for tests that assemble `Components` around fakes."""
    from rpk import assembly
    from rpk.train.losses import advantage_fn

    return {"advantages": advantage_fn(cfg.train.loss), "eval_spec": assembly.eval_spec(cfg.rollout, cfg.run),
            "weight_bucket_bytes": cfg.rollout.weight_bucket_mb * 2**20}


def scorer_of(cfg, prompts, code=None):
    """The reward stack `rpk.assembly.start_parts` builds for `cfg` over `prompts`."""
    from rpk import assembly

    return assembly.build_scorer(cfg.reward, assembly.run_judge_settings(cfg), prompts, cfg.rollout.max_tokens,
                                 code, seed=cfg.run.seed)


def components(cfg, run_dir, prompts, engine, trainer):
    """The run's `Components` for `cfg` around a fake `engine` and `trainer`: the policy,
    the scorer and the streaming as `rpk.assembly.start_parts` builds them."""
    from rpk import assembly

    return assembly.Components(
        run_dir, prompts,
        assembly.build_round_policy(cfg.rollout, prompts, seed=cfg.run.seed, shuffle=cfg.data.shuffle),
        scorer_of(cfg, prompts), engine, trainer, assembly.build_streaming(cfg.train), **build_settings(cfg),
    )


class SignedLLM:
    """An AsyncLLM stand-in whose every call is bound to the installed vLLM's signature."""

    def __init__(self, log: list) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._cls = AsyncLLM
        self.log = log
        self.errored = False

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        inspect.signature(getattr(self._cls, name)).bind(self, *args, **kwargs)
        self.log.append((name, args, kwargs))

    async def sleep(self, *a: Any, **k: Any) -> None:
        self._call("sleep", *a, **k)

    async def wake_up(self, *a: Any, **k: Any) -> bool:
        self._call("wake_up", *a, **k)
        return True

    async def collective_rpc(self, *a: Any, **k: Any) -> list:
        self._call("collective_rpc", *a, **k)
        return []

    async def reset_prefix_cache(self, *a: Any, **k: Any) -> bool:
        self._call("reset_prefix_cache", *a, **k)
        return True

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        self._call("shutdown")


def uid_of(engine_request) -> str:
    # prompt token ids are (7, i): recover the dataset identity from the request
    return f"p{engine_request.prompt_token_ids[1]}"


def lengths_engine(base: dict[str, int]) -> ScriptedEngine:
    """Each prompt has a base length; responses jitter around it deterministically."""
    def length(req):
        j = zlib.crc32(req.request_id.encode()) % 7
        return base[uid_of(req)] + j
    return ScriptedEngine(length, chunk=2, max_concurrency=256)


class ClockedTrainer(NullTrainer):
    """Records the virtual time of each call and which samples each accumulate saw."""

    def __init__(self, clock) -> None:
        super().__init__()
        self.clock = clock
        self.calls: list[tuple[str, float, int]] = []

    def begin_step(self) -> None:
        super().begin_step()
        self.calls.append(("begin", self.clock(), 0))

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        self.calls.append(("accumulate", self.clock(), len(samples)))
        return super().accumulate(samples)

    def finish_step(self) -> Mapping[str, float]:
        stats = super().finish_step()
        self.calls.append(("finish", self.clock(), len(self.samples)))
        return stats


class InlineTrainer(AsyncTrainer):
    """Runs trainer calls on the event loop itself: on virtual time a real thread would
    let the engine race ahead by however long the OS takes to schedule it."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer, compute=Inline())
