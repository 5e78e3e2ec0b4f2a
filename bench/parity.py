"""On-policy parity: validation accuracy of round policies at equal prompts trained and at
equal wall time. The same model, data, seed and validation set per policy, the same
number of steps (P0 trained prompts each), validated before training, every
`--eval-every` steps and at the end.

    .venv/bin/python -m bench.parity --policies sync tail --steps 25 --eval-every 5 \\
        --out bench/results/parity.json --png bench/results/parity.png

Arguments after `--` go to every run as config overrides; `--policies` takes any name
of the policy registry.

A policy may carry its own settings, for ablations: `tail+rollout.eta_responses=1`
(several joined by `+`). `--runs DIR` keeps each run's directory; with `--reuse`, a run
whose directory there already holds its last validation is read, not run again (a
bench interrupted, or policies added to one that ran).

`--seeds 0 1 2` runs every policy once per seed (`run.seed`: the training prompts, the
data order and the sampling; the model is the same). Per seed, the first policy
validates before training and the others reuse its step-0 point: same model, same
validation set, same sampling seeds, so a validation is the same (rpk's runs are
deterministic on one machine). Each seed has its own validation set, shared by every
policy of that seed and the same whichever seeds one invocation holds, so that seeds run
by separate invocations pool; a reused run records the digest of the set it was
validated on (`val_set.sha256`), and one validated on another set is refused. The curves
are pooled over seeds point by point: the mean accuracy, its standard error
sqrt(sum se_i^2) / n (each seed's over the validation prompts), the seeds' own spread
beside it, and the mean wall time.

The validation set is the built-in task's held-out problems of at most `--val-digits`
digits (0, the default, takes every digit count, as the default run validates), none a
training prompt of the seed's runs, written to a jsonl file and given to every run as
`data.val_files`. There are no held-out 1-digit problems (all 55 are training prompts).

Wall time is the training's own (the sum of the step times: rollout, training, weight
sync), without start-up or validation. The table gives each policy's accuracy with its
standard error over the validation prompts, and its difference from the first policy in
units of the difference's standard error (sqrt(se_a^2 + se_b^2), unpaired: conservative,
since both see the same prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench import common
from bench.common import QUIET, args_json, split_passthrough, write_json
from rpk import assembly, run
from rpk.config import from_argv
from rpk.obs.metrics import read_records
from rpk.obs.validation import PHASE
from rpk.sched.policies import POLICIES
from rpk.tasks import arith

COLORS = ("#4c72b0", "#c44e52", "#55a868", "#8172b2", "#937860")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`tail` or `tail+rollout.eta_responses=1+run.seed=1` -> (policy, config overrides)."""
    policy, *settings = text.split("+")
    if policy not in POLICIES:
        raise argparse.ArgumentTypeError(f"{policy!r} is not one of {', '.join(POLICIES)}")
    overrides = []
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not (eq and key):
            raise argparse.ArgumentTypeError(f"{setting!r} in {text!r} is not section.field=value")
        overrides += [f"--{key}", value]
    return policy, overrides


def write_val_set(path: Path, configs: Sequence[Sequence[str]], size: int, max_digits: int
                  ) -> Path:
    """Held-out problems of at most `max_digits` digits (0: the task's most), in veRL's
    layout, none a training prompt of any of the runs (whose config overrides
    `configs` give): one set for every run, whatever their seeds."""
    cfgs = [from_argv(list(c)) for c in configs]
    task = cfgs[0].model.tiny.task
    spec = dataclasses.replace(task, max_digits=max_digits) if max_digits else task
    exclude = [row for cfg in cfgs for row in assembly.builtin_rows(assembly.prompt_source(cfg))]
    rows = arith.held_out_rows(size, seed=20_000 + cfgs[0].run.seed, exclude=exclude, spec=spec)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


VAL_DIGEST = "val_set.sha256"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_val_set(out: Path, val: Path) -> None:
    """Refuses to pool a reused run validated on another set than this invocation's (a
    run of an older bench, or of other configs); a run without a record is taken as is."""
    recorded = out / VAL_DIGEST
    if recorded.exists() and recorded.read_text().strip() != _digest(val):
        raise SystemExit(
            f"bench.parity: {out} was validated on another set than this invocation's "
            f"({recorded} differs); delete that run or give the configs it ran with"
        )


