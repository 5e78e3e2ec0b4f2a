"""bench.parity's bookkeeping: curves from a run's records, the comparison at equal
prompts and at equal wall time, and its validation set."""

from __future__ import annotations

import argparse
import hashlib
import json

import pytest

from bench.parity import VAL_DIGEST, at_wall_time, check_val_set, compare, curve, parse_variant, pool, write_val_set
from rpk import assembly
from rpk.config import from_argv


def records(step_s: float) -> tuple[list[dict], list[dict]]:
    steps = [{"step": s, "prompts": 32, "time_step_s": step_s} for s in (1, 2, 3, 4)]
    evals = [{"step": s, "val/acc_greedy": 0.2 + 0.05 * s, "val/acc_greedy_se": 0.03,
              "val/mean@2": 0.1 + 0.02 * s, "val/mean@2_se": 0.02, "val/pass@2": 0.3}
             for s in (0, 2, 4)]
    return steps, evals


def test_curve_counts_prompts_and_wall_time_up_to_each_validation():
    points = curve(*records(step_s=5.0), k=2)
    assert [(p["step"], p["prompts"], p["wall_s"]) for p in points] == [
        (0, 0, 0.0), (2, 64, 10.0), (4, 128, 20.0)]
    assert points[2]["acc_greedy"] == pytest.approx(0.4) and points[2]["mean@k"] == pytest.approx(0.18)


def test_compare_at_equal_prompts_and_at_the_fastest_policys_wall_time():
    fast = {"policy": "sync", "curve": curve(*records(step_s=5.0), k=2)}
    slow = {"policy": "tail", "curve": curve(*records(step_s=8.0), k=2)}
    slow["curve"][-1]["acc_greedy"] = 0.34  # 0.06 below sync's 0.40 at the end
    table = compare([fast, slow], ["acc_greedy", "mean@k"])
    sync, tail = table
    assert sync["budget_s"] == 20.0 and sync["acc_greedy_end_z"] == 0.0
    assert tail["acc_greedy_end_z"] == pytest.approx(-0.06 / (0.03 * 2**0.5))
    # by 20 s tail had validated at step 2 (16 s), not at step 4 (32 s)
    assert tail["prompts_at_budget"] == 64 and tail["acc_greedy_budget"] == pytest.approx(0.3)
    assert tail["acc_greedy_budget_z"] == pytest.approx(-0.1 / (0.03 * 2**0.5))
    assert at_wall_time(slow["curve"], 15.9)["step"] == 0


def test_seeds_pool_point_by_point_with_the_standard_error_of_their_mean():
    a, b = curve(*records(step_s=5.0), k=2), curve(*records(step_s=7.0), k=2)
    for p in b:
        p["acc_greedy"] += 0.1
    pooled = pool([a, b])
    assert [p["step"] for p in pooled] == [0, 2, 4] and pooled[1]["wall_s"] == pytest.approx(12.0)
    assert pooled[2]["acc_greedy"] == pytest.approx(0.45)
    assert pooled[2]["acc_greedy_se"] == pytest.approx(0.03 / 2**0.5)
    assert pooled[2]["acc_greedy_seed_sd"] == pytest.approx(0.1 / 2**0.5)
    assert pooled[2]["mean@k_se"] == pytest.approx(0.02 / 2**0.5)
    with pytest.raises(ValueError, match="different number"):
        pool([a, b[:2]])


def test_the_bench_validation_set_is_held_out_from_every_run_and_short(tmp_path):
    configs = [["--data.builtin_size", "1000"], ["--data.builtin_size", "1000", "--run.seed", "1"]]
    path = write_val_set(tmp_path / "v.jsonl", configs, 256, max_digits=2)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 256 and {r["extra_info"]["digits"] for r in rows} == {2}
    for config in configs:
        train = {r["prompt"][0]["content"] for r in assembly.builtin_rows(assembly.prompt_source(from_argv(config)))}
        assert not {r["prompt"][0]["content"] for r in rows} & train
    every = write_val_set(tmp_path / "all.jsonl", configs[:1], 256, max_digits=0)
    assert max(json.loads(line)["extra_info"]["digits"] for line in every.read_text().splitlines()) > 2


def test_a_reused_run_validated_on_another_set_is_refused(tmp_path):
    one = [["--data.builtin_size", "1000"]]
    val = write_val_set(tmp_path / "v0.jsonl", one, 64, max_digits=0)
    other = write_val_set(tmp_path / "v1.jsonl", [[*one[0], "--run.seed", "1"]], 64, max_digits=0)
    run = tmp_path / "tail" / "seed0"
    run.mkdir(parents=True)
    check_val_set(run, val)  # no record: an older bench's run is taken as is
    (run / VAL_DIGEST).write_text(hashlib.sha256(val.read_bytes()).hexdigest())
    check_val_set(run, val)
    with pytest.raises(SystemExit, match=r"tail/seed0 was validated on another set"):
        check_val_set(run, other)


def test_a_policy_carries_its_own_settings():
    assert parse_variant("sync") == ("sync", [])
    assert parse_variant("tail+rollout.eta_responses=1+run.seed=2") == (
        "tail", ["--rollout.eta_responses", "1", "--run.seed", "2"])
    with pytest.raises(argparse.ArgumentTypeError, match="'magic' is not one of"):
        parse_variant("magic")
    with pytest.raises(argparse.ArgumentTypeError, match="'eta' in 'tail\\+eta' is not"):
        parse_variant("tail+eta")
