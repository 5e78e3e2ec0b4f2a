"""The async driver of one validation pass.

Every validation prompt gets one greedy response (temperature 0: pass@1) and `k`
sampled ones (at the rollout's temperature: mean@k, pass@k), generated through the same
Engine and scored by the same Scorer as training. It runs between steps, after the
weight sync, as a phase of its own: nothing of it lands in a step's timings or
bookkeeping. Aggregation into metrics is pure and lives in `rpk.obs.validation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from rpk.core.outcomes import EvalRun, PromptEval
from rpk.core.protocols import Engine, Scorer
from rpk.core.records import FinishReason, GenDelta, GenRequest, Prompt, Response, Scored
from rpk.loop.rollout import Received

GREEDY = -1  # the response index of a prompt's greedy response


@dataclass(frozen=True, slots=True)
class EvalSpec:
    k: int  # sampled responses per prompt; 0 = greedy only
    max_tokens: int
    temperature: float = 1.0  # of the sampled responses
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 0 or self.max_tokens <= 0:
            raise ValueError(f"k must be >= 0 and max_tokens > 0, got {self.k}, {self.max_tokens}")


def eval_requests(
    prompts: Sequence[Prompt], spec: EvalSpec, step: int
) -> list[tuple[int, int, GenRequest]]:
    """(prompt position, response index or GREEDY, request) for one validation pass.

    Ids start with `val`, rollout's with `s`, so they never meet in the engine. Each
    sampled response has the same seed at every pass: differences between passes are
    the weights', not the dice's."""
    out = []
    for pos, prompt in enumerate(prompts):
        out.append((pos, GREEDY, GenRequest(
            request_id=f"val{step}-p{pos}-greedy", prompt_token_ids=prompt.token_ids,
            max_tokens=spec.max_tokens, temperature=0.0, top_p=1.0, prompt_uid=prompt.uid,
        )))
        for j in range(spec.k):
            out.append((pos, j, GenRequest(
                request_id=f"val{step}-p{pos}-k{j}", prompt_token_ids=prompt.token_ids,
                max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                seed=(spec.seed * 1_000_003 + pos) * 257 + j, prompt_uid=prompt.uid,
            )))
    return out


async def _consume(rid: str, stream: AsyncIterator[GenDelta]) -> tuple[Received, FinishReason]:
    got = Received()
    # Closed when done: a stream left to the garbage collector would still hold its
    # request in the engine.
    async with contextlib.aclosing(stream):
        async for delta in stream:
            got.add(delta)
            if delta.finished:
                break
    return got, got.finish(rid)


async def evaluate(
    prompts: Sequence[Prompt],
    engine: Engine,
    scorer: Scorer,
    spec: EvalSpec,
    *,
    step: int,
    version: int,
    clock: Callable[[], float] = time.monotonic,
) -> EvalRun:
    """Generate and score every validation response, each scored the moment it
    finishes. An engine failure ends the pass (and the run); a response that fails to
    score counts as wrong (its `Scored.error` is set)."""
    planned = eval_requests(prompts, spec, step)
    scored: dict[tuple[int, int], Scored] = {}
    done: set[str] = set()

    async def one(pos: int, index: int, rid: str, stream: AsyncIterator[GenDelta]) -> None:
        got, reason = await _consume(rid, stream)
        done.add(rid)
        response = Response(
            prompt=prompts[pos], index=index, token_ids=tuple(got.token_ids),
            logprobs=tuple(got.logprobs), finish_reason=reason, version=version, text="".join(got.text),
        )
        scored[pos, index] = await scorer.score(response)

    started = clock()
    # One batch, like a round: the engine's own scheduler keeps its batch full.
    streams = await engine.start([request for _, _, request in planned])
    try:
        async with asyncio.TaskGroup() as tg:
            for pos, index, request in planned:
                rid = request.request_id
                tg.create_task(one(pos, index, rid, streams[rid]), name=f"eval:{rid}")
    finally:
        # A failed or cancelled pass leaves nothing running in the engine.
        for _, _, request in planned:
            if request.request_id not in done:
                await asyncio.shield(engine.abort(request.request_id))
    ended = clock()
    results = tuple(
        PromptEval(p, scored[pos, GREEDY], tuple(scored[pos, j] for j in range(spec.k)))
        for pos, p in enumerate(prompts)
    )
    return EvalRun(step, version, spec.k, results, started, ended)
