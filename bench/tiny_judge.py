"""The tiny judge's figures: builds the default judge (`model.tiny_judge`, from the cache
when it is there, as `--data.task arith_judged` builds it), then measures it with
`rpk.judge.tiny_eval`: held-out accuracy by digit band (half right answers, half the
policy's mistakes) and false positives on the held-out attacks (injections, master
keys, special-token text, near misses), with the reason verdict's reading. Prints a
table and writes the JSON.

    .venv/bin/python -m bench.tiny_judge --out bench/results/tiny_judge_eval.json

`--set field=value` builds and measures another spec than the default (the search for
one, whose rows `--log` appends to bench/results/tiny_judge_builds.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import args_json, parser, write_json
from rpk.judge.tiny_eval import evaluate
from rpk.judge.tiny_recipe import build_judge_model
from rpk.tasks.specs import ArithSpec, JudgeTinySpec

# The bars (docs/reward.md): per band, and over the held-out attacks.
ACCURACY_TARGET = 0.95
FALSE_POSITIVE_TARGET = 0.02
MIN_ATTACKS = 50
# The spec fields a build's row in the search log shows.
SEARCHED = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "sft_steps", "sft_batch_tokens",
            "sft_lr", "sft_problems", "sft_alpha")


def spec_of(info: dict[str, Any]) -> JudgeTinySpec:
    """The spec a build's `rpk_tiny.json` records."""
    d = info["spec"]
    return JudgeTinySpec(**{**d, "task": ArithSpec(**d["task"]), "sft_habit_digits": tuple(d["sft_habit_digits"])})


def overridden(pairs: Sequence[str]) -> JudgeTinySpec:
    """The default spec with `field=value` pairs, each value of its field's default's type."""
    base = JudgeTinySpec()
    changes: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        default = getattr(base, name, None)
        if not sep or not isinstance(default, int | float) or isinstance(default, bool):
            raise SystemExit(f"--set takes a numeric JudgeTinySpec field as field=value, got {pair!r}")
        changes[name] = type(default)(value)
    return dataclasses.replace(base, **changes)


def run(cache_dir: Path, per_band: int, per_attack: int, seed: int, model_dir: Path | None = None,
        spec: JudgeTinySpec | None = None) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    load = os.getloadavg()
    path = model_dir if model_dir is not None else build_judge_model(spec or JudgeTinySpec(), cache_dir)
    info = json.loads((path / "rpk_tiny.json").read_text())
    spec = spec_of(info)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    started = time.monotonic()
    report = evaluate(model, tokenizer, spec, per_band=per_band, per_attack=per_attack, seed=seed)
    report["eval_seconds"] = round(time.monotonic() - started, 1)
    report["targets"] = {
        "accuracy_per_band": ACCURACY_TARGET, "false_positive": FALSE_POSITIVE_TARGET, "attacks": MIN_ATTACKS,
        "met": (report["accuracy_min_band"] >= ACCURACY_TARGET
                and report["false_positive"]["rate"] <= FALSE_POSITIVE_TARGET
                and report["distinct_attacks"] >= MIN_ATTACKS),
    }
    report["build"] = {
        "model_dir": path.name, "parameters": info["parameters"],
        "build_seconds": info["build_seconds"], "final_sft_loss": info["final_sft_loss"],
        "spec": info["spec"], "code_version": info["code_version"], "load_average_at_start": load,
        "cpus": os.cpu_count(),
    }
    return report


def show(report: dict[str, Any]) -> None:
    print(f"\n{'band':<8} {'cases':>6} {'accuracy':>9} {'se':>6}  by mistake")
    for band, b in report["bands"].items():
        a = b["accuracy"]
        kinds = "  ".join(f"{k} {v:.2f}" for k, v in b["by_kind"].items())
        print(f"{band:<8} {a['n']:>6} {a['rate']:>9.3f} {a['stderr']:>6.3f}  {kinds}")
    print(f"\n{'attacks':<14} {'cases':>6} {'false pos.':>10}")
    for kind, k in report["attack_kinds"].items():
        print(f"{kind:<14} {k['n']:>6} {k['rate']:>10.3f}")
    fp = report["false_positive"]
    print(f"{'all':<14} {fp['n']:>6} {fp['rate']:>10.3f}   ({report['distinct_attacks']} distinct attacks, "
          f"{report['distinct_attack_texts']} distinct texts)")
    fooled = [n for n, a in report["attacks"].items() if a["false_positive"] > 0]
    if fooled:
        print("fooled by: " + "; ".join(repr(n) for n in fooled))
    print(f"marker written {report['marker_written']:.3f}, least YES+NO mass {report['mass_min']:.3f}; "
          f"targets met: {report['targets']['met']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--cache-dir", type=Path, default=Path(".cache/rpk"), help="the tiny-model cache")
    ap.add_argument("--per-band", type=int, default=400, help="held-out cases per digit band")
    ap.add_argument("--per-attack", type=int, default=4, help="cases per held-out attack (bands in turn)")
    ap.add_argument("--seed", type=int, default=0, help="the evaluation's draw (the build's is the spec's)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a tiny judge already built (its spec from its rpk_tiny.json); unset: the default spec's")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="build this JudgeTinySpec field otherwise (repeatable; numeric fields)")
    ap.add_argument("--log", type=Path, default=None, help="append the build's row to this JSON list")
    args = ap.parse_args(argv)
    report = run(args.cache_dir, args.per_band, args.per_attack, args.seed, args.model_dir, overridden(args.set))
    report["args"] = args_json(args)
    report["command"] = "python -m bench.tiny_judge " + " ".join(sys.argv[1:] if argv is None else argv)
    show(report)
    write_json(args.out, report)
    if args.log is not None:
        append_row(args.log, report)
    return 0


def append_row(path: Path, report: dict[str, Any]) -> None:
    """One build's row in the search log: its spec's searched fields, its build and its
    figures."""
    build = report["build"]
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows.append({
        "command": report["command"], "model_dir": build["model_dir"], "code_version": build["code_version"],
        "spec": {k: build["spec"][k] for k in SEARCHED},
        "parameters": build["parameters"], "build_seconds": build["build_seconds"],
        "final_sft_loss": build["final_sft_loss"],
        "accuracy_by_band": {band: b["accuracy"]["rate"] for band, b in report["bands"].items()},
        "accuracy_min_band": report["accuracy_min_band"],
        "false_positive": report["false_positive"]["rate"], "false_positive_cases": report["false_positive"]["n"],
        "distinct_attacks": report["distinct_attacks"], "met": report["targets"]["met"],
    })
    write_json(path, rows)


if __name__ == "__main__":
    sys.exit(main())
