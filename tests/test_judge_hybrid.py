"""Judge and rule on one row (rpk.reward.hybrid): the weighted judge term, the cascade,
per-row rubrics (rpk.reward.rubric), group judging (rpk.reward.group) and the confusion
they count, against a fake judge that reads the prompt it is sent."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rpk.config import Config, ConfigError, RewardConfig
from rpk.config.inputs import JudgeConfig
from rpk.core.outcomes import RoundPlan
from rpk.core.records import Prompt, Response, RoundKind, Scored
from rpk.loop.rollout import run_round
from rpk.reward import RewardError, RewardSettings, WeightedSum, make_scorer
from rpk.reward.functions import JudgeTermSpec, split_judge_term
from rpk.reward.group import PAIR_QUESTION, PAIR_SYSTEM, GroupJudge, GroupJudging, group_request, shuffled
from rpk.reward.hybrid import Hybrid, HybridSettings, step_columns, step_counts
from rpk.reward.judge import JudgeRequest, JudgeScorer, JudgeSettings, Reading
from rpk.reward.rubric import (
    RUBRIC_SYSTEM,
    RUBRIC_TEMPLATE,
    JudgeTerm,
    check_rubric_template,
    criteria_of,
    rubric_request,
)
from rpk.reward.watch import ErrorLog, FailureRule, RewardWatch
from rpk.tasks import arith_judged
from rpk.tasks.specs import ArithSpec
from tests.fakes import ScriptedEngine, mean_centred, scorer_of

SETTINGS = JudgeSettings(model="fake-judge", data_sources=("qa",), timeout_s=2.0)


def reading(p: float) -> Reading:
    return Reading(yes_logprob=math.log(p), no_logprob=math.log(1 - p))


class ReadingJudge:
    """A judge that reads what it is sent, as a model would see it:

    - one response (`<response>` ... `</response>`): P(yes) 0.9 when the block holds the
      reference anywhere (lenient: it passes "the answer is 42", which a strict rule
      fails), else 0.2;
    - a rubric criterion ("Criterion: ..."): 0.9 when the criterion's last word is in the
      response, else 0.2;
    - a list ("Is response k correct?"): response k's block as above;
    - a pair ("Is response 1 better than response 2?"): 0.5 + 0.3 x (holds(1) -
      holds(2)), plus 0.1 for the first place: a position bias both orders cancel.

    Records every request (its messages and when it started and ended)."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.asked: list[list[dict[str, str]]] = []
        self.events: list[tuple[str, str]] = []
        self.delay = delay
        self.fail = fail  # a response text the judge cannot answer about (raises)

    async def ready(self) -> None:
        return None

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        messages = request.chat()
        self.asked.append(messages)
        self.events.append(("start", request_id))
        await asyncio.sleep(self.delay)
        self.events.append(("end", request_id))
        user = messages[-1]["content"]
        reference = re.search(r"Reference answer:\n(.*)\n", user).group(1)
        blocks = re.findall(r"<response(?: id=\d+)?>\n(.*?)\n</response>", user, re.S)
        if self.fail is not None and any(self.fail in b for b in blocks):
            raise RuntimeError("the judge's engine refused the request")
        holds = [reference.lower() in b.lower() for b in blocks]  # labels in either case
        if (m := re.search(r"Criterion: (.*)\n", user)) is not None:
            word = m.group(1).split()[-1]
            return reading(0.9 if word in blocks[0] else 0.2)
        if (m := re.search(r"Is response (\d+) correct\?", user)) is not None:
            return reading(0.9 if holds[int(m.group(1)) - 1] else 0.2)
        if "Is response 1 better than response 2?" in user:
            return reading(0.5 + 0.3 * (holds[0] - holds[1]) + 0.1)
        return reading(0.9 if holds[0] else 0.2)

    async def aclose(self) -> None:
        return None


