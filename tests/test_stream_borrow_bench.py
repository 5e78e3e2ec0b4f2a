"""bench/stream_borrow.py's core on a tiny setup: every mode trains, only borrow lends
and migrates, streaming modes hide trainer time behind the round. No timing claims."""

from __future__ import annotations

from bench.stream_borrow import VARIANTS, compare, parser

# 2 nodes x 2 devices at TP 1 (4 replicas), P0=8 x R0=4, 5 steps: 4 short rounds and
# the long round of a 40-prompt epoch.
TINY = ["--nodes", "2", "--devices-per-node", "2", "--tp", "1", "--p0", "8", "--r0", "4",
        "--prompts", "40", "--steps", "5", "--median", "100", "--max-tokens", "1024",
        "--prompt-tokens", "32", "--kv-tokens", "5000", "--weight-tokens", "1500", "--chunk", "16",
        "--chunk-tokens", "2000", "--check-s", "0.1"]


async def test_only_borrow_lends_and_streaming_modes_hide_trainer_time():
    result = await compare(parser().parse_args(TINY))
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(VARIANTS)
    for r in rows.values():
        assert r["steps"] == 5 and r["prompts_trained"] == 40
        assert r["step_s"] >= r["rollout_s"] + r["train_exposed_s"] > 0
    none, thread, borrow = rows["none"], rows["thread"], rows["borrow"]
    assert none["speedup_vs_none"] == 1.0 and none["hidden_share"] == 0.0
    assert thread["hidden_share"] > 0 and thread["loans"] == 0 and thread["migrate_s"] == 0
    assert borrow["loans"] >= 1 and borrow["migrated_requests"] > 0
    assert 0.2 <= borrow["trigger_frac_mean"] <= 1.0 and borrow["hidden_share"] > 0
    # the moved requests' recomputation at the prefill rate, over 2 kept replicas
    assert borrow["reprefill_s_est"] == borrow["migrated_tokens"] / 2 / 20_000.0
