"""bench.learning: first-against-last validation (unpaired and paired), digit bands,
and round rewards by thirds, from a run's metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest

from bench.learning import analyse, main


def write_run(tmp_path, greedy_last: list[int]) -> None:
    n = len(greedy_last)
    first = [0] * n

    def val(step: int, bits: list[int]) -> dict:
        acc = sum(bits) / n
        se = math.sqrt(acc * (1 - acc) / (n - 1)) if 0 < acc < 1 else 0.0
        return {"step": step, "phase": "eval", "val/prompts": float(n), "val/acc_greedy": acc,
                "val/acc_greedy_se": se or 0.01, "val/mean@2": acc / 2, "val/mean@2_se": 0.01,
                "val/per_prompt/greedy": bits, "val/per_prompt/sampled": [b for b in bits],
                "val/digits_7-10/prompts": float(n), "val/digits_7-10/acc_greedy": acc,
                "val/digits_7-10/acc_greedy_se": se, "val/digits_7-10/mean@2": acc / 2}

    steps = [{"step": s, "round_kind": "long" if s % 5 == 0 else "short",
              "reward_mean": 0.1 * s if s % 5 == 0 else 0.9, "train_entropy": 0.05}
             for s in range(1, 16)]
    lines = [val(0, first), *steps, val(15, greedy_last)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_paired_and_unpaired_changes_and_long_rounds_by_thirds(tmp_path, capsys):
    write_run(tmp_path, [1] * 10 + [0] * 30)  # 10 of 40 prompts flip to right, none back
    result = analyse(tmp_path)
    greedy = result["val"]["acc_greedy"]
    assert greedy["first"] == 0.0 and greedy["last"] == 0.25
    assert greedy["z"] == pytest.approx(0.25 / 0.01)
    # per-prompt differences: ten 1s, thirty 0s
    d_se = math.sqrt(0.25 * 0.75 * 40 / 39) / math.sqrt(40)
    assert greedy["z_paired"] == pytest.approx(0.25 / d_se)
    assert result["val"]["mean@2"]["z_paired"] == pytest.approx(0.125 / (d_se / 2))
    assert result["bands"]["digits_7-10"]["acc_greedy"]["last"] == 0.25
    # long rounds at steps 5, 10, 15: first third 0.5, last third 1.5
    assert result["long"]["rounds"] == 3
    assert result["long"]["thirds"]["reward_mean"] == pytest.approx((0.5, 1.5))
    assert main([str(tmp_path)]) == 0
    assert "z_paired +" in capsys.readouterr().out
