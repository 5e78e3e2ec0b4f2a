"""`python -m rpk.run --data.task arith_judged` on the real vLLM engine, its tiny judge
included: every step asks the live judge its canaries beside the round and counts the
judge against the rule, and the summary prints both false-positive rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runs import metrics, overrides, rpk_run

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The judge's small build (a minute or two on 2 cores; the policy's is the other whole
# runs'), head size 32, which vLLM's CPU attention supports.
JUDGE = overrides("model.tiny_judge", hidden_size=64, num_layers=2, intermediate_size=64, sft_steps=20,
                  sft_problems=200, **{"task.max_digits": 4})


def test_a_judged_run_asks_its_canaries_every_step_and_reports_both_rates(tmp_path: Path, rpk_cache: Path):
    proc = rpk_run(tmp_path, rpk_cache, *JUDGE, "--data.task", "arith_judged", "--data.val_size", "0",
                   "--run.checkpoint_every", "0", "--reward.judge.canaries", "5", "--run.steps", "3",
                   # A judge built in 20 steps puts little mass on its yes and no words: read it anyway.
                   "--reward.judge.min_mass", "0",
                   timeout_s=1200)
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        # Five canaries a step, each answered or counted as failed, none a training sample.
        assert r["reward_judge_canary_asked"] == 5
        assert r["reward_judge_canary_answered"] + r["reward_judge_canary_failed"] == 5
        assert 0 <= r["reward_judge_canary_fp"] <= r["reward_judge_canary_answered"]
        assert r["reward_judge_canary_alarm"] == 0  # three steps: no third to compare yet
        assert r["responses"] == 16
        # The judged rows (half the task's) were scored by the judge and the rule both.
        cells = [r[f"reward_judge_rule_{c}"] for c in ("tp", "fp", "tn", "fn")]
        assert sum(cells) == r["reward_judge_rule_compared"] > 0
        if r["reward_judge_rule_fp"] + r["reward_judge_rule_tn"]:
            assert r["reward_judge_fp_rate"] == pytest.approx(
                r["reward_judge_rule_fp"] / (r["reward_judge_rule_fp"] + r["reward_judge_rule_tn"]))
    # The run's judge verdicts are its judged rows' (arith's rule never fails), not the
    # canaries': they went through a scorer of their own.
    assert recs[-1]["reward_judge_judged_total"] == sum(r["reward_judge_rule_compared"] for r in recs)
    printed = proc.stdout + proc.stderr
    assert "judge_canary_fp_rate" in printed and "judge_rule_compared" in printed
    if any(r["reward_judge_rule_fp"] + r["reward_judge_rule_tn"] for r in recs):
        assert "judge_fp_rate" in printed
