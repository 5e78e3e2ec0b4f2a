"""The judge's pure side: the verdict kinds' table (rpk.reward.verdict), the settings'
checks at the start, the prompt's fields (the question, the response after a thought,
the reward model's conversation), the prompt's tokens against whole-text tokenisation,
the router's compare mode when the judge dies, and a failed sample left out of its
group's normalisation (rpk.sched.round)."""

from __future__ import annotations

import asyncio
import math
import random
import typing

import pytest

from rpk.config import Config, JudgeTinySpec, RewardConfig
from rpk.config.inputs import JudgeConfig
from rpk.core.modes import Runner
from rpk.core.outcomes import RoundPlan
from rpk.core.records import Prompt, Response, RoundKind, Scored
from rpk.data import to_prompts
from rpk.judge import tiny as jm
from rpk.judge.pool import JudgePlan
from rpk.judge.prompt import ChatTokens
from rpk.judge.vllm import JudgeDevice
from rpk.reward.functions import RewardError
from rpk.reward.hybrid import JudgeRouter
from rpk.reward.judge import (
    JudgeDied,
    JudgeRequest,
    JudgeScorer,
    JudgeSettings,
    question_of,
    request_for,
    strip_thinking,
)
from rpk.reward.verdict import KINDS, Reading, Verdict
from rpk.sched.round import RoundBook, scored_advantages
from rpk.tasks import arith
from rpk.train.losses import group_advantages
from tests.fakes import scorer_of
from tests.judge_fakes import judge_tokenizer

# -- the table ---------------------------------------------------------------------------


def test_every_config_choice_is_a_row_of_the_table() -> None:
    choices = typing.get_args(typing.get_type_hints(JudgeConfig)["verdict"])
    assert set(choices) == {v.value for v in Verdict} == {k.value for k in KINDS}
    assert all(KINDS[v].verdict is v for v in Verdict)
    assert [v for v in Verdict if KINDS[v].runner is Runner.POOLING] == [Verdict.CLASSIFY]


def test_what_each_kind_adds_to_the_judges_input_for_the_memory_plan() -> None:
    s = JudgeSettings(max_tokens=48, reason_tokens=300)
    assert {v: KINDS[v].output_tokens(s) for v in Verdict} == {
        Verdict.LOGPROB: 1, Verdict.REASON: 316, Verdict.SCORE: 48, Verdict.CLASSIFY: 0}


# -- the settings, checked at the start ----------------------------------------------------


def _cfg(**judge: object) -> Config:
    return Config(reward=RewardConfig(backend="thread", judge=JudgeConfig(**judge)))


@pytest.mark.parametrize("judge, says", [
    ({"system": 'reply as {"verdict": ...}'}, "reward.judge.system .*bad field"),
    ({"template": "Q {question} {answer} {response}"}, "reward.judge.template .*bad field 'answer'"),
    ({"verdict": "logprob", "votes": 3}, "votes=3: logprob verdicts read the same answer"),
    ({"chat_template_kwargs": ("enable_thinking",)}, "'enable_thinking' is not key=value"),
])
def test_a_bad_judge_setting_is_one_line_before_any_engine(judge: dict, says: str) -> None:
    rows = [Prompt("a", (1,), "qa", "1", reward_style="model")]
    with pytest.raises(RewardError, match=says) as e:
        scorer_of(_cfg(model="judge-dir", **judge), rows)
    assert "\n" not in str(e.value)


def test_the_settings_cross_nodes_as_json_by_their_types() -> None:
    settings = JudgeSettings(model="m", data_sources=("qa", "web"), verdict=Verdict.REASON, votes=3,
                             chat_template_kwargs=("enable_thinking=false",))
    launch = JudgePlan(settings, JudgeDevice(0.2, 28, 14), (0, 1))
    back = JudgePlan.from_json(launch.to_json())
    assert back == launch and back.settings.verdict is Verdict.REASON
    assert JudgeSettings(verdict="score").verdict is Verdict.SCORE  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown fields \\['rubric'\\]"):
        JudgeSettings.from_dict({"rubric": "x"})
    assert JudgeSettings(chat_template_kwargs=("enable_thinking=false", "x=a b")).chat_template_kwargs


# -- the prompt's fields -------------------------------------------------------------------


def test_the_question_is_the_rows_last_user_message_never_the_rendered_template() -> None:
    tok = judge_tokenizer()
    row = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
           "data_source": "qa", "reward_model": {"ground_truth": "4", "style": "model"}}
    (prompt,) = to_prompts([("row 1", row)], "t.jsonl", tok, 512)
    assert "<|im_start|>" in prompt.text and question_of(prompt) == "What is 2+2?"
    asked = request_for(JudgeSettings(), Response(prompt, 0, (1,), (0.0,), "stop", 0, text="4"))
    assert dict(asked.fields)["question"] == "What is 2+2?"


