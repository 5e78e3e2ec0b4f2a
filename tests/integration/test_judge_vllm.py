"""The judge on the real vLLM engine: the tiny model as the judge (it judges at random; the
tests prove the path: template, chat template, one decode step with the yes/no log-probs,
verdicts, batching), a reasoning verdict read right after its marker by rpk's tiny judge,
a reward model on the pooling runner, and a judge engine that dies."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import signal
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import psutil
import pytest

from rpk.config import ArithSpec, JudgeTinySpec
from rpk.core.backoff import Backoff
from rpk.core.records import Prompt, Response
from rpk.judge import tiny as jm
from rpk.judge import tiny_eval
from rpk.judge.pool import EngineState, JudgePool, relaunch_with
from rpk.judge.tiny_recipe import JUDGE
from rpk.judge.vllm import VLLMJudge
from rpk.reward.judge import JudgeDied, JudgeScorer, JudgeSettings, request_for
from rpk.reward.verdict import Verdict

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

# Digits are single tokens of the tiny model's tokenizer (rpk.tasks.tiny); its context is
# 512 tokens of nearly one character each, shorter than the built-in rules. The policy
# model as a judge puts little probability on the verdict words: no mass is asked of it.
TEMPLATE = "Q {question} R {reference}\n<response>\n{response}\n</response>\n{yes} or {no}?"
SETTINGS = JudgeSettings(model="tiny", yes="1", no="0", max_concurrency=8, timeout_s=60.0,
                         template=TEMPLATE, system="", min_mass=0.0)


def response(i: int, text: str) -> Response:
    prompt = Prompt(f"q{i}", (1,), "qa", str(i + 40), {"question": f"{i} + 40 ="})
    return Response(prompt, 0, (5,), (-0.1,), "stop", 0, text=text)


def new_processes(me: psutil.Process, before: set[int]) -> list[psutil.Process]:
    """Children started since `before`, except multiprocessing's resource tracker, which
    the first engine of a process starts and which lives as long as that process."""
    return [p for p in me.children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


async def test_logprob_verdicts_from_one_decode_step(vllm_engine, tiny_model_dir):
    judge = VLLMJudge(vllm_engine, tokenizer(tiny_model_dir), SETTINGS, owned=False)
    scorer = JudgeScorer(SETTINGS, judge)
    texts = [f"{i} + 40 = {i + 40 + i % 2}" for i in range(8)]
    scored = await asyncio.gather(*(scorer.score(response(i, t)) for i, t in enumerate(texts)))
    assert [s.error for s in scored] == [None] * 8
    assert all(0.0 < s.reward < 1.0 and s.correct == (s.reward >= 0.5) for s in scored)
    # The same messages again: the same log-probs (the verdict is read, not sampled).
    again = await scorer.score(response(0, texts[0]))
    assert again.reward == pytest.approx(scored[0].reward, abs=1e-5)
    # Against the full distribution's top log-probs of that one step, when both are there.
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    ids = judge.tokens.ids(request_for(SETTINGS, response(0, texts[0])))
    params = SamplingParams(max_tokens=1, logprobs=20, temperature=1.0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async for out in vllm_engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, "judge-top"):
        top = out.outputs[0].logprobs[0]
    yes_id, no_id = judge._words
    if yes_id in top and no_id in top:
        p = math.exp(top[yes_id].logprob) / (math.exp(top[yes_id].logprob) + math.exp(top[no_id].logprob))
        assert p == pytest.approx(scored[0].reward, abs=1e-4)
    assert scorer.metrics()["reward_judge_judged_total"] == 9


async def test_a_graded_judge_cut_before_it_ends_is_counted_not_parsed(vllm_engine, tiny_model_dir):
    settings = JudgeSettings(model="tiny", verdict="score", max_tokens=4, timeout_s=60.0,
                             template=TEMPLATE, system="")
    scorer = JudgeScorer(settings, VLLMJudge(vllm_engine, tokenizer(tiny_model_dir), settings, owned=False))
    scored = await scorer.score(response(1, "41"))
    # The untrained tiny model writes on past 4 tokens: whatever it wrote is no verdict.
    assert scored.error is not None and scored.error.startswith("judge_cut: ")
    m = scorer.metrics()
    assert (m["reward_failed_judge_cut_total"], m["reward_failed_judge_parse_total"]) == (1, 0)


async def test_a_judge_engine_that_dies_stops_in_one_line_and_leaves_no_process(tiny_model_dir):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    settings = JudgeSettings(model=str(tiny_model_dir), yes="1", no="0", max_concurrency=4,
                             template=TEMPLATE, system="", min_mass=0.0)
    judge = await VLLMJudge.launch(settings)
    started = new_processes(me, before)
    assert started, "the judge's engine runs in a process of its own"
    try:
        scorer = JudgeScorer(settings, judge)
        assert (await scorer.score(response(0, "40"))).error is None
        for p in started:
            os.kill(p.pid, signal.SIGKILL)
        for _ in range(100):
            if judge.engine.llm.errored:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(JudgeDied) as e:
            await scorer.score(response(1, "41"))
        assert "\n" not in str(e.value) and str(tiny_model_dir) in str(e.value)
    finally:
        await judge.aclose()
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def reward_model_dir(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model's body with a one-label classification head (random): a
    discriminative reward model's layout."""
    import shutil

    from transformers import AutoConfig, Qwen2ForSequenceClassification

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    config.pad_token_id = config.eos_token_id
    Qwen2ForSequenceClassification(config).save_pretrained(str(out))
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


