"""`python -m rpk.run` end to end on the real vLLM engine: a short run, its metrics and
checkpoints, then a resumed run that starts vLLM from the checkpoint and goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

# Small enough to run in well under a minute per run on 2 cores. Head size 32: vLLM's CPU
# attention supports head sizes 32, 64, 80 and up, not 16.
SMALL = [
    "--model.tiny.hidden_size", "64", "--model.tiny.num_heads", "2", "--model.tiny.num_layers", "2",
    "--model.tiny.intermediate_size", "128", "--model.tiny.sft_steps", "30",
    "--model.tiny.sft_problems", "2000",
    "--data.builtin_size", "64",
    "--rollout.prompts_per_step", "4", "--rollout.responses_per_prompt", "4",
    "--rollout.max_tokens", "96", "--rollout.max_num_seqs", "16", "--rollout.kv_cache_mb", "128",
    "--run.progress", "false", "--run.checkpoint_every", "1",
    "--data.val_size", "8", "--run.eval_k", "2",
]

REQUIRED_KEYS = {
    "step", "reward_mean", "reward_std", "accuracy", "response_len_mean", "response_len_p50",
    "response_len_p90", "response_len_max", "tokens_generated", "time_rollout_s",
    "time_reward_s", "time_train_s", "time_sync_s", "time_step_s", "tokens_per_s",
}


def rpk_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rpk.run", *SMALL,
           "--model.cache_dir", str(tmp_path / "cache"), "--run.out_dir", str(tmp_path / "runs"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"rpk.run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def metrics(run_dir: Path, phase: str = "train") -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("phase", "train") == phase]


def test_run_writes_metrics_checkpoints_and_resumes(tmp_path):
    first = rpk_run(tmp_path, "--run.steps", "2")
    assert "event loop uvloop" in first.stderr
    run1 = (tmp_path / "runs" / "latest").resolve()
    recs = metrics(run1)
    assert [r["step"] for r in recs] == [1, 2]
    assert REQUIRED_KEYS <= set(recs[0])
    assert all(r["responses"] == 16 and r["tokens_generated"] > 0 for r in recs)
    assert [r["version"] for r in recs] == [1, 2]
    assert (run1 / "config.yaml").exists()
    timeline = [json.loads(line) for line in (run1 / "timeline.jsonl").read_text().splitlines()]
    assert [t["step"] for t in timeline] == [1, 2]
    # tail batching, the default: 5 prompts x 5 responses launched, all ended by the close
    assert [r["round_kind"] for r in recs] == ["short", "short"]
    assert max(timeline[0]["in_flight"]) == 25 and timeline[0]["in_flight"][-1] == 0
    assert timeline[0]["capacity"] == 16
    assert {p.name for p in (run1 / "plots").glob("*.png")} >= {"timeline.png", "reward.png",
                                                               "val.png"}
    # validated before training and after the last step, on the weights of each
    evals = metrics(run1, "eval")
    assert [(e["step"], e["version"], e["val/prompts"]) for e in evals] == [(0, 0, 8), (2, 2, 8)]
    assert all(0 <= e["val/acc_greedy"] <= 1 and "val/pass@2" in e for e in evals)
    assert "val  after step    0  greedy" in first.stderr and "val_acc_greedy_end" in first.stderr
    ckpt = run1 / "checkpoints" / "step_000002"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer/meta.json",
                 "rpk_state.json"):
        assert (ckpt / name).exists(), name
    state = json.loads((ckpt / "rpk_state.json").read_text())
    assert state["step"] == 2 and state["policy"]["cursor"]["position"] == 10
    assert state["policy"]["policy"] == "tail"

    # The resumed run loads the checkpoint into vLLM and the trainer, and takes step 3 in
    # the same run directory; it runs on the plain asyncio loop (the first one ran on uvloop).
    proc = rpk_run(tmp_path, "--run.steps", "3", "--run.resume", str(tmp_path / "runs" / "latest"),
                   "--run.uvloop", "false")
    assert (tmp_path / "runs" / "latest").resolve() == run1
    recs2 = metrics(run1)
    assert [r["step"] for r in recs2] == [1, 2, 3] and recs2[2]["version"] == 3
    assert recs2[2]["tokens_generated"] > 0
    assert "resuming" in proc.stderr and "event loop asyncio" in proc.stderr
    # Validated at the start, at the first run's end and at the resumed run's end.
    assert [e["step"] for e in metrics(run1, "eval")] == [0, 2, 3]
    state3 = json.loads((run1 / "checkpoints" / "step_000003" / "rpk_state.json").read_text())
    assert state3["policy"]["cursor"]["position"] == 15
    assert state3["fingerprint"]["rollout.policy"] == "tail"
    # config.json names the dtype the weights were saved in (float32 on CPU).
    assert json.loads((run1 / "checkpoints" / "step_000003" / "config.json").read_text())["dtype"] == "float32"


def test_run_survives_a_reward_that_hangs_on_5_percent_of_samples(tmp_path):
    """Hung calls are killed at reward.timeout_s, score 0 and are counted (and shown, and
    logged); the run ends."""
    proc = rpk_run(
        tmp_path, "--run.steps", "2", "--reward.function", "tests.reward_fns:hangs_on_5_percent",
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


def test_an_elastic_tp_run_over_two_cores_serves_the_trainers_weights_every_step(tmp_path):
    """Two TP-1 replicas and an asleep TP-2 layout over both cores; a KV cache small
    enough that a short round preempts at TP 1, so the planner moves to TP 2."""
    proc = rpk_run(
        tmp_path, "--run.steps", "3", "--run.checkpoint_every", "0", "--data.val_size", "0",
        "--rollout.tp", "elastic", "--rollout.tp_sizes", "1,2", "--rollout.devices", "0,1",
        "--rollout.kv_cache_mb", "1", "--rollout.max_tokens", "200",
    )
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2, 3]
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


def test_a_colocated_elastic_run_rests_vllm_for_training_and_serves_the_trainers_weights(tmp_path):
    """The GPU choreography run for real on CPU (vLLM's sleep is a no-op there): the
    fleet rests after each round, wakes in two parts around the sync with the trainer's
    state moved out between them, and regroups out of rest."""
    rpk_run(
        tmp_path, "--run.steps", "3", "--run.checkpoint_every", "0", "--data.val_size", "0",
        "--rollout.tp", "elastic", "--rollout.tp_sizes", "1,2", "--rollout.devices", "0,1",
        "--rollout.kv_cache_mb", "1", "--rollout.max_tokens", "200", "--rollout.colocate", "true",
        "--train.offload", "all",
    )
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["version_served"] == r["version"] for r in recs)


def test_a_borrowing_run_lends_a_replica_mid_round_and_serves_the_trainers_weights(tmp_path):
    """`train.stream_mode borrow` over two TP-1 replicas: rounds lend one replica (its
    requests move to the other), the trainer streams, and after each step both
    replicas serve the trainer's weights again."""
    rpk_run(
        tmp_path, "--run.steps", "4", "--run.checkpoint_every", "0", "--data.val_size", "0",
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
