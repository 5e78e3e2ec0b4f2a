"""Does a run learn? Reads runs' `metrics.jsonl` and prints, per run:

- validation, first against last: greedy pass@1 and mean@k, each change in units of the
  first validation's standard error (`z`, the issue's yardstick), of the difference's
  unpaired standard error (`z_diff`, sqrt(se_a^2 + se_b^2): conservative, since both
  passes see the same prompts) and of its paired one (`z_paired`: the standard error of
  the per-prompt differences, from `val/per_prompt/*`, when the run recorded them);
- the same per band of digit counts (`val/digits_<lo>-<hi>/`), where the run has them;
- the reward of short and of long rounds over the first and the last third of the run;
- the training signals over the thirds: entropy, clip fraction, KL to the initial model
  (when `train.kl_coef` > 0), gradient norm, response tokens trained.

    .venv/bin/python -m bench.learning runs/latest [more run dirs] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import write_json
from rpk.obs.metrics import read_records
from rpk.obs.validation import PHASE

SIGNALS = ("reward_mean", "train_entropy", "train_clip_frac", "train_kl", "train_grad_norm",
           "train_train_tokens")


def _change(first: Mapping[str, Any], last: Mapping[str, Any], key: str) -> dict[str, float]:
    a, b = float(first[key]), float(last[key])
    se_a, se_b = float(first.get(f"{key}_se", 0.0)), float(last.get(f"{key}_se", 0.0))
    diff_se = math.hypot(se_a, se_b)
    return {"first": a, "last": b, "se_first": se_a,
            "z": (b - a) / se_a if se_a else math.nan,
            "z_diff": (b - a) / diff_se if diff_se else math.nan}


def _paired_z(first: Mapping[str, Any], last: Mapping[str, Any], key: str, k: int) -> float:
    a, b = first.get(f"val/per_prompt/{key}"), last.get(f"val/per_prompt/{key}")
    if not a or not b or len(a) != len(b):
        return math.nan
    d = [(y - x) / k for x, y in zip(a, b)]
    se = statistics.stdev(d) / math.sqrt(len(d))
    return statistics.fmean(d) / se if se else math.nan


def _thirds(records: Sequence[Mapping[str, Any]], key: str) -> tuple[float, float]:
    values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
    if len(values) < 3:
        return math.nan, math.nan
    third = len(values) // 3
    return statistics.fmean(values[:third]), statistics.fmean(values[-third:])


def analyse(run_dir: Path) -> dict[str, Any]:
    metrics = run_dir / "metrics.jsonl"
    steps = read_records(metrics)
    evals = [r for r in read_records(metrics, PHASE) if "val/acc_greedy" in r]
    out: dict[str, Any] = {"run": str(run_dir), "steps": len(steps)}
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        out["val_steps"] = [first["step"], last["step"]]
        out["val_prompts"] = first["val/prompts"]
        keys = ["acc_greedy"] + [k[4:] for k in first if k.startswith("val/mean@") and "_" not in k]
        out["val"] = {key: _change(first, last, f"val/{key}") for key in keys}
        out["val"]["acc_greedy"]["z_paired"] = _paired_z(first, last, "greedy", 1)
        for key in keys[1:]:
            out["val"][key]["z_paired"] = _paired_z(first, last, "sampled", int(key[5:]))
        bands = sorted({k.split("/")[1] for k in first if k.startswith("val/digits_")},
                       key=lambda b: int(b.split("_")[1].split("-")[0]))
        out["bands"] = {
            band: {"prompts": first[f"val/{band}/prompts"],
                   **{key: _change(first, last, f"val/{band}/{key}") for key in keys}}
            for band in bands if f"val/{band}/prompts" in last
        }
    for kind in ("short", "long"):
        rounds = [r for r in steps if r.get("round_kind") == kind]
        out[kind] = {"rounds": len(rounds), "thirds": {key: _thirds(rounds, key) for key in SIGNALS}}
    return out


def _show(result: Mapping[str, Any]) -> None:
    print(f"\n{result['run']}  ({result['steps']} steps)")
    if "val" in result:
        print(f"  validation, steps {result['val_steps'][0]} -> {result['val_steps'][1]}, "
              f"{result['val_prompts']:.0f} prompts")
        for key, c in result["val"].items():
            print(f"    {key:<12} {c['first']:.3f} -> {c['last']:.3f}  (se {c['se_first']:.3f}, "
                  f"z {c['z']:+.2f}, z_diff {c['z_diff']:+.2f}, z_paired {c['z_paired']:+.2f})")
        for band, b in result["bands"].items():
            cells = "  ".join(f"{key} {c['first']:.3f} -> {c['last']:.3f}"
                              for key, c in b.items() if key != "prompts")
            print(f"    {band:<14} ({b['prompts']:.0f})  {cells}")
    for kind in ("short", "long"):
        k = result[kind]
        cells = "  ".join(f"{key.removeprefix('train_')} {a:.4g} -> {b:.4g}"
                          for key, (a, b) in k["thirds"].items() if not math.isnan(a))
        print(f"  {kind} rounds ({k['rounds']}), first third -> last third: {cells}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.learning", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (with metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = [analyse(d) for d in args.runs]
    for result in results:
        _show(result)
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
