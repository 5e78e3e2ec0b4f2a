"""The end-of-run summary compares like with like."""

from __future__ import annotations

from pathlib import Path

from rpk.obs.metrics import HostCpu, call_thirds, summarize


def rec(step: int, kind: str, reward: float) -> dict:
    return {"step": step, "round_kind": kind, "reward_mean": reward, "accuracy": reward,
            "time_step_s": 1.0, "time_rollout_s": 0.5, "time_train_s": 0.4, "time_sync_s": 0.1,
            "tokens_generated": 10}


def test_summary_leaves_long_rounds_out_of_the_reward_windows():
    kinds = ["short"] * 4 + ["long"]
    recs = [rec(i + 1, k, 0.0 if k == "long" else 0.1 * (i + 1)) for i, k in enumerate(kinds * 2)]
    out = summarize(recs, window=2)
    # short rounds are steps 1-4 and 6-9 with rewards 0.1..0.4, 0.6..0.9
    assert round(out["reward_first"], 6) == 0.15 and round(out["reward_last"], 6) == 0.85
    assert out["steps"] == 10.0 and out["tokens_generated_total"] == 100.0
    # a run of sync rounds only, or long rounds only, still has a summary
    assert summarize([rec(1, "long", 0.5)], window=3)["reward_last"] == 0.5


def test_summary_compares_multi_call_reward_per_trajectory_over_thirds():
    recs = [rec(i + 1, "short", 0.5) for i in range(9)]
    for r, (n, rewarded) in zip(recs, [(2, 0), (0, 0), (2, 1), (1, 1), (4, 2), (1, 0),
                                       (2, 2), (8, 6), (2, 2)]):
        r.update(multi_call_trajectories=float(n), multi_call_reward_sum=float(rewarded))
    out = summarize(recs)
    # Step 2 had none: thirds of the 8 steps that had any are 3 steps wide (the window).
    assert out["multi_call_trajectories"] == 22.0
    assert out["multi_call_reward"] == 14 / 22
    assert out["multi_call_reward_first"] == (0 + 1 + 1) / (2 + 2 + 1)
    assert out["multi_call_reward_last"] == (2 + 6 + 2) / (2 + 8 + 2)
    assert call_thirds([rec(1, "sync", 0.1)]) == {}
    assert "multi_call_reward" not in summarize([rec(1, "sync", 0.1)])


def test_summary_counts_reward_failures_by_kind_over_the_steps():
    recs = [rec(1, "sync", 0.1), rec(2, "sync", 0.2), rec(3, "sync", 0.3)]
    recs[0].update(reward_failed=3, reward_failed_timeout=2, reward_failed_raised=1,
                   reward_failed_raised_total=1)
    recs[1].update(reward_failed=0, reward_failed_timeout=0, reward_failed_raised=0)
    recs[2].update(reward_failed=1, reward_failed_timeout=1, reward_failed_raised=0,
                   reward_failed_timeout_total=3)
    out = summarize(recs)
    assert out["reward_failed"] == 4.0
    assert {k: v for k, v in out.items() if k.startswith("reward_failed_")} == {
        "reward_failed_raised": 1.0, "reward_failed_timeout": 3.0,
    }


def _proc_stat(path: Path, user: int, system: int, idle: int, iowait: int, steal: int) -> None:
    path.write_text(
        f"cpu  {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0\n"
        f"cpu0 {user} 0 {system} {idle} {iowait} 0 0 {steal} 0 0\nintr 1 2 3\n"
    )


def test_host_cpu_busy_share_between_laps(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    _proc_stat(stat, user=100, system=50, idle=800, iowait=50, steal=7)
    meter = HostCpu(stat)
    # 300 busy ticks (user + system) against 100 idle and iowait; steal is neither
    _proc_stat(stat, user=350, system=100, idle=880, iowait=70, steal=90)
    assert meter.lap() == {"host_cpu_busy_frac": 0.75}
    _proc_stat(stat, user=350, system=100, idle=980, iowait=70, steal=90)
    assert meter.lap() == {"host_cpu_busy_frac": 0.0}
    assert meter.lap() == {}  # no tick passed: nothing to say


def test_host_cpu_records_nothing_without_proc_stat(tmp_path: Path) -> None:
    meter = HostCpu(tmp_path / "absent")
    assert meter.lap() == {}
    (tmp_path / "other").write_text("intr 1 2 3\n")
    assert HostCpu(tmp_path / "other").lap() == {}
