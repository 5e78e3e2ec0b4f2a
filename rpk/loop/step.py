"""One RL step: a rollout round (with reward overlapped), training on its groups, one
optimizer step, weight sync to the engine."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from rpk.loop.protocols import Engine, Scorer, Trainer
from rpk.loop.records import Group, TrainSample
from rpk.loop.rollout import RoundObserver, RoundResult, run_round
from rpk.loop.round import RoundPlan


class Policy(Protocol):
    def plan(self, step: int) -> RoundPlan: ...

    def commit(self, result: RoundResult) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class StepObserver(RoundObserver, Protocol):
    def training(self, done_samples: int, total_samples: int) -> None: ...


@dataclass(frozen=True, slots=True)
class StepOutcome:
    step: int
    round: RoundResult
    train: Mapping[str, float]
    time_rollout_s: float
    time_train_s: float
    time_sync_s: float
    time_step_s: float
    version: int  # the policy version after this step's update


def train_samples(groups: Sequence[Group]) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_ids=g.prompt.token_ids,
            response_ids=m.response.token_ids,
            old_logprobs=m.response.logprobs,
            advantage=a,
            truncated=m.response.finish_reason == "length",
        )
        for g in groups
        for m, a in zip(g.members, g.advantages)
    ]


class TrainerThread:
    """Runs the blocking trainer on one dedicated thread, so the event loop keeps serving
    the engine and torch's per-thread state stays on one thread."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rpk-trainer")

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def train(
        self, groups: Sequence[Group], observer: StepObserver | None, chunk_groups: int = 4
    ) -> Mapping[str, float]:
        samples = train_samples(groups)
        await self.call(self.trainer.begin_step)
        per_chunk = chunk_groups * max(1, len(samples) // max(1, len(groups)))
        for start in range(0, len(samples), per_chunk):
            await self.call(self.trainer.accumulate, samples[start : start + per_chunk])
            if observer:
                observer.training(min(start + per_chunk, len(samples)), len(samples))
        return await self.call(self.trainer.finish_step)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


async def run_step(
    step: int,
    policy: Policy,
    engine: Engine,
    scorer: Scorer,
    trainer: TrainerThread,
    advantages: Callable[[Sequence[float]], list[float]],
    *,
    version: int,
    clock: Callable[[], float] = time.monotonic,
    observer: StepObserver | None = None,
) -> StepOutcome:
    t0 = clock()
    plan = policy.plan(step)
    result = await run_round(
        plan, engine, scorer, advantages, version=version, clock=clock, observer=observer
    )
    t1 = clock()
    stats = await trainer.train(result.groups, observer)
    t2 = clock()
    new_version = trainer.trainer.version
    if new_version != version:  # a step with nothing to learn from takes no update
        weights = await trainer.call(trainer.trainer.named_weights)
        await engine.update_weights(weights, new_version)
    t3 = clock()
    policy.commit(result)
    return StepOutcome(
        step=step,
        round=result,
        train=stats,
        time_rollout_s=t1 - t0,
        time_train_s=t2 - t1,
        time_sync_s=t3 - t2,
        time_step_s=t3 - t0,
        version=new_version,
    )
