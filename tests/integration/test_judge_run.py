"""`python -m rpk.run --data.task arith_judged` on the real vLLM engine, its tiny judge
included: every step asks the live judge its canaries beside the round and counts the
judge against the rule, and the summary prints both false-positive rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

# Small builds (a minute or two each on 2 cores); head size 32, which vLLM's CPU
# attention supports.
SMALL = [
    "--model.tiny.hidden_size", "64", "--model.tiny.num_heads", "2", "--model.tiny.num_layers", "2",
    "--model.tiny.intermediate_size", "128", "--model.tiny.sft_steps", "30",
    "--model.tiny.sft_problems", "2000",
    "--model.tiny_judge.hidden_size", "64", "--model.tiny_judge.num_layers", "2",
    "--model.tiny_judge.intermediate_size", "64", "--model.tiny_judge.sft_steps", "20",
    "--model.tiny_judge.sft_problems", "200", "--model.tiny_judge.task.max_digits", "4",
    "--data.builtin_size", "64", "--data.val_size", "0",
    "--rollout.prompts_per_step", "4", "--rollout.responses_per_prompt", "4",
    "--rollout.max_tokens", "96", "--rollout.max_num_seqs", "16", "--rollout.kv_cache_mb", "128",
    "--run.progress", "false", "--run.checkpoint_every", "0",
]


def test_a_judged_run_asks_its_canaries_every_step_and_reports_both_rates(tmp_path: Path):
    cmd = [sys.executable, "-m", "rpk.run", *SMALL, "--data.task", "arith_judged",
           "--reward.judge.canaries", "5", "--run.steps", "3",
           "--model.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"rpk.run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    run_dir = (tmp_path / "runs" / "latest").resolve()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in lines if r.get("phase", "train") == "train"]
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
