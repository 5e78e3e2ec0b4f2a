"""bench/multi_turn.py for real, tiny: two policies, two steps each, on the multi-turn
task with a barely warmed-up small model and the real vLLM engine. It checks that the
bench runs trajectories end to end and reports them, not how fast anything is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.runs import ROOT, overrides

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

SMALL = [
    *overrides("model.tiny_tool_add", hidden_size=64, num_heads=2, num_layers=2, intermediate_size=128,
               sft_steps=30, sft_problems=500),
    "--data.builtin_size", "32", "--rollout.prompts_per_step", "4",
    "--rollout.responses_per_prompt", "4", "--rollout.max_num_seqs", "16",
    "--rollout.kv_cache_mb", "128", "--rollout.max_turns", "3", "--run.trackers", "",
]


def test_the_bench_runs_trajectories_under_each_policy(tmp_path: Path, rpk_cache: Path) -> None:
    out = tmp_path / "multi_turn.json"
    cmd = [sys.executable, "-m", "bench.multi_turn", "--steps", "2", "--policies", "sync", "tail",
           "--out", str(out), "--", *SMALL, "--model.cache_dir", str(rpk_cache)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["sync", "tail"]
    for row in rows:
        assert row["steps"] == 2 and row["prompts_trained"] == 8
        assert row["rollout_s_per_prompt"] > 0
        assert 1 <= row["turns_mean"] <= 3 and row["turns_max"] <= 3
        assert row["tool_calls"] >= 0 and row["tool_failures"] <= row["tool_calls"]
    assert "turns" in proc.stdout and "s/prompt" in proc.stdout
