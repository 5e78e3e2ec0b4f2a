"""bench/multi_turn.py's flow on step records a run would write: each policy runs on
the tool_add task with the bench's sizing, its row adds turns and tools to the rollout
table, and the JSON holds every row. No timing claims; the real runs are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import sys

import pytest

from bench import common, multi_turn


def _records(policy: str, seed: int) -> list[dict]:
    out = []
    for step in range(1, 5):
        kind = "sync" if policy == "sync" else ("long" if step == 4 else "short")
        out.append({
            "step": step, "round_kind": kind, "prompts": 8, "responses": 16,
            "time_rollout_s": 2.0 if kind != "long" else 6.0,
            "tokens_generated": 1000, "tokens_wasted": 0 if policy == "sync" else 100,
            "bubble_ratio": 0.5, "reward_mean": 0.25,
            "time_step_s": (4.0 if policy == "sync" else 2.0) + seed,
            "time_train_hidden_s": 1.0, "host_cpu_busy_frac": 0.9,
            "turns_mean": 2.0 + step / 4, "turns_max": 2.0 + step, "tool_calls": 70.0,
            "tool_failures": 3.0, "tool_seconds": 0.01, "masked_token_frac": 0.3,
            "engine_idle_s": 1.0, "tool_exposed_s": 0.5,
        })
    return out


def _evals(policy: str) -> list[dict]:
    return [{"phase": "eval", "step": 4, "val/acc_greedy": 0.5 if policy == "sync" else 0.4,
             "val/acc_greedy_se": 0.05}]


def test_each_policy_and_seed_runs_the_multi_turn_task_and_is_set_against_sync(
        monkeypatch, tmp_path, capsys):
    calls = []

    def fake_run_phases(argv):
        calls.append(list(argv))
        policy = argv[argv.index("--rollout.policy") + 1]
        return 0, _records(policy, int(argv[argv.index("--run.seed") + 1])), _evals(policy)

    monkeypatch.setattr(common, "run_phases", fake_run_phases)
    out = tmp_path / "mt.json"
    assert multi_turn.main(["--steps", "4", "--seeds", "0", "1", "--val", "64", "--out", str(out),
                            "--", "--rollout.max_turns", "6"]) == 0
    assert [(c[c.index("--rollout.policy") + 1], c[c.index("--run.seed") + 1]) for c in calls] == [
        (p, s) for s in "01" for p in ("sync", "tail", "length_aware")]
    for argv in calls:
        assert argv[argv.index("--data.task") + 1] == "tool_add"
        assert argv[argv.index("--run.steps") + 1] == "4"
        assert argv[argv.index("--data.val_size") + 1] == "64"
        assert argv[-2:] == ["--rollout.max_turns", "6"]  # the caller's overrides win
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["seed"]) for r in rows] == [
        *((p, s) for s in (0, 1) for p in ("sync", "tail", "length_aware")),
        ("sync", "all"), ("tail", "all"), ("length_aware", "all")]
    sync0, tail0 = rows[0], rows[1]
    assert sync0["prompts_trained"] == 32 and sync0["trajectories"] == 64
    assert sync0["trajectories_per_s"] == pytest.approx(64 / 16)
    assert tail0["trajectories_per_s"] == pytest.approx(64 / 8) and tail0["vs_sync"] == pytest.approx(2.0)
    assert tail0["rollout_s_per_prompt"] == pytest.approx(12 / 32)
    assert tail0["tokens_wasted_frac"] == pytest.approx(0.1)
    assert tail0["turns_mean"] == pytest.approx(2.625) and tail0["turns_max"] == 6.0
    assert tail0["tool_calls"] == 280 and tail0["tool_failures"] == 12
    assert tail0["engine_idle_s"] == 4.0 and tail0["tool_exposed_s"] == 2.0
    assert tail0["val_acc"] == 0.4 and tail0["val_z"] == pytest.approx(-0.1 / (2 * 0.05**2) ** 0.5)
    tail_all = rows[-2]
    # seed 1's steps take a second longer: 128 trajectories in 8 + 12 seconds
    assert tail_all["trajectories_per_s"] == pytest.approx(128 / 20)
    assert tail_all["vs_sync"] == pytest.approx((128 / 20) / (128 / 36))
    assert tail_all["val_se"] == pytest.approx(0.05 / 2**0.5)
    printed = capsys.readouterr().out
    assert "turns" in printed and "2.00x" in printed


def test_a_failing_run_stops_the_bench_with_its_code(monkeypatch):
    monkeypatch.setattr(common, "run_phases", lambda argv: (2, [], []))
    assert multi_turn.main(["--steps", "1", "--policies", "tail"]) == 2


def test_the_simulator_table_runs_trajectories_at_a_toy_size(tmp_path, monkeypatch) -> None:
    """`--sim`: tool_add's prompts on virtual time, each step's trajectories counted, the
    step's wall clocks summed, sync the 1.00x it is compared with; tail batching, which
    does not wait for the trajectories stuck on slow tools, trains more per second."""
    out = tmp_path / "sim.json"
    monkeypatch.setattr(sys, "argv", ["bench/multi_turn.py", "--sim", "--steps", "4", "--prompts",
                                      "64", "--p0", "8", "--r0", "2", "--policies", "sync", "tail",
                                      "--out", str(out)])
    assert multi_turn.main() == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())}
    assert rows["sync"]["trajectories"] == rows["tail"]["trajectories"] == 4 * 8 * 2
    assert rows["sync"]["vs_sync"] == 1.0 and rows["tail"]["vs_sync"] > 1.0
    assert rows["sync"]["engine_idle_s"] >= rows["sync"]["tool_exposed_s"] > 0
    assert rows["sync"]["turns_mean"] > 1