def curve(steps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]], k: int
          ) -> list[dict[str, float]]:
    """One point per validation: prompts trained and training wall time so far, and the
    accuracies with their standard errors."""
    points = []
    for e in evals:
        done = [r for r in steps if r["step"] <= e["step"]]
        point = {
            "step": float(e["step"]),
            "prompts": float(sum(r["prompts"] for r in done)),
            "wall_s": sum(r["time_step_s"] for r in done),
            "acc_greedy": e["val/acc_greedy"],
            "acc_greedy_se": e["val/acc_greedy_se"],
        }
        if k:
            point.update({"mean@k": e[f"val/mean@{k}"], "mean@k_se": e[f"val/mean@{k}_se"],
                          "pass@k": e[f"val/pass@{k}"]})
        points.append(point)
    return points


def pool(curves: Sequence[Sequence[Mapping[str, float]]]) -> list[dict[str, float]]:
    """Curves of one policy over seeds, validated at the same steps, as one: per point
    the mean of every value, accuracies with the standard error of that mean (the
    seeds' standard errors combined) and the standard deviation between seeds."""
    lengths = {len(c) for c in curves}
    if len(lengths) != 1:
        raise ValueError(f"seeds validated a different number of times: {sorted(lengths)}")
    pooled = []
    for points in zip(*curves):
        steps = {p["step"] for p in points}
        if len(steps) != 1:
            raise ValueError(f"seeds validated at different steps: {sorted(steps)}")
        n = len(points)
        out = {key: sum(p[key] for p in points) / n for key in points[0]}
        for key in [k[: -len("_se")] for k in points[0] if k.endswith("_se")]:
            out[f"{key}_se"] = math.sqrt(sum(p[f"{key}_se"] ** 2 for p in points)) / n
            out[f"{key}_seed_sd"] = (
                math.sqrt(sum((p[key] - out[key]) ** 2 for p in points) / (n - 1)) if n > 1 else 0.0)
        pooled.append(out)
    return pooled


def at_wall_time(points: Sequence[Mapping[str, float]], budget_s: float) -> Mapping[str, float]:
    """The last validation at or before `budget_s` of training: what the policy had
    reached by then, as measured."""
    return [p for p in points if p["wall_s"] <= budget_s + 1e-9][-1]


def _z(a: Mapping[str, float], b: Mapping[str, float], key: str) -> float:
    se = math.hypot(a[f"{key}_se"], b[f"{key}_se"])
    return (a[key] - b[key]) / se if se > 0 else 0.0


