"""The judged task's tiny judge on the real vLLM engine: built as `--data.task
arith_judged` builds it (small sizes here), started as the run starts it, its logprob
verdicts on the task's judged rows are the P(YES) the build measured with transformers."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from rpk.assembly.settings import run_judge_settings
from rpk.config import Config, DataConfig, ModelConfig
from rpk.judge.tiny_recipe import JUDGE
from rpk.judge.vllm import VLLMJudge
from rpk.reward.judge import JudgeScorer
from rpk.reward.verdict import Verdict
from rpk.tasks.tiny import build_tiny_model
from tests.integration.engines import SMALL_JUDGE as SMALL
from tests.integration.engines import assert_the_models_p_yes, judged_round

# The thought's budget here: a few tokens of the untrained judge, then rpk's marker.
REASON = 6

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]


async def test_the_built_judge_scores_the_tasks_rows_in_vllm_as_it_was_measured(tmp_path: Path):
    cfg = Config(data=DataConfig(task="arith_judged"),
                 model=ModelConfig(cache_dir=str(tmp_path), tiny_judge=SMALL))
    # Twenty warm-up steps leave the verdict words little probability: the check of the
    # judge's mass is not what this test is about. A short thought: an untrained judge
    # writes no marker, and over a long one a greedy near-tie may part vLLM from torch.
    assert run_judge_settings(cfg).verdict is Verdict.REASON
    settings = dataclasses.replace(run_judge_settings(cfg), min_mass=0.0, reason_tokens=REASON)
    # The build's held-out figures are the unit tests'; here the weights are what counts.
    recipe = dataclasses.replace(JUDGE, evaluate=None)
    path = await asyncio.to_thread(build_tiny_model, SMALL, tmp_path, lambda _: None, recipe)
    assert settings.model == str(path)

    # Longer than the tail the judge sees: the engine's prompt is cut as the build's was.
    responses, cases = judged_round(6, lines=8)

    judge = await VLLMJudge.launch(settings)
    try:
        scorer = JudgeScorer(settings, judge)
        scored = await asyncio.gather(*(scorer.score(r) for r in responses))
    finally:
        await judge.aclose()
    assert_the_models_p_yes(scored, path, cases, reason_tokens=REASON)
    assert all(s.correct == (s.reward >= 0.5) for s in scored)
