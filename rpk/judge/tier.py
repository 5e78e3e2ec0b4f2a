"""The judge tier as the scorer sees it: which engines answer, and what stands in front
of them.

- **Where the verdicts come from**: an external OpenAI-compatible server
  (`reward.judge.url`, `rpk.judge.openai`); else rpk's own vLLM engines, one per rollout
  GPU where the memory plan places the judge there (`rpk.judge.pool.start_places`),
  otherwise one engine in this process (on CPU). rpk's engines always sit in a
  `JudgePool`, so that one that dies is restarted (`Restarts`) whether there are
  sixteen or one.
- **In front of them**: the verdict cache (`rpk.judge.cache`), unless it is off.

`start_tier` is what `JudgeScorer.start` calls (through `rpk.assembly.box.judge_launcher`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from rpk.reward.judge import JudgeEngine, JudgeSettings
from rpk.judge.cache import CachedJudge, judge_identity
from rpk.judge.openai import EndpointSettings, OpenAIJudge
from rpk.judge.pool import JudgePlace, JudgePool, Restarts, engine_kind, relaunch_with, start_places, start_pool
from rpk.judge.vllm import SleepingJudge


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The config's `reward.judge` fields of the tier: restarts, the cache's size (0:
    no cache) and the external endpoint (None: rpk's own engines)."""

    restarts: Restarts = Restarts()
    cache_size: int = 4096
    endpoint: EndpointSettings | None = None


async def start_local(settings: JudgeSettings, *, hub_cache: str | None, seed: int,
                      restarts: Restarts = Restarts(), log: Callable[[str], None] = print) -> JudgePool:
    """One engine in this process with `reward.judge`'s settings (on CPU), in a pool of
    one: a death waits for its restart (the verdicts asked meanwhile within their timeout)."""
    kind = engine_kind(settings.verdict)

    def launcher(in_thread: bool) -> Callable[[], Awaitable[SleepingJudge]]:
        return lambda: kind.launch(settings, hub_cache=hub_cache, seed=seed, in_thread=in_thread)

    return await start_pool([launcher(False)], ["this process"], relaunch=[relaunch_with(launcher(True))],
                            restarts=restarts, log=log)


async def start_tier(settings: JudgeSettings, *, tier: TierSettings, places: Sequence[JudgePlace],
                     hub_cache: str | None, seed: int, log: Callable[[str], None]) -> JudgeEngine:
    """The run's judge engine (see the module docstring)."""
    engine: JudgeEngine
    if tier.endpoint is not None:
        endpoint = await OpenAIJudge.connect(tier.endpoint, settings)
        engine, served_by = endpoint, f"{tier.endpoint.base} {endpoint.model}"
    elif places:
        engine = await start_places(settings, places, hub_cache=hub_cache, seed=seed,
                                    restarts=tier.restarts, log=log)
        served_by = str(settings.model)
    else:
        engine = await start_local(settings, hub_cache=hub_cache, seed=seed, restarts=tier.restarts, log=log)
        served_by = str(settings.model)
    if tier.cache_size == 0:
        return engine
    return CachedJudge(engine, judge_identity(settings, served_by), tier.cache_size)
