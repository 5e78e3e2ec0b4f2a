"""One real rollout round (vLLM, tiny model) scored over HTTP by the reference server,
and the same responses scored in process: the rewards must agree."""

from __future__ import annotations

import importlib.util

import pytest

from rpk.core.outcomes import RoundPlan
from rpk.core.records import Prompt, RoundKind
from rpk.loop.rollout import run_round
from rpk.reward import FunctionScorer
from rpk.reward.remote import HTTPScorer
from rpk.reward.server import make_app
from tests.fakes import mean_centred
from tests.helpers import serving
from tests.reward_fns import length_reward

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]


async def test_real_round_scores_the_same_over_http_and_in_process(vllm_engine):
    prompts = tuple(
        Prompt(f"p{i}", tuple(3 + (37 * k + 11 * i) % 250 for k in range(8)), "test", "")
        for i in range(3)
    )
    plan = RoundPlan(
        step=1, kind=RoundKind.SYNC, prompts=prompts, responses_per_prompt=4,
        group_size=4, groups_needed=3, max_tokens=24, seed=5,
    )
    with serving(make_app(lambda ds: length_reward, None)) as url:
        remote = HTTPScorer(f"{url}/score", batch_size=8, linger_ms=20)
        try:
            result = await run_round(plan, vllm_engine, remote, mean_centred, version=0)
        finally:
            await remote.aclose()
    local = FunctionScorer({"test": length_reward}, timeout_s=5, max_concurrency=4)
    members = [m for g in result.groups for m in g.members]
    assert len(members) == 12
    assert any(m.response.text for m in members)
    for m in members:
        again = await local.score(m.response)
        assert (m.reward, m.correct, m.error) == (again.reward, again.correct, again.error)
    assert remote.failures == {} and 1 <= remote.requests < 12