async def test_a_reward_model_on_the_pooling_runner(tiny_model_dir, tmp_path):
    from rpk.judge.vllm import VLLMRewardModel

    path = reward_model_dir(tiny_model_dir, tmp_path / "rm")
    settings = JudgeSettings(model=str(path), verdict="classify", max_concurrency=4,
                             template=TEMPLATE, system="")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    engine = await VLLMRewardModel.launch(settings)
    started = new_processes(me, before)
    try:
        scorer = JudgeScorer(settings, engine)
        scored = await asyncio.gather(*(scorer.score(response(i, f"{i + 40}")) for i in range(4)))
        assert [s.error for s in scored] == [None] * 4
        assert len({round(s.reward, 6) for s in scored}) > 1  # a score per response
        assert all(math.isfinite(s.reward) and s.correct == (s.reward > 0) for s in scored)
    finally:
        await engine.aclose()
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


async def test_a_killed_judge_engine_is_restarted_while_the_other_serves(vllm_engine, tiny_model_dir):
    """Two engines in the pool: one started here and killed (its processes, SIGKILL),
    the session's the other. Verdicts go on through the other while the dead one starts
    again in a thread; it rejoins, serves, and no process of either outlives the pool."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    settings = dataclasses_replace(SETTINGS, model=str(tiny_model_dir), timeout_s=120.0)
    mortal = await VLLMJudge.launch(settings)
    first = new_processes(me, before)
    other = VLLMJudge(vllm_engine, tokenizer(tiny_model_dir), settings, owned=False)
    lines: list[str] = []
    relaunch = relaunch_with(lambda: VLLMJudge.launch(settings, in_thread=True))
    pool = JudgePool([mortal, other], ["engine A", "engine B"], relaunch=[relaunch, None],
                     restarts=Backoff(limit=2, backoff_s=0.1), log=lines.append)
    scorer = JudgeScorer(settings, pool)
    try:
        texts = [f"{i} + 40 = {i + 40}" for i in range(8)]
        scored = await asyncio.gather(*(scorer.score(response(i, t)) for i, t in enumerate(texts)))
        assert [s.error for s in scored] == [None] * 8
        for p in first:
            os.kill(p.pid, signal.SIGKILL)
        # Verdicts asked right after the kill: the dead engine's are asked again of B.
        during, i = 0, 8
        loop = asyncio.get_running_loop()
        slowest = 0.0
        seen_down = False
        while not (seen_down and pool.members[0].state is EngineState.LIVE):
            started = loop.time()
            scored = await scorer.score(response(i, f"{i} + 40 = {i + 40}"))
            slowest = max(slowest, loop.time() - started)
            assert scored.error is None, scored.error
            during += pool.members[0].state is EngineState.DOWN
            seen_down = seen_down or pool.members[0].state is EngineState.DOWN
            i += 1
            assert i < 5000, "engine A never came back"
        # The restart loaded its model in a thread: B's verdicts went on meanwhile.
        assert during >= 5 and slowest < 10.0, (during, slowest)
        back = pool.engines[0]
        assert back is not mortal and isinstance(back, VLLMJudge)
        assert (await back.judge(request_for(settings, response(1, "41")), "direct")).yes_logprob is not None
        metrics = scorer.metrics()
        assert metrics["reward_judge_restarts"] == 1.0 and metrics["reward_judge_engines_live"] == 2.0
        assert "restarting it" in lines[0] and "is back" in lines[1]
        restarted = [p for p in new_processes(me, before) if p.pid not in {q.pid for q in first}]
        assert restarted, "the restarted engine runs in a process of its own"
    finally:
        await pool.aclose()
    _, alive = psutil.wait_procs(new_processes(me, before), timeout=15)
    assert not alive, [p.cmdline() for p in alive]


# -- a reasoning verdict, read right after its marker, by rpk's tiny judge -------------------

# A few warm-up steps: a judge that has not learnt to write its marker in 6 tokens.
TINY_JUDGE = JudgeTinySpec(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
    max_position_embeddings=512, sft_steps=10, sft_batch_tokens=1024, sft_problems=100,
    task=ArithSpec(max_digits=4),
)


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import dataclasses

    from rpk.tasks.tiny import build_tiny_model

    recipe = dataclasses.replace(JUDGE, evaluate=None)
    return build_tiny_model(TINY_JUDGE, tmp_path_factory.mktemp("tiny-judge"), lambda _: None, recipe)


async def _p_yes_after(judge: VLLMJudge, ids: list[int], request_id: str) -> float:
    """P(yes) among the two words at the token after `ids`, asked of the engine directly."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, logprob_token_ids=judge._words,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async for out in judge.engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
        first = out.outputs[0].logprobs[0]
    yes, no = (math.exp(first[t].logprob) for t in judge._words)
    return yes / (yes + no)