def strict(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """The rule: exactly `Answer: <truth>`; it raises on a response it cannot parse."""
    if "BOOM" in solution_str:
        raise ValueError("cannot parse")
    return float(solution_str.strip() == f"Answer: {ground_truth}")


def response(text: str, uid: str = "u", index: int = 0, source: str = "qa", truth: str = "42",
             **info: Any) -> Response:
    prompt = Prompt(uid, (1,), source, truth, {"question": "What is 6 x 7?", **info}, "chat")
    return Response(prompt, index, (5,), (-0.1,), "stop", 0, text=text)


def stack_of(hybrid: HybridSettings, engine: ReadingJudge, rule: Any = strict, compare: bool = False):
    judge = JudgeScorer(dataclasses.replace(SETTINGS, compare_rules=compare), engine)
    return make_scorer(RewardSettings(backend="thread"), {"qa": rule}, max_tokens=8, judge=judge,
                       hybrid=hybrid)


# ------------------------------------------------------------------ weighted


async def test_the_weighted_judge_term_adds_to_the_rule_terms_and_both_score():
    engine = ReadingJudge()
    rule = WeightedSum(((strict, 0.7),))
    judge_first = stack_of(HybridSettings(Hybrid.WEIGHTED, judge_weight=0.3, judge_first=True), engine, rule)
    right, loose, wrong = (response(t) for t in ("Answer: 42", "so it is 42", "Answer: 41"))
    scored = [await judge_first.score(r) for r in (right, loose, wrong)]
    assert [s.reward for s in scored] == pytest.approx([0.3 * 0.9 + 0.7, 0.3 * 0.9, 0.3 * 0.2])
    # The judge is the first term: its verdict is the sample's.
    assert [s.correct for s in scored] == [True, True, False]
    assert len(engine.asked) == 3
    rule_first = stack_of(HybridSettings(Hybrid.WEIGHTED, judge_weight=0.3), ReadingJudge(), rule)
    assert not (await rule_first.score(loose)).correct  # the rule's verdict now
    # Judge and rule scored every row: the judge passed one the rule failed (loose).
    step = step_columns(step_counts({}, judge_first.router.tallies()))
    assert (step["reward_judge_rule_tp"], step["reward_judge_rule_fp"], step["reward_judge_rule_tn"],
            step["reward_judge_rule_fn"]) == (1, 1, 1, 0)
    assert step["reward_judge_fp_rate"] == pytest.approx(0.5) and step["reward_judge_fn_rate"] == 0.0
    await judge_first.aclose()


async def test_a_weighted_terms_failure_is_the_samples_as_a_functions_is():
    stack = stack_of(HybridSettings(Hybrid.WEIGHTED, judge_weight=0.5),
                     ReadingJudge(fail="refuse"), WeightedSum(((strict, 1.0),)))
    by_rule = await stack.score(response("BOOM 42"))  # the rule raised; the judge answered
    assert by_rule.error is not None and by_rule.error.startswith("raised:") and by_rule.reward == 0.0
    by_judge = await stack.score(response("Answer: 42 refuse"))  # the judge failed
    assert by_judge.error is not None and by_judge.error.startswith("judge_engine:")
    fine = await stack.score(response("Answer: 42"))
    assert fine.error is None and fine.reward == pytest.approx(0.5 * 0.9 + 1.0)
    # Failed samples are not compared: one row both scored.
    assert sum(stack.router.tallies()[f"judge_rule_{c}"] for c in ("tp", "fp", "tn", "fn")) == 1
    m = stack.metrics()
    assert m["reward_failed_raised_total"] == 1 and m["reward_failed_judge_engine_total"] == 1


def test_the_judge_term_is_split_from_the_function_terms():
    assert split_judge_term(("judge=0.3", "builtin=0.7")) == (JudgeTermSpec(0.3, True), ("builtin=0.7",))
    assert split_judge_term(("builtin", "judge=2")) == (JudgeTermSpec(2.0, False), ("builtin",))
    assert split_judge_term(("builtin=1",)) == (None, ("builtin=1",))
    with pytest.raises(RewardError, match="needs rule terms beside it"):
        split_judge_term(("judge=1",))
    with pytest.raises(ConfigError, match="one judge term at most"):
        RewardConfig(functions=("judge=1", "judge=2", "builtin"))
    with pytest.raises(ConfigError, match="pick one way"):
        RewardConfig(functions=("judge=1", "builtin"), judge=JudgeConfig(mode="cascade"))
    rows = [Prompt("r1", (1,), "qa", "42", {}, "chat")]
    with pytest.raises(ConfigError, match="reward model") as e:
        scorer_of(Config(reward=RewardConfig(judge=JudgeConfig(
            model="j", data_sources=("qa",), verdict="classify", group="listwise"))), rows)
    assert "reward.judge.group" in str(e.value)


def _judged_task_prompts(n: int) -> list[Prompt]:
    rows = arith_judged.make_rows(n, seed=5, spec=ArithSpec(max_digits=4))
    return [Prompt(f"p{i}", (1,), r["data_source"], r["reward_model"]["ground_truth"], r["extra_info"],
                   r["prompt"][0]["content"], reward_style=r["reward_model"]["style"])
            for i, r in enumerate(rows)]


async def test_the_config_weights_the_judge_on_judged_rows_and_the_rule_alone_elsewhere():
    prompts = _judged_task_prompts(4)
    cfg = Config(reward=RewardConfig(backend="thread", functions=("builtin=0.7", "judge=0.3"),
                                     judge=JudgeConfig(model="judge-dir", canaries=0)))
    stack = scorer_of(cfg, prompts)
    assert stack.router.hybrid == HybridSettings(Hybrid.WEIGHTED, 0.3, False, seed=cfg.run.seed)
    engine = ReadingJudge()
    stack.judge.engine = engine
    for p in prompts:
        # The judged rows' reference has lower-case labels; the policy writes upper case.
        answer = str(p.extra_info.get("reference", p.ground_truth)).upper()
        right = Response(p, 0, (1,), (0.0,), "stop", 0, text=f"Answer: {answer}")
        s = await stack.score(right)
        judged = p.reward_style == "model"
        assert s.correct and s.reward == pytest.approx(0.7 + (0.3 * 0.9 if judged else 0.0))
    assert len(engine.asked) == 2  # the judged half only
    with pytest.raises(ConfigError, match="no row is judged"):
        scorer_of(cfg, [p for p in prompts if p.reward_style != "model"])
    await stack.aclose()


# ------------------------------------------------------------------ cascade


async def test_the_cascade_asks_the_judge_only_where_the_rule_says_no_or_fails(tmp_path: Path):
    engine = ReadingJudge()
    stack = stack_of(HybridSettings(Hybrid.CASCADE), engine)
    watch = RewardWatch(stack, ErrorLog(tmp_path / "e.jsonl"), FailureRule(0.5, 3))
    watch.begin_step(1)
    right = await watch.score(response("Answer: 42"))
    assert right.reward == 1.0 and right.correct and engine.asked == []  # the rule's yes stands
    rescued = await watch.score(response("The sum is 42."))  # the rule's false negative
    assert rescued.correct and rescued.reward == pytest.approx(0.9)
    wrong = await watch.score(response("Answer: 41"))
    assert not wrong.correct and wrong.reward == pytest.approx(0.2)
    unparsed = await watch.score(response("BOOM, 42"))  # the rule cannot score it: the judge does
    assert unparsed.error is None and unparsed.correct
    assert len(engine.asked) == 3
    columns = watch.end_step()
    assert (columns["reward_cascade_rows"], columns["reward_cascade_to_judge"],
            columns["reward_cascade_rule_no"], columns["reward_cascade_rule_failed"],
            columns["reward_cascade_rescued"]) == (4, 3, 2, 1, 1)
    assert columns["reward_cascade_judge_frac"] == pytest.approx(3 / 4)
    assert columns["reward_cascade_rescue_rate"] == pytest.approx(1 / 2)
    # Only rows the rule said no to are compared: an fp (the rescue) and a tn.
    assert (columns["reward_judge_rule_fp"], columns["reward_judge_rule_tn"],
            columns["reward_judge_rule_tp"], columns["reward_judge_rule_fn"]) == (1, 1, 0, 0)
    assert columns["reward_judge_fp_rate"] == pytest.approx(0.5) and "reward_judge_fn_rate" not in columns
    assert columns["reward_failed"] == 0  # the rule's failure cost no sample: the judge answered
    watch.begin_step(2)
    await watch.score(response("Answer: 42"))
    quiet = watch.end_step()
    assert (quiet["reward_cascade_rows"], quiet["reward_cascade_to_judge"]) == (1, 0)
    assert quiet["reward_cascade_judge_frac"] == 0.0 and "reward_cascade_rescue_rate" not in quiet


async def test_a_cascade_cannot_judge_groups():
    with pytest.raises(RewardError, match="cannot serve reward.judge.mode cascade"):
        stack_of(HybridSettings(Hybrid.CASCADE, group=GroupJudging.LISTWISE), ReadingJudge())


# ------------------------------------------------------------------ alone, compared


async def test_alone_with_the_rule_beside_counts_every_cell_and_keeps_the_judges_reward():
    stack = stack_of(HybridSettings(), ReadingJudge(), compare=True)
    texts = ["Answer: 42", "so 42", "Answer: 41", "Answer: 42"]
    scored = [await stack.score(response(t)) for t in texts]
    assert [s.reward for s in scored] == pytest.approx([0.9, 0.9, 0.2, 0.9])
    t = stack.router.tallies()
    assert (t["judge_rule_tp"], t["judge_rule_fp"], t["judge_rule_tn"], t["judge_rule_fn"]) == (2, 1, 1, 0)
    plain = stack_of(HybridSettings(), ReadingJudge())  # nothing compared: no cells at all
    await plain.score(response("so 42"))
    assert "judge_rule_fp" not in plain.router.tallies()
    assert step_columns(step_counts({}, plain.router.tallies())) == {}


# ------------------------------------------------------------------ rubrics


RUBRIC = ["Gives the final answer 42",
          {"criterion": "Shows the carries", "weight": 3, "name": "Carries!"}]


async def test_a_rubric_is_one_request_per_criterion_the_prefix_shared_and_first():
    engine = ReadingJudge(delay=0.01)
    term = JudgeTerm(JudgeScorer(SETTINGS, engine))
    rows = [response("I add, carries noted: 42", rubric=RUBRIC, uid="a"),
            response("It is 42", rubric=RUBRIC, uid="b")]
    scored = [await term.score(r) for r in rows]
    # a: both criteria met; b: only the first (weight 1 of 4).
    assert scored[0].reward == pytest.approx(0.9) and scored[0].correct
    assert scored[1].reward == pytest.approx((0.9 + 3 * 0.2) / 4) and not scored[1].correct
    first, second = engine.asked[0], engine.asked[1]
    assert [m["role"] for m in first] == ["system", "user"]
    # Everything before the criterion is the row's, the same for each criterion.
    head = first[-1]["content"].split("Criterion:")[0]
    assert second[-1]["content"].startswith(head) and second[0] == first[0]
    assert first[-1]["content"].rstrip().endswith("Reply YES or NO.")
    # The first criterion's request ended before the others started (the prefix warm).
    starts = [i for i, (e, _) in enumerate(engine.events) if e == "start"]
    assert engine.events[1][0] == "end" and starts[1] > 1
    step = step_columns(step_counts({}, term.tallies()))
    assert step["reward_rubric_c1_asked"] == 2 and step["reward_rubric_c1_mean"] == pytest.approx(0.9)
    assert step["reward_rubric_carries_asked"] == 2
    assert step["reward_rubric_carries_mean"] == pytest.approx((0.9 + 0.2) / 2)
    assert step["reward_rubric_rows"] == 2
    plain = await term.score(response("42"))  # a row without a rubric: one verdict
    assert plain.reward == pytest.approx(0.9) and len(engine.asked) == 5


async def test_a_failed_criterion_fails_the_row():
    term = JudgeTerm(JudgeScorer(SETTINGS, ReadingJudge(fail="refuse")))
    s = await term.score(response("refuse 42", rubric=RUBRIC))
    assert s.error is not None and s.error.startswith("judge_engine:") and s.reward == 0.0


def test_rubrics_and_their_template_are_checked_naming_the_row():
    assert [c.weight for c in criteria_of(response("x", rubric=RUBRIC).prompt)] == [1.0, 3.0]
    assert criteria_of(response("x").prompt) == ()
    for bad, why in (("nope", "non-empty list"), ([], "non-empty list"), ([""], "non-empty text"),
                     ([{"criterion": "a", "weight": 0}], "weight"), ([{"text": "a"}], "unknown keys"),
                     ([3], "string or a mapping")):
        with pytest.raises(RewardError, match=f"row u: extra_info.rubric.*{why}"):
            criteria_of(response("x", rubric=bad).prompt)
    with pytest.raises(RewardError, match="criterion goes last"):
        check_rubric_template("{criterion}\n<response>{response}</response>")
    with pytest.raises(RewardError, match="no {criterion}"):
        check_rubric_template("{response}")
    check_rubric_template("Q {question} R {reference} <response>{response}</response> C {criterion}")


def test_a_rubric_with_group_judging_or_a_classify_judge_is_refused():
    row = Prompt("r1", (1,), "qa", "42", {"rubric": RUBRIC}, "chat")
    for judge, field in ((JudgeConfig(model="j", data_sources=("qa",), group="pairwise"), "reward.judge.group"),
                         (JudgeConfig(model="j", data_sources=("qa",), verdict="classify"), "reward.judge.verdict")):
        with pytest.raises(ConfigError, match="first: r1") as e:
            scorer_of(Config(reward=RewardConfig(judge=judge)), [row])
        assert field in str(e.value)


def test_a_rubrics_and_a_groups_requests_show_a_response_as_the_grading_request_does():
    # Thinking stripped, the tail kept, a delimiter defused; no system message for a
    # judge trained without one.
    settings = dataclasses.replace(SETTINGS, strip_think=True, max_response_chars=30)
    text = "<think>so 41?</think>long working, </response> then: 42"
    row = response(text)
    group_user = group_request(settings, PAIR_SYSTEM, row, [text, text], PAIR_QUESTION).chat()
    rubric_user = rubric_request(settings, RUBRIC_TEMPLATE, RUBRIC_SYSTEM, row, "Says 42").chat()
    assert group_user[0]["role"] == rubric_user[0]["role"] == "system"
    assert "<response id=1>\nponse> then: 42\n</response>" in group_user[-1]["content"]  # 30 // 2 each
    assert "<response>\n working, (/response) then: 42\n</response>" in rubric_user[-1]["content"]
    assert all("41" not in m["content"] for m in group_user + rubric_user)
    bare = dataclasses.replace(settings, system="")
    for request in (group_request(bare, PAIR_SYSTEM, row, [text], PAIR_QUESTION),
                    rubric_request(bare, RUBRIC_TEMPLATE, RUBRIC_SYSTEM, row, "Says 42")):
        assert [m["role"] for m in request.chat()] == ["user"]
        assert "What is 6 x 7?" in request.chat()[0]["content"]


# ------------------------------------------------------------------ groups


def group(texts: Sequence[str], uid: str = "g") -> list[Response]:
    prompt = Prompt(uid, (1,), "qa", "42", {"question": "What is 6 x 7?"}, "chat")
    return [Response(prompt, i, (5,), (-0.1,), "stop", 3, text=t) for i, t in enumerate(texts)]


async def test_listwise_asks_about_each_response_in_a_shuffled_list():
    engine = ReadingJudge()
    judge = GroupJudge(JudgeScorer(SETTINGS, engine), GroupJudging.LISTWISE, seed=1)
    members = group(["it is 42", "41", "42!", "no idea", "4 2"])
    scored = await judge.score_group(members)
    assert [s.response.index for s in scored] == [0, 1, 2, 3, 4]
    assert [s.reward for s in scored] == pytest.approx([0.9, 0.2, 0.9, 0.2, 0.2])
    lists = [m[-1]["content"] for m in engine.asked]
    heads = {u.split("\n\nIs response")[0] for u in lists}
    assert len(lists) == 5 and len(heads) == 1  # one list, the prefix of every question
    order = re.findall(r"<response id=\d+>\n(.*?)\n</response>", lists[0], re.S)
    assert order == [r.text for r in shuffled(members, 1)] and order != [r.text for r in members]
    assert shuffled(members, 1) == shuffled(members, 1)  # a rerun lists them alike
    assert judge.tallies() == {"groups": 1.0, "group_requests": 5.0}


async def test_pairwise_averages_both_orders_and_cancels_the_position_bias():
    engine = ReadingJudge()
    judge = GroupJudge(JudgeScorer(SETTINGS, engine), GroupJudging.PAIRWISE)
    scored = await judge.score_group(group(["42", "41", "so 42"]))
    assert len(engine.asked) == 6  # 3 pairs, both orders
    # A right answer beats the wrong one (0.8, the bias gone) and ties the other (0.5).
    assert [s.reward for s in scored] == pytest.approx([0.65, 0.2, 0.65])
    assert [s.correct for s in scored] == [True, False, True]


async def test_a_pairwise_response_fails_only_when_none_of_its_comparisons_was_read():
    judge = GroupJudge(JudgeScorer(SETTINGS, ReadingJudge(fail="refuse")), GroupJudging.PAIRWISE)
    scored = await judge.score_group(group(["42", "41", "refuse"]))
    # Every comparison of the third was refused; the others keep the one they had.
    assert [s.error is None for s in scored] == [True, True, False]
    assert scored[2].error.startswith("judge_engine:")
    assert [s.reward for s in scored[:2]] == pytest.approx([0.8, 0.2])


class GroupCounter:
    """A group scorer over every row: records each group it was handed."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.single: list[str] = []

    def by_group(self, prompt: Prompt) -> bool:
        return prompt.uid != "p1"

    async def score_group(self, responses: Sequence[Response]) -> list[Scored]:
        self.groups.append([r.index for r in responses])
        await asyncio.sleep(0)
        return [Scored(r, float(r.index), True) for r in responses]

    async def score(self, response: Response) -> Scored:
        self.single.append(response.prompt.uid)
        return Scored(response, -1.0, False)

    async def aclose(self) -> None:
        return None


async def test_a_round_hands_each_group_over_once_its_last_response_has_finished():
    prompts = [Prompt(f"p{i}", (1, i), "qa", "42") for i in range(3)]
    plan = RoundPlan(step=1, kind=RoundKind.SHORT, prompts=tuple(prompts), responses_per_prompt=4,
                     group_size=3, groups_needed=3, max_tokens=64)
    engine = ScriptedEngine(lambda r: 4 + 2 * int(r.request_id[-1]))
    scorer = GroupCounter()
    result = await run_round(plan, engine, scorer, mean_centred, version=0, groups=scorer)
    # p0 and p2: one group each, its first three finishers, sorted; p1: one by one.
    assert scorer.groups == [[0, 1, 2], [0, 1, 2]] and scorer.single == ["p1"] * 3
    rewards = {g.prompt.uid: [m.reward for m in g.members] for g in result.groups}
    assert rewards == {"p0": [0.0, 1.0, 2.0], "p1": [-1.0] * 3, "p2": [0.0, 1.0, 2.0]}


async def test_a_group_judged_run_scores_groups_through_the_watch(tmp_path: Path):
    engine = ReadingJudge()
    stack = stack_of(HybridSettings(Hybrid.WEIGHTED, judge_weight=1.0, group=GroupJudging.LISTWISE),
                     engine, WeightedSum(((strict, 1.0),)))
    watch = RewardWatch(stack, ErrorLog(tmp_path / "e.jsonl"), FailureRule(0.5, 3))
    members = group(["Answer: 42", "so 42", "Answer: 41"])
    assert watch.by_group(members[0].prompt) and watch.groups
    watch.begin_step(1)
    scored = await watch.score_group(members)
    assert [s.reward for s in scored] == pytest.approx([1.9, 0.9, 0.2])
    columns = watch.end_step()
    assert columns["reward_scored"] == 3 and columns["reward_groups"] == 1
    assert columns["reward_group_requests"] == 3
    assert (columns["reward_judge_rule_tp"], columns["reward_judge_rule_fp"],
            columns["reward_judge_rule_tn"]) == (1, 1, 1)
    # Outside a round (validation) the same rows are judged one by one.
    assert (await stack.score(members[1])).reward == pytest.approx(0.9)


async def test_validation_between_steps_is_no_steps_confusion(tmp_path: Path):
    stack = stack_of(HybridSettings(), ReadingJudge(), compare=True)
    watch = RewardWatch(stack, ErrorLog(tmp_path / "e.jsonl"), FailureRule(0.5, 3))
    watch.begin_step(1)
    await watch.score(response("so 42"))
    assert watch.end_step()["reward_judge_rule_fp"] == 1
    for _ in range(3):  # validation scores through the stack, not the watch
        await stack.score(response("so 42"))
    watch.begin_step(2)
    await watch.score(response("Answer: 42"))
    columns = watch.end_step()
    assert (columns["reward_judge_rule_fp"], columns["reward_judge_rule_tp"]) == (0, 1)
