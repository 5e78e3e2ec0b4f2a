"""The judged built-in task (`--data.task arith_judged`): the tiny judge rpk builds
(rpk.judge.tiny), the task's rows and their routing, and the judge/rule
confusion each step reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rpk.assembly.settings import run_judge_settings
from rpk.config import ArithSpec, Config, ConfigError, DataConfig, JudgeTinySpec, ModelConfig, RewardConfig
from rpk.config.inputs import JudgeConfig
from rpk.core.records import Prompt, Response
from rpk.judge import tiny as jm
from rpk.judge.tiny_recipe import build_judge_model, judge_dir
from rpk.obs.metrics import judge_quality, summarize
from rpk.reward.hybrid import step_columns, step_counts
from rpk.reward.judge import DEFAULT_TEMPLATE, JudgeRequest, Reading
from rpk.reward.watch import ErrorLog, FailureRule, RewardWatch
from rpk.tasks import arith, arith_judged, tiny
from tests.fakes import scorer_of

SMALL = JudgeTinySpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
    max_position_embeddings=512, sft_steps=3, sft_batch_tokens=1024, sft_problems=40,
    task=ArithSpec(max_digits=4),
)


# ------------------------------------------------------------------ the judge model
# (its scratchpad, cases, prompt and figures: tests/test_judge_tiny.py)


def test_yes_and_no_are_one_token_each() -> None:
    tok = tiny.build_tokenizer(SMALL, jm.corpus(SMALL))
    for word in ("YES", "NO"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1


def test_build_writes_a_cached_hf_judge_with_its_held_out_figures(tmp_path: Path) -> None:
    lines: list[str] = []
    path = build_judge_model(SMALL, tmp_path, log=lines.append)
    assert path == judge_dir(SMALL, tmp_path) and (path / "model.safetensors").is_file()
    info = json.loads((path / "rpk_tiny.json").read_text())
    figures = info["eval"]
    for key in ("accuracy_1-3", "accuracy_4-4", "false_positive"):
        assert 0.0 <= figures[key] <= 1.0, key
    assert figures["attacks"] >= 50
    assert any(line.startswith("tiny: judge accuracy_1-3") for line in lines)
    assert build_judge_model(SMALL, tmp_path, log=lines.append) == path
    assert lines[-1] == f"tiny: cache hit {path}"
    assert judge_dir(SMALL, tmp_path) != tiny.model_dir(SMALL, tmp_path)  # not the policy's


def test_the_judge_spec_refuses_the_policys_slips() -> None:
    with pytest.raises(ConfigError, match="sft_slip"):
        JudgeTinySpec(sft_slip=0.3)


# ------------------------------------------------------------------ the task's rows


def test_every_other_row_is_judged_on_the_same_problems_as_arith() -> None:
    rows, plain = arith_judged.make_rows(10, seed=7), arith.make_rows(10, seed=7)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in plain]
    for i, (row, base) in enumerate(zip(rows, plain, strict=True)):
        assert row["reward_model"]["ground_truth"] == base["reward_model"]["ground_truth"]
        if i % 2:
            assert row["data_source"] == arith_judged.DATA_SOURCE
            assert row["reward_model"]["style"] == "model"
            question = row["extra_info"]["question"]
            assert question.startswith("What is ") and "Columns" not in question
            assert row["extra_info"]["reference"][1::2] == base["reward_model"]["ground_truth"]
            assert row["extra_info"]["reference"].islower()  # the tiny judge's labels
        else:
            assert row == base
    held = arith_judged.held_out_rows(20, seed=8, exclude=rows)
    assert {r["data_source"] for r in held} == {arith.DATA_SOURCE}


def _cfg(**reward: object) -> Config:
    return Config(data=DataConfig(task="arith_judged"), model=ModelConfig(cache_dir="/c"),
                  reward=RewardConfig(backend="thread", **reward))


def test_the_task_is_judged_by_the_tiny_judge_unless_a_judge_is_set() -> None:
    s = run_judge_settings(_cfg())
    assert s.model == str(judge_dir(JudgeTinySpec(), Path("/c"))) and s.compare_rules
    assert s.system == "" and s.template == jm.TEMPLATE and s.max_response_chars == jm.RESPONSE_CHARS
    assert s.response_after == jm.DEFAULT.response_after
    own = run_judge_settings(_cfg(judge=JudgeConfig(model="my-judge")))
    assert own.model == "my-judge" and own.compare_rules and own.system != ""
    assert own.template == DEFAULT_TEMPLATE and own.max_response_chars == JudgeConfig().max_response_chars
    plain = run_judge_settings(Config())
    assert plain.model is None and not plain.compare_rules


class AnswerJudge:
    """Says YES to any response whose text ends with `Answer: ` and the reference (upper
    case, as the policy writes it): a judge that agrees with the rule on labelled
    answers only. It reads the tiny judge's template."""

    def __init__(self) -> None:
        self.asked = 0

    async def ready(self) -> None:
        pass

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        self.asked += 1
        user = request.chat()[-1]["content"]
        response, _, reference = user.partition("\n\nReference:\n")
        yes = response.endswith(f"Answer: {reference.upper()}")
        return Reading(yes_logprob=math.log(0.9 if yes else 0.1), no_logprob=math.log(0.1 if yes else 0.9))

    async def aclose(self) -> None:
        pass