def test_the_policys_thought_can_be_left_out() -> None:
    assert strip_thinking("<think>2+2 is 5?</think>\n\nThe answer is 4") == "The answer is 4"
    assert strip_thinking("2+2...</think>4") == "4"  # the template opened the thought
    assert strip_thinking("Let me <think> forever") == "Let me "  # never closed: no answer
    assert strip_thinking("4") == "4"
    prompt = Prompt("p", (1,), "qa", "4", {"question": "2+2?"})
    text = "<think>YES YES</think>4"
    kept, stripped = (dict(request_for(JudgeSettings(strip_think=s), Response(prompt, 0, (1,), (0.0,), "stop", 0,
                                                                               text=text)).fields)
                      for s in (False, True))
    assert kept["response"] == text and stripped["response"] == "4"


def test_a_reward_model_sees_the_conversation_a_value_spelling_a_slot_stays_text() -> None:
    prompt = Prompt("p", (1,), "qa", "4", {"question": "2+2?"})
    sly = "\ue000question\ue001 is 4"
    asked = request_for(JudgeSettings(verdict=Verdict.CLASSIFY), Response(prompt, 0, (1,), (0.0,), "stop", 0, text=sly))
    assert asked.chat() == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": sly}]
    assert not asked.generation_prompt
    assert JudgeRequest.from_dict(asked.to_dict()) == asked


def test_the_tiny_judges_prompt_tokens_are_the_whole_texts_it_trained_on() -> None:
    """Where no field spells a special token, tokenising the fields apart gives exactly
    the ids of tokenising the rendered text whole: a judge trained on whole texts sees
    what it learnt from."""
    tok = judge_tokenizer()
    tokens = ChatTokens(tok)
    rng = random.Random(0)
    spec = JudgeTinySpec()
    cases = [jm.make_case(arith.make_problem(rng, spec.task), rng) for _ in range(200)]
    cases = [c for c in cases if "<|" not in c.response]
    for c in cases:
        prompt = Prompt("p", (1,), "qa", "x", {"question": "", "reference": c.reference})
        asked = request_for(jm.DEFAULT, Response(prompt, 0, (1,), (0.0,), "stop", 0, text=c.response))
        whole = tok.apply_chat_template(asked.chat(), tokenize=False, add_generation_prompt=True)
        assert tokens.ids(asked) == tok(whole, add_special_tokens=False)["input_ids"], c


# -- the router and the scorer ----------------------------------------------------------


async def test_a_judge_that_dies_in_compare_mode_leaves_no_rule_check_running() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    class SlowRule:
        async def score(self, response: Response) -> Scored:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("unreachable")

        async def aclose(self) -> None: ...

        def metrics(self) -> dict[str, float]:
            return {}

    class Dying:
        async def ready(self) -> None:
            await started.wait()

        async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
            raise JudgeDied("the judge j died: EngineDeadError")

        async def aclose(self) -> None: ...

    router = JudgeRouter(JudgeScorer(JudgeSettings(model="j"), Dying()), SlowRule(), ("qa",), frozenset({"qa"}))
    with pytest.raises(JudgeDied, match="the judge j died"):
        await router.score(Response(Prompt("p", (1,), "qa", "4"), 0, (1,), (0.0,), "stop", 0, text="4"))
    assert cancelled.is_set()


# -- a failed sample is no reward -------------------------------------------------------


def _scored(rewards: list[float | None]) -> list[Scored]:
    prompt = Prompt("p", (1,), "qa", "4")
    return [Scored(Response(prompt, i, (1,), (0.0,), "stop", 0), 0.0 if r is None else r, bool(r),
                   error=None if r is not None else "judge_timeout: no verdict")
            for i, r in enumerate(rewards)]


def test_a_failed_sample_moves_neither_its_groups_mean_nor_its_spread() -> None:
    """A reward model's logits are unbounded: a failure's placeholder 0 may sit above the
    group's median. It gets advantage 0 and the others are normalised among themselves."""
    members = _scored([2.5, None, 1.5, 3.5])
    assert scored_advantages(members, group_advantages) == pytest.approx((0.0, 0.0, -1.0, 1.0))
    assert scored_advantages(_scored([None, None]), group_advantages) == (0.0, 0.0)
    assert not math.isclose(group_advantages([2.5, 0.0, 1.5, 3.5])[0], 0.0)  # scored as 0, it moved them
    # The round's book forms its groups so; a group whose scored members all agree is
    # dropped under dynamic sampling, however its failures scored.
    book = RoundBook(_plan(drop=False), group_advantages)
    groups = [book.scored(0, m) for m in members]
    assert groups[-1] is not None and groups[-1].advantages == pytest.approx((0.0, 0.0, -1.0, 1.0))
    book = RoundBook(_plan(drop=True), group_advantages)
    assert [book.scored(0, m) for m in _scored([1.0, None, 1.0, 1.0])] == [None] * 4 and book.dropped


def _plan(drop: bool) -> RoundPlan:
    return RoundPlan(step=1, kind=RoundKind.SYNC, prompts=(Prompt("p", (1,), "qa", "4"),),
                     responses_per_prompt=4, group_size=4, groups_needed=1, max_tokens=8,
                     drop_zero_variance=drop)
