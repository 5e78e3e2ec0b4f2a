"""bench/elastic_tp.py's core on a tiny setup: what it compares is comparable (the same
prompts trained by every variant), and only the elastic variant moves. No timings."""

from __future__ import annotations

import math

import pytest

from bench.elastic_tp import VARIANTS, compare, paper_lengths, parser
from rpk.core.records import GenRequest

# 4 devices, P0=8 x R0=4: a short round launches 10 prompts and defers 2, so steps 1-4
# are short, step 5 is the long round that empties the queue, and 5 steps are one epoch
# of 40 prompts. 1500 KV tokens per device make a TP-1 short round preempt.
TINY = ["--devices", "4", "--p0", "8", "--r0", "4", "--prompts", "40", "--steps", "5",
        "--median", "100", "--max-tokens", "1024", "--prompt-tokens", "32",
        "--kv-tokens", "1500", "--weight-tokens", "1500", "--chunk", "16"]


async def test_every_variant_trains_the_epoch_and_only_elastic_regroups():
    result = await compare(parser().parse_args(TINY))
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    epochs = {v: [p for step in steps for p in step] for v, steps in result["trained"].items()}
    for variant, trained in epochs.items():
        assert sorted(trained) == sorted(set(trained)) and len(trained) == 40, variant
    assert len({frozenset(t) for t in epochs.values()}) == 1
    assert all(r["kinds"] == ["short"] * 4 + ["long"] for r in rows.values())

    assert rows["tp1"]["preemptions_short_mean"] > 0
    elastic = rows["elastic"]
    assert elastic["regroups"] >= 1 and elastic["regroup_s"] > 0
    assert elastic["tp_per_step"][0] == 1 and len(set(elastic["tp_per_step"])) > 1
    for tp in (1, 2, 4):
        fixed = rows[f"tp{tp}"]
        assert fixed["regroups"] == 0 and fixed["regroup_s"] == 0.0
        assert fixed["tp_per_step"] == [tp] * 5

    best = min((rows[f"tp{tp}"] for tp in (1, 2, 4)), key=lambda r: r["rollout_s_per_prompt"])
    assert result["best_fixed"] == best["variant"] and best["vs_best_fixed"] == 1.0
    for r in rows.values():
        assert r["vs_best_fixed"] == r["rollout_s_per_prompt"] / best["rollout_s_per_prompt"]
    ceiling = result["per_kind_best"]
    assert {k: v["rounds"] for k, v in ceiling["kinds"].items()} == {"short": 4, "long": 1}
    assert ceiling["rollout_s_per_prompt"] <= best["rollout_s_per_prompt"] + 1e-9


def test_a_ramp_lengthens_the_same_prompts_responses_step_by_step():
    def mean_log_length(lengths, step: int) -> float:
        prompt = lengths.prompts()[3].token_ids
        logs = [math.log(lengths(GenRequest(f"s{step}-p3-r{j}", prompt, max_tokens=10**6)))
                for j in range(400)]
        return sum(logs) / len(logs)

    ramped = paper_lengths(parser().parse_args([*TINY, "--ramp", "4"]))
    grown = mean_log_length(ramped, 5) - mean_log_length(ramped, 1)
    assert grown == pytest.approx(math.log(4), abs=0.15)  # 4x over the 5 steps
    flat = paper_lengths(parser().parse_args(TINY))
    assert abs(mean_log_length(flat, 5) - mean_log_length(flat, 1)) < 0.15