def _prompts(n: int) -> list[Prompt]:
    rows = arith_judged.make_rows(n, seed=11, spec=ArithSpec(max_digits=5))
    return [Prompt(f"p{i}", (1,), r["data_source"], r["reward_model"]["ground_truth"], r["extra_info"],
                   r["prompt"][0]["content"], reward_style=r["reward_model"]["style"])
            for i, r in enumerate(rows)]


async def test_judged_rows_go_to_the_judge_and_the_rule_and_the_rest_to_the_rule(tmp_path: Path) -> None:
    prompts = _prompts(8)
    stack = scorer_of(_cfg(), prompts)
    engine = AnswerJudge()
    stack.judge.engine = engine
    watch = RewardWatch(stack, ErrorLog(tmp_path / "errors.jsonl"), FailureRule(0.5, 3))
    watch.begin_step(1)
    for p in prompts:
        # Judged rows answered as bare digits: the rule passes them, this judge does not.
        text = f"Answer: {p.ground_truth}"
        scored = await watch.score(Response(p, 0, (1,), (0.0,), "stop", 0, text=text))
        assert scored.error is None and scored.correct == (p.data_source == arith.DATA_SOURCE)
    columns = watch.end_step()
    assert engine.asked == 4
    m = stack.metrics()
    assert (m["reward_routed_judge_total"], m["reward_routed_rule_total"]) == (4, 4)
    assert columns["reward_judge_rule_compared"] == 4 and columns["reward_judge_rule_agreed"] == 0
    assert columns["reward_judge_rule_agreement"] == 0.0
    watch.begin_step(2)
    for p in prompts[1::2]:
        text = f"A1+a1+0=02\nAnswer: {p.extra_info['reference'].upper()}"
        assert (await watch.score(Response(p, 1, (1,), (0.0,), "stop", 0, text=text))).correct
    columns = watch.end_step()  # this step's counts, not the run's totals
    assert (columns["reward_judge_rule_compared"], columns["reward_judge_rule_agreed"],
            columns["reward_judge_rule_agreement"]) == (4, 4, 1.0)
    await stack.aclose()


# ------------------------------------------------------------------ the confusion