async def _greedy(judge: VLLMJudge, ids: list[int], tokens: int) -> object:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
    async for out in judge.engine.llm.generate(TokensPrompt(prompt_token_ids=ids), greedy, "probe"):
        said = out.outputs[0]
    return said


async def test_a_reasoning_verdict_without_its_marker_is_read_after_rpks(tiny_judge_dir):
    """rpk's tiny judge, barely trained, does not write the marker within its budget: rpk
    drops an end of text, appends the marker and reads P(yes) at the token after it."""
    settings = dataclasses_replace(jm.DEFAULT, model=str(tiny_judge_dir), verdict=Verdict.REASON,
                                   reason_tokens=6, min_mass=0.0, max_concurrency=4)
    judge = await VLLMJudge.launch(settings)
    try:
        case = tiny_eval.band_cases(TINY_JUDGE, 2)["1-3"][0]
        prompt = Prompt("r", (1,), "qa", case.reference, {"question": "", "reference": case.reference})
        asked = Response(prompt, 0, (1,), (0.0,), "stop", 0, text=case.response)
        ids = judge.tokens.ids(request_for(settings, asked))
        said = await _greedy(judge, ids, 6)  # greedy: what the verdict's thought will be
        assert "Verdict:" not in said.text
        scorer = JudgeScorer(settings, judge)
        cut = await scorer.score(asked)
        thought = list(said.token_ids)
        kept = thought[:-1] if said.finish_reason == "stop" else thought
        expected = await _p_yes_after(judge, ids + kept + judge._marker, "cut")
        assert cut.error is None and cut.reward == pytest.approx(expected, abs=1e-4)
        assert scorer.metrics()["reward_judge_reason_cut"] == 1
    finally:
        await judge.aclose()


async def test_a_reasoning_verdict_is_read_right_after_the_marker_the_judge_wrote(vllm_engine, tiny_model_dir):
    """With the text of its first tokens as the marker (the untrained model writes
    newlines), the judge writes the marker: vLLM stops there and P(yes) is read after the
    judge's own tokens."""
    base = dataclasses_replace(SETTINGS, verdict=Verdict.REASON, reason_tokens=8)
    probe = VLLMJudge(vllm_engine, tokenizer(tiny_model_dir), base, owned=False)
    asked = response(3, "3 + 40 = 43")
    ids = probe.tokens.ids(request_for(base, asked))
    thought = list((await _greedy(probe, ids, 8)).token_ids)
    text = [probe.tokenizer.decode(thought[:k], skip_special_tokens=True) for k in range(len(thought) + 1)]
    k = next(k for k, t in enumerate(text) if t)
    settings = dataclasses_replace(base, verdict_marker=text[k])
    scorer = JudgeScorer(settings, VLLMJudge(vllm_engine, probe.tokenizer, settings, owned=False))
    own = await scorer.score(asked)
    expected = await _p_yes_after(probe, ids + thought[:k], "wrote")
    assert own.error is None and own.reward == pytest.approx(expected, abs=1e-4)
    m = scorer.metrics()
    assert (m["reward_judge_reason_cut"], m["reward_judge_answered"]) == (0, 1)
