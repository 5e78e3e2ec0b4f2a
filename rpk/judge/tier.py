"""The judge tier as the scorer sees it: which engines answer, and what stands in front
of them.

- **Where the verdicts come from**: an external OpenAI-compatible server
  (`reward.judge.url`, `rpk.judge.openai`); else rpk's own vLLM engines as the run's
  `JudgePlan` places them, one per rollout GPU or one in this process (on CPU), always
  in a `JudgePool`, so that one that dies is restarted (`RESTARTS`) whether there are
  sixteen or one.
- **In front of them**: the verdict cache (`rpk.judge.cache`), unless it is off or the
  judge samples its votes.

`start_tier` is what `JudgeScorer.start` calls (`rpk.assembly.start`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rpk.core.backoff import Backoff
from rpk.judge.cache import CachedJudge, judge_identity, samples
from rpk.judge.openai import EndpointSettings, OpenAIJudge
from rpk.judge.pool import RESTARTS, JudgePlan
from rpk.reward.judge import JudgeEngine, JudgeSettings


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The config's `reward.judge` fields of the tier: restarts, the cache's size (0:
    no cache) and the external endpoint (None: rpk's own engines)."""

    restarts: Backoff = RESTARTS
    cache_size: int = 4096
    endpoint: EndpointSettings | None = None


async def start_tier(settings: JudgeSettings, *, tier: TierSettings, plan: JudgePlan | None,
                     visible: str | None, node: int | None, log: Callable[[str], None]) -> JudgeEngine:
    """The run's judge engine (see the module docstring): `plan`'s engines on this node
    (`visible`: its CUDA_VISIBLE_DEVICES), or the endpoint."""
    engine: JudgeEngine
    if tier.endpoint is not None:
        endpoint = await OpenAIJudge.connect(tier.endpoint, settings)
        engine, served_by = endpoint, f"{tier.endpoint.base} {endpoint.model}"
    elif plan is not None:
        engine = await plan.launcher(visible, node, restarts=tier.restarts, log=log)(settings)
        served_by = str(settings.model)
    else:
        raise RuntimeError("the judge has neither engines of rpk's to start nor a reward.judge.url")
    if tier.cache_size == 0 or samples(settings):
        return engine
    return CachedJudge(engine, judge_identity(settings, served_by), tier.cache_size)


def describe_tier(tier: TierSettings, plan: JudgePlan | None, settings: JudgeSettings,
                  visible: str | None) -> str:
    """The judge's line in the run's log."""
    if tier.endpoint is not None:
        return (f"judge: {settings.model or 'the model'} served at {tier.endpoint.base} "
                f"({settings.verdict} verdicts)")
    assert plan is not None
    return plan.describe(visible)
