"""Every benchmark still starts: its module imports and its command line parses. Those on
virtual time or pure arithmetic also run, at a toy size. A benchmark is run rarely, by
hand, so without this its code rots unseen (`bench.sim_policies` once failed on the
first line of its run for weeks)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

import pytest

import bench

# Helpers the benchmarks share or call, with no command line of their own (gpu_vllm's
# checks are rows of gpu_check's table).
LIBRARIES = {"common", "node_transfer", "gpu_vllm", "two_sample"}
BENCHES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name not in LIBRARIES)


def _main(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", *argv])
    return module.main()


def test_the_list_of_benchmarks_is_whole() -> None:
    assert {"parity", "rollout_policies", "sim_policies", "paper_table", "memory_plan"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_a_benchmark_parses_its_command_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        _main(name, ["--help"], monkeypatch)
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_sim_policies_runs_at_a_toy_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sim.json"
    code = _main("sim_policies", ["--steps", "2", "--prompts", "64", "--p0", "8", "--r0", "2",
                                  "--costs", "gpu", "--policies", "sync", "tail", "--out", str(out)],
                 monkeypatch)
    assert code == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"sync", "tail"}
    assert all(r["prompts_trained"] == 16 and r["rollout_s_per_prompt"] > 0 for r in rows.values())
    # virtual time has no host CPU to measure
    assert rows["sync"]["host_cpu_busy"] is None and rows["sync"]["tokens_wasted_frac"] == 0


def test_paper_table_runs_at_a_toy_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "paper.json"
    code = _main("paper_table", ["--settings", "7B/8k", "--steps", "2", "--prompts", "64",
                                 "--p0", "8", "--r0", "2", "--out", str(out)], monkeypatch)
    assert code == 0
    (row,) = json.loads(out.read_text())
    assert row["setting"] == "7B/8k"


def test_memory_plan_runs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main("memory_plan", [], monkeypatch) == 0
    assert "Qwen2.5-32B" in capsys.readouterr().out


def test_judge_runs_its_cost_model_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "judge.json"
    assert _main("judge", ["--dry", "--responses", "16", "--out", str(out)], monkeypatch) == 0
    result = json.loads(out.read_text())
    assert "cpu" not in result  # --dry starts no engine
    b = result["fig13b"]
    assert [r["setting"] for r in b[::2]] == ["7B/8k", "14B/16k", "32B/32k"]
    # Streaming layers costs time; pipelining them wins some of it back.
    assert all(r["resident_ms"] < r["pipelined_ms"] < r["unpipelined_ms"] and r["speedup"] > 1 for r in b)
    a = {(r["setting"], r["judge"]): r for r in result["fig13a"]}
    assert len(a) == 6 and a[("7B/8k", "dedicated")]["speedup"] == 1.0
    # A dedicated judge takes a GPU from rollout and training.
    assert a[("7B/8k", "dedicated")]["train_s"] > a[("7B/8k", "colocated")]["train_s"]


def test_the_reward_benches_report_medians_past_the_warm_up_step() -> None:
    from types import SimpleNamespace

    from bench.common import reward_step_medians

    def outcome(step_s: float, responses: int) -> SimpleNamespace:
        group = SimpleNamespace(members=[None] * responses)
        rnd = SimpleNamespace(last_response_at=step_s, started_at=0.0, reward_exposed_s=0.1 * step_s,
                              reward_busy_s=0.5 * step_s, groups=[group])
        return SimpleNamespace(time_step_s=step_s, time_rollout_s=step_s / 2, round=rnd)

    # The first step (100 s: compiling) is left out of every median.
    row = reward_step_medians([outcome(100.0, 1), outcome(2.0, 4), outcome(4.0, 8), outcome(6.0, 4)], "_median")
    assert row == {"measured_steps": 3, "step_s_median": 4.0, "rollout_s_median": 2.0,
                   "generation_s_median": 4.0, "reward_exposed_s_median": pytest.approx(0.4),
                   "reward_busy_s_median": 2.0, "responses_median": 4}
    assert reward_step_medians([outcome(3.0, 2)])["step_s"] == 3.0  # one step: it is measured
