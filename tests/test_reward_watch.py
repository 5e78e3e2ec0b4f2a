"""Reward failures are loud: the stop rule on explicit state, the error log as failures
happen, and the step loop that shows them and stops a run whose reward keeps failing."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from rpk import controller
from rpk.assembly.settings import run_settings
from rpk.config import Config, RewardConfig, RolloutConfig, RunConfig
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import read_records
from rpk.obs.progress import LiveProgress
from rpk.reward.watch import ERRORS_FILE, ErrorLog, Failure, FailureRule, RewardFailing, Stop
from tests.fakes import RecordingTrainer, ScriptedEngine, components, make_prompts


def failure(step: int, kind: str = "raised", text: str = "KeyError: 'x'") -> Failure:
    return Failure(step, kind, "t", text)


def test_the_rule_stops_after_max_steps_bad_steps_in_a_row():
    rule = FailureRule(max_frac=0.5, max_steps=3)
    assert rule.observe(10, 6, failure(1)) is None
    assert rule.observe(10, 10, failure(2)) is None
    stop = rule.observe(8, 5, failure(3))
    # the streak's first failure is the one named, the last step's counts are reported
    assert stop == Stop(steps=3, failed=5, scored=8, first=failure(1))


def test_a_good_step_or_an_empty_one_breaks_the_streak():
    rule = FailureRule(max_frac=0.5, max_steps=2)
    assert rule.observe(10, 9, failure(1)) is None
    assert rule.observe(10, 5, failure(2)) is None  # exactly the share: not more than it
    assert rule.streak == 0 and rule.first is None
    assert rule.observe(10, 9, failure(3)) is None
    assert rule.observe(0, 0, None) is None  # nothing scored: not a failing step
    assert rule.observe(10, 9, failure(5)) is None
    assert rule.observe(10, 9, failure(6)) == Stop(2, 9, 10, failure(5))


def test_the_shares_at_the_ends():
    never = FailureRule(max_frac=1.0, max_steps=1)
    assert never.observe(4, 4, failure(1)) is None
    any_failure = FailureRule(max_frac=0.0, max_steps=1)
    assert any_failure.observe(1000, 1, failure(1)) == Stop(1, 1, 1000, failure(1))
    assert any_failure.observe(1000, 0, None) is None
    with pytest.raises(ValueError, match="max_steps >= 1"):
        FailureRule(max_frac=0.5, max_steps=0)


def test_the_error_log_keeps_the_first_of_each_kind_as_they_happen(tmp_path):
    log = ErrorLog(tmp_path / ERRORS_FILE, per_kind=2)
    assert not log.path.exists()  # no failure, no file
    for step in (1, 2, 3):
        log.add(failure(step, "raised", f"ValueError: {step}"))
    log.add(failure(3, "timeout", "killed after 2.0s"))
    lines = [json.loads(line) for line in log.path.read_text().splitlines()]  # before close
    log.close()
    assert lines == [
        {"step": 1, "kind": "raised", "data_source": "t", "text": "ValueError: 1"},
        {"step": 2, "kind": "raised", "data_source": "t", "text": "ValueError: 2"},
        {"step": 3, "kind": "timeout", "data_source": "t", "text": "killed after 2.0s"},
    ]


def test_the_step_line_shows_failures_only_when_there_are_some():
    out = io.StringIO()
    progress = LiveProgress(5, console=Console(file=out, width=300), live=False)
    record = {
        "step": 1, "reward_mean": 0.5, "accuracy": 0.5, "response_len_p50": 4,
        "response_len_max": 8, "time_rollout_s": 1.0, "time_train_s": 0.5, "time_sync_s": 0.1,
        "tokens_per_s": 100.0, "reward_scored": 8, "reward_failed": 0, "reward_failed_raised": 0,
    }
    progress.step_done(record)
    assert "reward failed" not in out.getvalue()
    progress.step_done({**record, "reward_failed": 3, "reward_failed_raised": 1,
                        "reward_failed_timeout": 2, "reward_failed_timeout_total": 7})
    assert out.getvalue().splitlines()[-1].endswith("reward failed 3/8 (raised 1, timeout 2)")


async def test_the_step_loop_shows_failures_and_stops_a_run_whose_reward_keeps_failing(tmp_path):
    cfg = Config(
        rollout=RolloutConfig(policy="sync", prompts_per_step=2, responses_per_prompt=2, max_tokens=8),
        reward=RewardConfig(backend="thread", function="tests.reward_fns:broken"),
        run=RunConfig(steps=10, checkpoint_every=0),
    )
    prompts = make_prompts(8)
    parts = components(cfg, tmp_path, prompts, ScriptedEngine(lambda request: 4), AsyncTrainer(RecordingTrainer()))
    out = io.StringIO()
    progress = LiveProgress(cfg.run.steps, console=Console(file=out, width=300), live=False)
    try:
        with pytest.raises(RewardFailing) as stopped:
            await controller._steps(run_settings(cfg), tmp_path, parts, progress, controller.RunStatus(), None)
    finally:
        await parts.aclose()
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(
        "reward tests.reward_fns:broken failed on more than 50% of the samples in each of "
        "the last 3 steps (the last: 4 of 4); first error (step 1, data_source 'test'): "
        "raised: ValueError: the checker is broken on 'xxxx' [reward.max_failure_frac=0.5, "
        "reward.max_failure_steps=3"
    )
    records = read_records(tmp_path / "metrics.jsonl")
    assert [
        (r["step"], r["reward_scored"], r["reward_failed"], r["reward_failed_raised"],
         r["reward_failed_timeout"]) for r in records
    ] == [(step, 4, 4, 4, 0) for step in (1, 2, 3)]
    logged = [json.loads(line) for line in (tmp_path / ERRORS_FILE).read_text().splitlines()]
    assert [e["step"] for e in logged] == [1, 1, 1, 1, 2]  # the first 5 of the kind
    assert logged[0] == {
        "step": 1, "kind": "raised", "data_source": "test",
        "text": "ValueError: the checker is broken\non 'xxxx'",
    }
    assert out.getvalue().count("reward failed 4/4 (raised 4)") == 3
