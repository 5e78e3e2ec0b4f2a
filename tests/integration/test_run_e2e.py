"""`python -m rpk.run` end to end on the real vLLM engine: what a run writes (metrics,
timelines, plots, validations, checkpoints), a reward that hangs, elastic TP (plain and
colocated) and a borrowing run. Whole processes: the slow tier."""

from __future__ import annotations

import json

import pytest

from tests.integration.runs import STEPS, Reference, metrics, rpk_run

pytest.importorskip("vllm")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUIRED_KEYS = {
    "step", "reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_p50",
    "response_len_p90", "response_len_max", "tokens_generated", "time_rollout_s",
    "time_reward_s", "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s",
}


def test_a_run_writes_metrics_timelines_plots_validations_and_checkpoints(reference_run: Reference) -> None:
    """The session's reference run (tests/integration/conftest.py); its resume is
    test_run_lifecycle.py's."""
    run1, recs, err = reference_run.run_dir, reference_run.records, reference_run.stderr
    assert "event loop uvloop" in err
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert REQUIRED_KEYS <= set(recs[0])
    assert all(r["responses"] == 16 and r["tokens_generated"] > 0 for r in recs)
    assert [r["version"] for r in recs] == list(range(1, STEPS + 1))
    assert (run1 / "config.yaml").exists()
    timeline = [json.loads(line) for line in (run1 / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timeline] == list(range(1, STEPS + 1))
    # tail batching, the default: 5 prompts x 5 responses launched, all ended by the close
    assert recs[0]["round_kind"] == "short"
    assert max(timeline[0]["in_flight"]) == 25 and timeline[0]["in_flight"][-1] == 0
    assert timeline[0]["capacity"] == 32  # LIFECYCLE's rollout.max_num_seqs
    assert {p.name for p in (run1 / "plots").glob("*.png")} >= {"timeline.png", "reward.png",
                                                               "val.png"}
    # validated before training and after the last step, on the weights of each
    evals = metrics(run1, "eval")
    assert [(e["step"], e["version"], e["val/prompts"]) for e in evals] == [(0, 0, 8), (STEPS, STEPS, 8)]
    assert all(0 <= e["val/acc_greedy"] <= 1 and "val/pass@2" in e for e in evals)
    assert "val  after step    0  greedy" in err and "val_acc_greedy_end" in err
    ckpt = run1 / "checkpoints" / "step_000002"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer/meta.json",
                 "rpk_state.json"):
        assert (ckpt / name).exists(), name
    state = json.loads((ckpt / "rpk_state.json").read_text())
    assert state["step"] == 2 and state["policy"]["cursor"]["position"] == 10
    assert state["policy"]["policy"] == "tail"
    # config.json names the dtype the weights were saved in (float32 on CPU).
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"


