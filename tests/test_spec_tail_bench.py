"""bench/spec_tail.py's flow on step records a run would write: the runs it makes (each
policy off and speculating, the latency setting's tail also on the single sources), the
row each gets, its ratios against the same policy and seed without speculation, and the
rows pooled over seeds. No timing claims; the real runs are in docs/benchmarks.md."""

from __future__ import annotations

import json

import pytest

from bench import common, spec_tail


def _records(policy: str, spec: str, seed: int) -> list[dict]:
    on = spec != "off"
    out = []
    for step in range(1, 5):
        kind = "sync" if policy == "sync" else ("long" if step == 4 else "short")
        rec = {
            "step": step, "round_kind": kind, "prompts": 4, "reward_mean": 0.5,
            "time_rollout_s": (3.0 if kind == "long" else 1.0) / (1.5 if on else 1.0),
            "time_step_s": (2.0 if on else 2.5) + seed, "train_logprob_mismatch": 1e-5,
        }
        if on:
            rec.update({"spec_drafts": 10.0, "spec_accepted": 15.0, "spec_draft_tokens": 30.0,
                        "spec_share_sibling": 2 / 3, "spec_accept_sibling": 0.6,
                        "spec_share_partial": 1 / 3, "spec_accept_partial": 0.3, "spec_tail_s_saved": 0.5})
        out.append(rec)
    return out


def test_each_setting_policy_and_arm_runs_and_is_set_against_off(monkeypatch, tmp_path) -> None:
    calls = []

    def fake(argv):
        calls.append(list(argv))
        policy = argv[argv.index("--rollout.policy") + 1]
        spec = argv[argv.index("--rollout.speculative") + 1]
        acc = 0.5 if spec == "off" else 0.48
        return 0, _records(policy, spec, int(argv[argv.index("--run.seed") + 1])), [
            {"phase": "eval", "step": 4, "val/acc_greedy": acc, "val/acc_greedy_se": 0.03}]

    monkeypatch.setattr(common, "run_phases", fake)
    out = tmp_path / "spec.json"
    assert spec_tail.main(["--steps", "4", "--seeds", "0", "1", "--policies", "sync", "tail",
                           "--out", str(out), "--", "--rollout.max_tokens", "200"]) == 0
    arms = [(c[c.index("--rollout.policy") + 1], c[c.index("--rollout.speculative") + 1]) for c in calls]
    per_seed = [("sync", "off"), ("sync", "all"), ("tail", "off"), ("tail", "all")]
    latency = [("sync", "off"), ("sync", "all"), ("tail", "off"), ("tail", "all"), ("tail", "partials"),
               ("tail", "prompt")]
    assert arms == (per_seed + latency) * 2  # seed by seed: a cut-short bench keeps whole seeds
    latency_calls = [c for c in calls if "--data.train_files" in c]
    assert len(latency_calls) == 12 and all(c[c.index("--rollout.prompts_per_step") + 1] == "4" for c in latency_calls)
    assert all(c[-2:] == ["--rollout.max_tokens", "200"] for c in calls)
    rows = json.loads(out.read_text())
    tail_on = next(r for r in rows if (r["setting"], r["policy"], r["speculative"], r["seed"]) ==
                   ("default", "tail", "all", 0))
    assert tail_on["prompts_per_s"] == pytest.approx(16 / 8) and tail_on["vs_off"] == pytest.approx(10 / 8)
    assert tail_on["rollout_s"] == pytest.approx(6 / 1.5) and tail_on["rollout_vs_off"] == pytest.approx(1.5)
    assert tail_on["long_round_rollout_s"] == pytest.approx(2.0) and tail_on["long_vs_off"] == pytest.approx(1.5)
    assert tail_on["tokens_per_verify"] == pytest.approx(2.5)
    assert tail_on["share_sibling"] == pytest.approx(2 / 3) and tail_on["accept_partial"] == pytest.approx(0.3)
    assert tail_on["val_z"] == pytest.approx(-0.02 / (2 * 0.03**2) ** 0.5)
    assert tail_on["logprob_mismatch"] == pytest.approx(1e-5)
    sync_off = next(r for r in rows if (r["setting"], r["policy"], r["speculative"], r["seed"]) ==
                    ("default", "sync", "off", 0))
    assert sync_off["long_round_rollout_s"] is None and sync_off["tokens_per_verify"] == 1.0
    pooled = next(r for r in rows if (r["setting"], r["policy"], r["speculative"], r["seed"]) ==
                  ("default", "tail", "all", "all"))
    assert pooled["prompts_per_s"] == pytest.approx(32 / 20)
    assert pooled["vs_off"] == pytest.approx((32 / 20) / (32 / 24))
    assert pooled["val_greedy_se"] == pytest.approx(0.03 / 2**0.5)


def test_a_failing_run_stops_the_bench_with_its_code(monkeypatch) -> None:
    monkeypatch.setattr(common, "run_phases", lambda argv: (3, [], []))
    assert spec_tail.main(["--steps", "1", "--policies", "tail", "--settings", "default"]) == 3


def test_the_onpolicy_bench_loads_its_model_and_prompts_as_the_assembly_does(monkeypatch, tmp_path) -> None:
    """`bench.spec_onpolicy` calls the assembly's loaders itself; a call that no longer
    fits their signatures (as once after they took config sections) fails here, not
    minutes into a bench run."""
    import argparse
    import asyncio
    import inspect

    from bench import spec_onpolicy
    from rpk.assembly import inputs

    class Loaded(Exception):
        pass

    real_model, real_prompts = inputs.run_model, inputs.load_prompts

    async def run_model(*args, **kwargs):
        inspect.signature(real_model).bind(*args, **kwargs)
        return tmp_path

    def load_prompts(*args, **kwargs):
        inspect.signature(real_prompts).bind(*args, **kwargs)
        raise Loaded

    monkeypatch.setattr(inputs, "run_model", run_model)
    monkeypatch.setattr(inputs, "load_prompts", load_prompts)
    args = argparse.Namespace(cache_dir=tmp_path, max_tokens=64, p=2, r=2, steps=1, k=4, seed=0,
                              recompute=1, speculative=["all"])
    with pytest.raises(Loaded):
        asyncio.run(spec_onpolicy.main_async(args))


def test_the_step_cost_benchs_proposer_drafts_what_it_is_set_to() -> None:
    import numpy as np

    from bench import spec_step_cost as sc

    prompt = list(range(10, 10 + sc.PROMPT_TOKENS))
    ids = np.zeros((2, 128), dtype=np.int32)
    ids[0, :sc.PROMPT_TOKENS + 2] = prompt + [50, 51]
    num = np.array([sc.PROMPT_TOKENS + 2, 0])
    proposer = sc.BenchDrafts(None)
    try:
        sc.BenchDrafts.k, sc.BenchDrafts.mode = 3, "wrong"
        assert proposer.propose([[51], []], num, ids) == [[3, 3, 3], []]
        sc.BenchDrafts.mode = "right"
        sc.BenchDrafts.oracle = {np.asarray(prompt, dtype=np.int32).tobytes(): [50, 51, 52, 53, 54, 55]}
        assert proposer.propose([[51], []], num, ids) == [[52, 53, 54], []]
        sc.BenchDrafts.k = 0
        assert proposer.propose([[51], []], num, ids) == [[], []]
    finally:
        sc.BenchDrafts.k, sc.BenchDrafts.mode, sc.BenchDrafts.oracle = 0, "wrong", {}
    rows = sc.measure_index([1, 2], steps=5)
    assert [r["batch"] for r in rows] == [1, 2] and all(r["index_propose_ms"] > 0 for r in rows)