def compare(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Per policy: accuracy at the end (equal prompts trained) and by the fastest
    policy's total wall time (equal wall time), each against the first policy's, in
    standard errors of the difference."""
    budget = min(r["curve"][-1]["wall_s"] for r in rows)
    base_end = rows[0]["curve"][-1]
    base_wall = at_wall_time(rows[0]["curve"], budget)
    out = []
    for r in rows:
        end, wall = r["curve"][-1], at_wall_time(r["curve"], budget)
        entry: dict[str, Any] = {
            "policy": r["policy"], "prompts": end["prompts"], "wall_s": end["wall_s"],
            "budget_s": budget, "prompts_at_budget": wall["prompts"],
        }
        for key in metrics:
            entry[f"{key}_end"], entry[f"{key}_end_se"] = end[key], end[f"{key}_se"]
            entry[f"{key}_end_z"] = _z(end, base_end, key)
            entry[f"{key}_budget"], entry[f"{key}_budget_se"] = wall[key], wall[f"{key}_se"]
            entry[f"{key}_budget_z"] = _z(wall, base_wall, key)
        out.append(entry)
    return out


def print_table(table: Sequence[Mapping[str, Any]], metrics: Sequence[str], base: str) -> None:
    first = table[0]
    print(f"\nat equal prompts trained ({first['prompts']:.0f} each); z = difference from "
          f"{base} / its standard error")
    head = "".join(f"{m:>16}{'z':>7}" for m in metrics)
    print(f"{'policy':<12}{'wall s':>9}{head}")
    for t in table:
        cells = "".join(f"{t[f'{m}_end']:>9.3f} ±{t[f'{m}_end_se']:.3f}{t[f'{m}_end_z']:>+7.2f}"
                        for m in metrics)
        print(f"{t['policy']:<12}{t['wall_s']:>9.1f}{cells}")
    print(f"\nat equal wall time ({first['budget_s']:.1f} s of training: the fastest policy's "
          "total; each policy's last validation by then)")
    print(f"{'policy':<12}{'prompts':>9}{head}")
    for t in table:
        cells = "".join(
            f"{t[f'{m}_budget']:>9.3f} ±{t[f'{m}_budget_se']:.3f}{t[f'{m}_budget_z']:>+7.2f}"
            for m in metrics)
        print(f"{t['policy']:<12}{t['prompts_at_budget']:>9.0f}{cells}")


def print_speed(rows: Sequence[Mapping[str, Any]]) -> None:
    base = sum(s["time_rollout_s"] for s in rows[0]["speed"])
    print(f"\n{'policy':<12}{'rollout s':>11}{'step s':>9}{'tokens':>11}{'wasted':>8}"
          f"{'rollout speed vs ' + rows[0]['policy']:>24}{'long rounds':>13}"
          f"{'p50 len, other rounds':>23}   (summed over seeds)")
    for r in rows:
        roll = sum(s["time_rollout_s"] for s in r["speed"])
        gen = sum(s["tokens_generated"] for s in r["speed"])
        wasted = sum(s["tokens_wasted_frac"] * s["tokens_generated"] for s in r["speed"])
        kinds = [k for s in r["speed"] for k, _, _ in s["rounds"]]
        p50 = [p for s in r["speed"] for k, p, _ in s["rounds"] if k != "long"]
        print(f"{r['policy']:<12}{roll:>11.1f}{sum(s['time_step_s'] for s in r['speed']):>9.1f}"
              f"{gen:>11.0f}{wasted / gen if gen else 0.0:>8.1%}{base / roll:>23.2f}x"
              f"{kinds.count('long'):>13}{statistics.median(p50) if p50 else 0.0:>23.0f}")


def plot(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], path: Path) -> Path:
    fig = Figure(figsize=(13, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    n = rows[0]["val_prompts"]  # the same set for every run
    for ax, x, label in ((axes[0], "prompts", "prompts trained"),
                         (axes[1], "wall_s", "training wall time, s (rollout + train + sync)")):
        for row, color in zip(rows, COLORS):
            xs = [p[x] for p in row["curve"]]
            for key, style in zip(metrics, ("-o", "--s")):
                ys = [p[key] for p in row["curve"]]
                ax.plot(xs, ys, style, color=color, markersize=4, linewidth=1.4,
                        label=f"{row['policy']}, {'greedy' if key == 'acc_greedy' else key}")
                se = [p[f"{key}_se"] for p in row["curve"]]
                ax.fill_between(xs, [y - s for y, s in zip(ys, se)], [y + s for y, s in zip(ys, se)],
                                color=color, alpha=0.12, linewidth=0)
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    seeds = len(rows[0].get("per_seed", ())) or 1
    pooled = f"mean of {seeds} seeds; " if seeds > 1 else ""
    axes[0].set_ylabel(f"validation accuracy, {n} held-out prompts\n({pooled}band ±1 s.e.)")
    axes[0].set_title("at equal prompts trained", fontsize=11)
    axes[1].set_title("at equal wall time", fontsize=11)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _finished(path: Path, steps: int) -> bool:
    """A run's records hold its last validation (at step `steps`)."""
    return path.exists() and any(e["step"] == steps for e in read_records(path, PHASE))


def speed(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's rollout seconds and tokens, summed over its steps, and what its rounds
    held: per step its kind, its responses' median length, and (length_aware) the
    prompts still pending in its draw."""
    generated = sum(r["tokens_generated"] for r in steps)
    return {"time_rollout_s": sum(r["time_rollout_s"] for r in steps),
            "time_step_s": sum(r["time_step_s"] for r in steps),
            "tokens_generated": float(generated),
            "tokens_wasted_frac": sum(r["tokens_wasted"] for r in steps) / generated
            if generated else 0.0,
            "rounds": [[r["round_kind"], r["response_len_p50"], r.get("pending_prompts")]
                       for r in steps]}


def main() -> int:
    argv, passthrough = split_passthrough(sys.argv[1:])
    ap = common.parser(__doc__, "write the JSON here")
    ap.add_argument("--policies", nargs="+", default=["sync", "tail"],
                    help="policy names, each optionally with its own settings "
                    "(tail+rollout.eta_responses=1); the first is the baseline")
    ap.add_argument("--steps", type=int, default=25, help="steps per policy (P0 prompts each)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--val-size", type=int, default=512, help="held-out prompts validated")
    ap.add_argument("--val-digits", type=int, default=0,
                    help="the most digits of a validation problem; 0 = the task's most")
    ap.add_argument("--k", type=int, default=4, help="sampled responses per validation prompt")
    ap.add_argument("--seeds", type=int, nargs="+",
                    help="run.seed of each run of every policy, pooled (default: the config's)")
    ap.add_argument("--runs", type=Path, help="keep the run directories here (default: deleted)")
    ap.add_argument("--reuse", action="store_true",
                    help="read the runs of --runs that already finished instead of running them")
    ap.add_argument("--png", type=Path, help="write the plot here")
    args = ap.parse_args(argv)
    try:
        variants = {name: parse_variant(name) for name in args.policies}
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if args.reuse and not args.runs:
        ap.error("--reuse reads the runs of --runs: give --runs")
    seeds: list[int | None] = list(args.seeds) if args.seeds else [None]
    metrics = ["acc_greedy"] + (["mean@k"] if args.k else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        seeded = [[] if s is None else ["--run.seed", str(s)] for s in seeds]
        configs = [[*passthrough, *extra, *seed] for _, extra in variants.values() for seed in seeded]
        vals = {
            seed: write_val_set(Path(tmp) / f"val_{seed}.jsonl",
                                [c for c in configs if c[len(c) - len(seed_args):] == seed_args],
                                args.val_size, args.val_digits)
            for seed, seed_args in zip(seeds, seeded)
        }
        first: dict[int | None, dict[str, Any]] = {}  # per seed, the step-0 validation
        for name, (policy, extra) in variants.items():
            curves, speeds = [], []
            for seed, seed_args in zip(seeds, seeded):
                label = name if seed is None else f"{name} seed {seed}"
                out = (args.runs or Path(tmp)) / (name if seed is None else f"{name}/seed{seed}")
                path = out / "latest" / "metrics.jsonl"
                val = vals[seed]
                if args.reuse and _finished(path, args.steps):
                    check_val_set(out, val)
                    print(f"== {label}: read from {path}", flush=True)
                else:
                    print(f"== {label}: {args.steps} steps, validating every {args.eval_every}",
                          flush=True)
                    code = run.main(
                        ["--rollout.policy", policy, "--run.steps", str(args.steps),
                         "--run.eval_every", str(args.eval_every), "--run.eval_k", str(args.k),
                         "--data.val_files", str(val), "--run.out_dir", str(out),
                         "--run.eval_before_train", "false" if seed in first else "true",
                         *QUIET, "--run.trackers", "",
                         *passthrough, *extra, *seed_args]
                    )
                    if code != 0:
                        return code
                    (out / VAL_DIGEST).write_text(_digest(val) + "\n")
                steps, evals = read_records(path), read_records(path, PHASE)
                if evals[0]["step"] == 0:
                    first.setdefault(seed, evals[0])
                else:
                    evals = [first[seed], *evals]
                curves.append(curve(steps, evals, args.k))
                speeds.append(speed(steps))
            rows.append({"policy": name, "val_prompts": int(first[seeds[0]]["val/prompts"]),
                         "seeds": seeds, "per_seed": curves, "speed": speeds,
                         "curve": pool(curves)})
    table = compare(rows, metrics)
    print_table(table, metrics, rows[0]["policy"])
    print_speed(rows)
    write_json(args.out, {"args": args_json(args), "passthrough": passthrough, "table": table,
                          "runs": rows})
    if args.png:
        print(f"wrote {plot(rows, metrics, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