def test_run_survives_a_reward_that_hangs_on_5_percent_of_samples(tmp_path, rpk_cache):
    """Hung calls are killed at reward.timeout_s, score 0 and are counted (and shown, and
    logged); the run ends."""
    proc = rpk_run(
        tmp_path, rpk_cache, "--run.steps", "2", "--reward.function", "tests.reward_fns:hangs_on_5_percent",
        "--reward.timeout_s", "2", "--reward.max_workers", "4", "--run.checkpoint_every", "0",
        # Validation's scoring counts in the _total columns and in no step's: none here.
        "--data.val_size", "0",
    )
    run_dir = (tmp_path / "runs" / "latest").resolve()
    recs = metrics(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    timeouts = recs[-1]["reward_failed_timeout_total"]
    errors = sum(r["reward_errors"] for r in recs)
    assert timeouts >= 1 and errors >= 1  # 40 responses: P(no hang at all) is ~13%
    assert sum(r["reward_failed_timeout"] for r in recs) == timeouts
    logged = [json.loads(line) for line in (run_dir / "reward_errors.jsonl").read_text().splitlines()]
    assert 1 <= len(logged) <= 5 and {e["kind"] for e in logged} == {"timeout"}
    assert "reward failed" in proc.stderr and "(timeout " in proc.stderr


def test_an_elastic_tp_run_over_two_cores_serves_the_trainers_weights_every_step(tmp_path, rpk_cache):
    """Two TP-1 replicas and an asleep TP-2 layout over both cores; a KV cache small
    enough that a short round preempts at TP 1, so the planner moves to TP 2."""
    proc = rpk_run(  # two steps: the planner's choice after the first, served by the second
        tmp_path, rpk_cache, "--run.steps", "2", "--run.checkpoint_every", "0", "--data.val_size", "0",
        "--rollout.tp", "elastic", "--rollout.tp_sizes", "1,2", "--rollout.devices", "0,1",
        "--rollout.kv_cache_mb", "1", "--rollout.max_tokens", "200",
    )
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["version_served"] == r["version"] for r in recs)
    assert recs[0]["tp"] == 1 and recs[0]["replicas"] == 2
    assert all(r["tokens_generated"] >= r["tokens_wasted"] >= 0 for r in recs)
    # The planner's rule on what the first (short) round saw: any preemption is a rise
    # from none and doubles the TP; the next short round runs on what it chose.
    first, second = recs[0], recs[1]
    assert first["round_kind"] == second["round_kind"] == "short"
    assert first["tp_next"] == (2 if first["preemptions"] > 0 else 1)
    assert second["tp"] == first["tp_next"]
    assert second["replicas"] == (1 if second["tp"] == 2 else 2)
    # The regroup for the second round was the first step's weight sync.
    regrouped = (first.get("regroup_at"), first.get("regroup_from_tp"), first.get("regroup_to_tp"))
    assert (regrouped == ("sync", 1, 2)) == (second["tp"] == 2)
    assert second["regroups"] == 0
    assert ("regrouped tp 1 -> 2" in proc.stderr) == (second["tp"] == 2)


def test_a_colocated_elastic_run_rests_vllm_for_training_and_serves_the_trainers_weights(tmp_path, rpk_cache):
    """The GPU choreography run for real on CPU (vLLM's sleep is a no-op there): the
    fleet rests after each round, wakes in two parts around the sync with the trainer's
    state moved out between them, and regroups out of rest."""
    rpk_run(
        tmp_path, rpk_cache, "--run.steps", "3", "--run.checkpoint_every", "0", "--data.val_size", "0",
        "--rollout.tp", "elastic", "--rollout.tp_sizes", "1,2", "--rollout.devices", "0,1",
        "--rollout.kv_cache_mb", "1", "--rollout.max_tokens", "200", "--rollout.colocate", "true",
        "--train.offload", "all",
    )
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["version_served"] == r["version"] for r in recs)


def test_a_borrowing_run_lends_a_replica_mid_round_and_serves_the_trainers_weights(tmp_path, rpk_cache):
    """`train.stream_mode borrow` over two TP-1 replicas: rounds lend one replica (its
    requests move to the other), the trainer streams, and after each step both
    replicas serve the trainer's weights again."""
    rpk_run(
        tmp_path, rpk_cache, "--run.steps", "4", "--run.checkpoint_every", "0", "--data.val_size", "0",
        "--rollout.tp", "fixed", "--rollout.tp_size", "1", "--rollout.devices", "0,1",
        "--rollout.prompts_per_step", "8", "--rollout.max_tokens", "200",
        "--train.stream_mode", "borrow", "--train.borrow_check_s", "0.05",
        "--train.stream_chunk_tokens", "256",
    )
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["version_served"] == r["version"] == r["step"] for r in recs)
    lent = [r for r in recs if r["borrow_frac"] is not None]
    assert lent and sum(r["migrated_requests"] for r in lent) > 0
    # A lend late in a round may leave no chunk ready before the round ends; streaming
    # must hide trainer time in some lent step, not in each.
    assert any(r["time_train_hidden_s"] > 0 for r in lent), [r["time_train_hidden_s"] for r in lent]