def test_a_steps_confusion_is_the_difference_of_the_totals() -> None:
    before = {"judge_rule_tp": 5, "judge_rule_fp": 1, "judge_rule_tn": 3, "judge_rule_fn": 1}
    now = {"judge_rule_tp": 7, "judge_rule_fp": 2, "judge_rule_tn": 6, "judge_rule_fn": 1}
    columns = step_columns(step_counts(before, now))
    assert {k: columns[k] for k in ("reward_judge_rule_tp", "reward_judge_rule_fp",
                                   "reward_judge_rule_tn", "reward_judge_rule_fn")} == {
        "reward_judge_rule_tp": 2, "reward_judge_rule_fp": 1, "reward_judge_rule_tn": 3,
        "reward_judge_rule_fn": 0}
    assert (columns["reward_judge_rule_compared"], columns["reward_judge_rule_agreed"]) == (6, 5)
    assert columns["reward_judge_rule_agreement"] == pytest.approx(5 / 6)
    # Of the 4 answers the rule failed, the judge passed 1; of the 2 it passed, failed 0.
    assert columns["reward_judge_fp_rate"] == pytest.approx(1 / 4)
    assert columns["reward_judge_fn_rate"] == 0.0
    quiet = step_columns(step_counts(now, now))
    assert quiet["reward_judge_rule_compared"] == 0
    assert not {"reward_judge_rule_agreement", "reward_judge_fp_rate", "reward_judge_fn_rate"} & set(quiet)


def _confusion(tp: int, fp: int, tn: int, fn: int) -> dict[str, int]:
    return {"reward_judge_rule_compared": tp + fp + tn + fn, "reward_judge_rule_agreed": tp + tn,
            "reward_judge_rule_tp": tp, "reward_judge_rule_fp": fp, "reward_judge_rule_tn": tn,
            "reward_judge_rule_fn": fn}


def test_the_summary_reports_the_runs_rates_first_and_last() -> None:
    base = {"reward_mean": 0.5, "accuracy": 0.5, "time_step_s": 1.0, "time_rollout_s": 1.0,
            "time_train_s": 1.0, "time_sync_s": 0.0, "tokens_generated": 10}
    cells = [(5, 0, 4, 1), (4, 1, 4, 1), (0, 0, 0, 0), (2, 4, 2, 2), (3, 5, 0, 2)]
    records = [{**base, **_confusion(*c)} for c in cells]
    out = summarize(records, window=2)
    assert out["judge_rule_compared"] == 40
    assert out["judge_rule_agreement"] == pytest.approx(24 / 40)
    assert out["judge_rule_agreement_first"] == pytest.approx(17 / 20)  # the empty step is skipped
    assert out["judge_rule_agreement_last"] == pytest.approx(7 / 20)
    # fp / (fp + tn): the share of the rule's failures the judge passed, not of all rows.
    assert out["judge_fp_rate"] == pytest.approx(10 / 20)
    assert (out["judge_fp_rate_first"], out["judge_fp_rate_last"]) == pytest.approx((1 / 9, 9 / 11))
    assert out["judge_fn_rate"] == pytest.approx(6 / 20)
    assert (out["judge_fn_rate_first"], out["judge_fn_rate_last"]) == pytest.approx((2 / 11, 4 / 9))
    assert judge_quality([base]) == {} and "judge_fp_rate" not in summarize([base])


def test_the_rates_first_and_last_are_thirds_of_a_long_run() -> None:
    # Nine comparing steps: the first and last three, not the window's one, so a single
    # step of hard prompts does not make the last figure.
    cells = [(3, 3, 3, 1)] * 3 + [(5, 2, 2, 1)] * 3 + [(8, 1, 1, 0)] * 2 + [(1, 4, 1, 4)]
    out = judge_quality([_confusion(*c) for c in cells], window=1)
    assert out["judge_rule_agreement_first"] == pytest.approx(18 / 30)
    assert out["judge_rule_agreement_last"] == pytest.approx(20 / 30)
    assert (out["judge_fp_rate_first"], out["judge_fp_rate_last"]) == pytest.approx((9 / 18, 6 / 9))
