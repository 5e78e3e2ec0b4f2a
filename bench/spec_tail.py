"""The speculative tail on the real CPU engine: each policy with and without speculative
decoding, over seeds, in two settings.

- `default`: the default job (the arithmetic task, P0 = 32 prompts x R0 = 8 a step);
- `latency`: a latency-bound job, few prompts a step (P0 = 4 x R0 = 8) of long problems
  (every digit count equally likely, so most responses run long): a step's rollout is
  its longest response decoding nearly alone, where speculation should pay most.

Each run is `python -m rpk.run` for `--steps` steps, validated greedily on held-out
prompts after the last (`--val`; the latency setting's are long problems too). Runs go
seed by seed (an interrupted bench keeps whole seeds), setting by setting, policy by
policy, `off` then each speculative choice (`--speculative`, default `all`), so a
policy's arms run side by side in time. In the
latency setting `tail` also runs the two single sources `partials` (its aborted partial
responses) and `prompt` (the prompt's own n-grams), to weigh the one against the other.

A row per run, with:
- `prompts_per_s`: prompts trained per wall second over whole steps (rollout, training,
  weight sync), and `vs_off` against the same policy and seed without speculation;
- `rollout_s`, `long_round_rollout_s` (summed over the long rounds; None without one),
  `rollout_vs_off`, `long_vs_off`;
- `tokens_per_verify` (tokens a drafting row gained per verify step, over the run),
  and per draft source its share of draft tokens and acceptance;
- `spec_tail_s_saved`: the step records' estimate of seconds saved;
- `logprob_mismatch`: the trainer's mean |log-prob - the engine's| per token;
- `val_greedy`, `val_greedy_se` and `val_z` (against `off`, in standard errors of the
  difference).
Then a row per (setting, policy, speculative) over its seeds (`seed` "all").

    flock /tmp/rpk-heavy.lock .venv/bin/python -m bench.spec_tail --out bench/results/spec_tail.json
    .venv/bin/python -m bench.spec_tail --settings latency --seeds 0 --policies tail --steps 4
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.common import Col, split_passthrough, table_line, write_json

POLICIES = ("sync", "tail", "length_aware")
SETTINGS = ("default", "latency")
# What each setting adds to every run: the default job as it is; the latency-bound one
# at a few prompts a step, the long problems' files written by `_long_rows`.
SETTING_ARGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "latency": ("--rollout.prompts_per_step", "4", "--rollout.responses_per_prompt", "8"),
}
SOURCES = ("sibling", "partial", "epoch", "prompt")
MISMATCH = "train_logprob_mismatch"  # the trainer's mean |log-prob - the sampler's| per token


def _long_rows(directory: Path, n_train: int, n_val: int) -> tuple[str, ...]:
    """jsonl files of long problems (digit counts uniform up to the task's 20, not the
    default task's long tail), for the latency setting, and the overrides naming them."""
    from rpk.tasks.arith import held_out_rows, make_rows
    from rpk.tasks.specs import ArithSpec

    spec = ArithSpec(alpha=0.0)
    train = make_rows(n_train, seed=20_000, spec=spec)
    val = held_out_rows(n_val, 30_000, train, spec)
    paths = []
    for name, rows in (("train", train), ("val", val)):
        path = directory / f"long_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return ("--data.train_files", paths[0], "--data.val_files", paths[1])


def summarize(records: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One run's row from its step and validation records."""
    trained = sum(r["prompts"] for r in records)
    step_s = sum(r["time_step_s"] for r in records)
    long = [r["time_rollout_s"] for r in records if r["round_kind"] == "long"]
    drafts = sum(r.get("spec_drafts", 0.0) for r in records)
    accepted = sum(r.get("spec_accepted", 0.0) for r in records)
    draft_tokens = sum(r.get("spec_draft_tokens", 0.0) for r in records)
    last = next((e for e in reversed(evals) if "val/acc_greedy" in e), None)
    row: dict[str, Any] = {
        "steps": len(records),
        "prompts_trained": trained,
        "step_s_total": step_s,
        "prompts_per_s": trained / step_s if step_s else None,
        "rollout_s": sum(r["time_rollout_s"] for r in records),
        "long_rounds": len(long),
        "long_round_rollout_s": sum(long) if long else None,
        "tokens_per_verify": 1 + accepted / drafts if drafts else 1.0,
        "spec_drafts": drafts,
        "spec_accept_rate": accepted / draft_tokens if draft_tokens else None,
        "spec_tail_s_saved": sum(r.get("spec_tail_s_saved", 0.0) for r in records),
        "logprob_mismatch": statistics.fmean(r[MISMATCH] for r in records if MISMATCH in r)
        if any(MISMATCH in r for r in records) else None,
        "reward_mean": statistics.fmean(r["reward_mean"] for r in records),
        # the step cost the run's plan had measured by its last step (None: never measured)
        **{key: next((r[f"spec_cost_{key}"] for r in reversed(records) if f"spec_cost_{key}" in r), None)
           for key in ("fixed_s", "token_s", "verify_s")},
        "val_greedy": last["val/acc_greedy"] if last else None,
        "val_greedy_se": last["val/acc_greedy_se"] if last else None,
    }
    for source in SOURCES:
        share = [r[f"spec_share_{source}"] * r.get("spec_draft_tokens", 0.0)
                 for r in records if f"spec_share_{source}" in r]
        acc = [r[f"spec_accept_{source}"] * r[f"spec_share_{source}"] * r.get("spec_draft_tokens", 0.0)
               for r in records if f"spec_accept_{source}" in r]
        tokens = sum(share)
        row[f"share_{source}"] = tokens / draft_tokens if draft_tokens else None
        row[f"accept_{source}"] = sum(acc) / tokens if tokens else None
    return row


def _ratio(row: dict[str, Any], base: dict[str, Any] | None, key: str, inverse: bool = False) -> float | None:
    if base is None or not row.get(key) or not base.get(key):
        return None
    return base[key] / row[key] if inverse else row[key] / base[key]


def against_off(rows: list[dict[str, Any]]) -> None:
    """Each row against the same setting, policy and seed without speculation."""
    off = {(r["setting"], r["policy"], r["seed"]): r for r in rows if r["speculative"] == "off"}
    for row in rows:
        base = off.get((row["setting"], row["policy"], row["seed"]))
        row["vs_off"] = _ratio(row, base, "prompts_per_s")
        row["rollout_vs_off"] = _ratio(row, base, "rollout_s", inverse=True)  # > 1: faster
        row["long_vs_off"] = _ratio(row, base, "long_round_rollout_s", inverse=True)
        ok = base is not None and row["val_greedy"] is not None and base["val_greedy"] is not None
        se = (row["val_greedy_se"] ** 2 + base["val_greedy_se"] ** 2) ** 0.5 if ok else 0.0
        row["val_z"] = (row["val_greedy"] - base["val_greedy"]) / se if ok and se > 0 else None


def pooled(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per (setting, policy, speculative) over its seeds: throughput over all their
    steps' time, rollout summed, the seeds' mean accuracy and its standard error."""
    out = []
    keys = dict.fromkeys((r["setting"], r["policy"], r["speculative"]) for r in rows)
    for setting, policy, spec in keys:
        mine = [r for r in rows if (r["setting"], r["policy"], r["speculative"]) == (setting, policy, spec)]
        step_s = sum(r["step_s_total"] for r in mine)
        longs = [r["long_round_rollout_s"] for r in mine if r["long_round_rollout_s"] is not None]
        drafts = sum(r["spec_drafts"] for r in mine)
        accs = [r["val_greedy"] for r in mine if r["val_greedy"] is not None]
        ses = [r["val_greedy_se"] for r in mine if r["val_greedy_se"] is not None]
        row: dict[str, Any] = {
            "setting": setting, "policy": policy, "speculative": spec, "seed": "all",
            "steps": sum(r["steps"] for r in mine),
            "prompts_trained": sum(r["prompts_trained"] for r in mine), "step_s_total": step_s,
            "prompts_per_s": sum(r["prompts_trained"] for r in mine) / step_s if step_s else None,
            "rollout_s": sum(r["rollout_s"] for r in mine),
            "long_rounds": sum(r["long_rounds"] for r in mine),
            "long_round_rollout_s": sum(longs) if longs else None,
            "tokens_per_verify": (sum(r["tokens_per_verify"] * r["spec_drafts"] for r in mine) / drafts
                                  if drafts else 1.0),
            "spec_drafts": drafts,
            "spec_accept_rate": _mean(r["spec_accept_rate"] for r in mine),
            "spec_tail_s_saved": sum(r["spec_tail_s_saved"] for r in mine),
            "logprob_mismatch": _mean(r["logprob_mismatch"] for r in mine),
            "reward_mean": _mean(r["reward_mean"] for r in mine),
            "val_greedy": statistics.fmean(accs) if accs else None,
            "val_greedy_se": (sum(se * se for se in ses) ** 0.5) / len(ses) if ses else None,
        }
        for source in SOURCES:
            row[f"share_{source}"] = _mean(r[f"share_{source}"] for r in mine)
            row[f"accept_{source}"] = _mean(r[f"accept_{source}"] for r in mine)
        out.append(row)
    return out


def _mean(values: Any) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


COLUMNS = (
    Col("setting", "setting", 9, "<"), Col("policy", "policy", 13, "<"), Col("spec", "speculative", 9, "<"),
    Col("seed", "seed", 5, ">"), Col("prompts/s", "prompts_per_s", 10, ".3f"),
    Col("vs off", "vs_off", 8, ".3f", "x"), Col("rollout s", "rollout_s", 10, ".1f"),
    Col("vs off", "rollout_vs_off", 8, ".2f", "x"), Col("long s", "long_round_rollout_s", 8, ".1f"),
    Col("vs off", "long_vs_off", 8, ".2f", "x"), Col("tok/verify", "tokens_per_verify", 11, ".2f"),
    Col("saved s", "spec_tail_s_saved", 8, ".1f"), Col("|dlogp|", "logprob_mismatch", 9, ".1e"),
    Col("val", "val_greedy", 7, ".3f"), Col("+-se", "val_greedy_se", 6, ".3f"), Col("z", "val_z", 6, ".2f"),
)
SOURCE_COLUMNS = (
    Col("setting", "setting", 9, "<"), Col("policy", "policy", 13, "<"), Col("spec", "speculative", 9, "<"),
    Col("tok/verify", "tokens_per_verify", 11, ".2f"),
    *(Col(f"{s[:7]} sh", f"share_{s}", 10, ".1%") for s in SOURCES),
    *(Col(f"{s[:7]} acc", f"accept_{s}", 11, ".1%") for s in SOURCES),
)


def runs(args: Any) -> list[tuple[str, int, str, str]]:
    """(setting, seed, policy, speculative) in the order they run."""
    out = []
    for seed in args.seeds:
        for setting in args.settings:
            for policy in args.policies:
                arms = ["off", *args.speculative]
                if setting == "latency" and policy == "tail" and args.sources:
                    arms += [s for s in ("partials", "prompt") if s not in arms]
                out += [(setting, seed, policy, arm) for arm in arms]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    ap = common.parser(__doc__, "write the JSON list here")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--speculative", nargs="+", default=["all"])
    ap.add_argument("--no-sources", dest="sources", action="store_false",
                    help="skip the latency setting's partials and prompt runs of tail")
    ap.add_argument("--val", type=int, default=256, help="held-out prompts validated after the last step")
    ap.add_argument("--cache-dir", default=".cache/rpk")
    args = ap.parse_args(own)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        long_files = _long_rows(Path(tmp), 2000, args.val) if "latency" in args.settings else ()
        for setting, seed, policy, spec in runs(args):
            print(f"== {setting}, seed {seed}, {policy}, speculative {spec}: {args.steps} steps", flush=True)
            data = long_files if setting == "latency" else ("--data.val_size", str(args.val))
            code, records, evals = common.run_phases([
                "--model.cache_dir", args.cache_dir, "--run.eval_every", "0", "--run.eval_k", "0",
                "--run.eval_before_train", "false", *SETTING_ARGS[setting], *data,
                "--rollout.policy", policy, "--rollout.speculative", spec, "--run.seed", str(seed),
                "--run.steps", str(args.steps), *passthrough,
            ])
            if code != 0:
                return code
            rows.append({"setting": setting, "policy": policy, "speculative": spec, "seed": seed,
                         **summarize(records, evals)})
            against_off(rows)
            print(table_line(rows[-1], COLUMNS), flush=True)
            write_json(args.out, rows)  # what has run so far survives an interruption
    if len(args.seeds) > 1:
        rows += pooled(rows)
        against_off(rows)
    print()
    common.print_table(rows, COLUMNS)
    print()
    common.print_table([r for r in rows if r["speculative"] != "off"], SOURCE_COLUMNS)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
