"""What every benchmark shares: its command line (`--out`, config overrides after `--`),
running its variants (short `rpk.run`s in throwaway run directories, or the real loop on
the simulator), the table it prints and the JSON result file."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rpk.core.records import Response, Scored

# A benchmark's runs write no checkpoints and no progress bar.
QUIET = ("--run.checkpoint_every", "0", "--run.progress", "false")


def parser(doc: str | None, out_help: str = "write the result as JSON here") -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring as the help, and `--out`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, help=out_help)
    return ap


def add_sampling_args(ap: argparse.ArgumentParser, steps: int, steps_help: str | None, prompts: int,
                      p0: int = 128) -> None:
    """A simulated run's size: its steps, the prompts of an epoch, P0 prompts x R0
    responses a step, and tail batching's eta."""
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)
    ap.add_argument("--prompts", type=int, default=prompts, help="one epoch")
    ap.add_argument("--p0", type=int, default=p0)
    ap.add_argument("--r0", type=int, default=8)
    ap.add_argument("--eta", type=float, default=1.25, help="tail's eta for prompts and responses")


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, rpk config overrides given after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as JSON values (paths as strings), for the result file."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | None, result: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def run_phases(argv: Sequence[str]) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """`python -m rpk.run argv`, quiet, with its run directory in a temporary folder: its
    exit code, step records and validation records (none when it failed; it has said
    why)."""
    from rpk import run
    from rpk.obs.metrics import read_records

    with tempfile.TemporaryDirectory() as tmp:
        code = run.main([*QUIET, *argv, "--run.out_dir", tmp])
        if code != 0:
            return code, [], []
        metrics = Path(tmp) / "latest" / "metrics.jsonl"
        return code, read_records(metrics), read_records(metrics, "eval")


def run_steps(argv: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """`run_phases` without the validation records."""
    code, records, _ = run_phases(argv)
    return code, records


Summarize = Callable[[str, Sequence[Mapping[str, Any]]], dict[str, Any]]


def run_variants(
    variants: Mapping[str, Sequence[str]], steps: int, summarize: Summarize,
    common: Sequence[str] = (), passthrough: Sequence[str] = (),
) -> tuple[int, list[dict[str, Any]]]:
    """Each variant one `run_steps` of `steps` steps, in order, on the config overrides
    `common`, then the variant's own, then `passthrough` (the last word): the first
    failing exit code (0 when none failed) and a row per variant run, `summarize(name,
    records)`."""
    rows = []
    for name, argv in variants.items():
        print(f"== {name}: {steps} steps", flush=True)
        code, records = run_steps([*common, *argv, "--run.steps", str(steps), *passthrough])
        if code != 0:
            return code, rows
        rows.append(summarize(name, records))
    return 0, rows


class FixedScorer:
    """Reward 1 for every response: the sim has no text to check, and no policy may
    pick prompts by reward."""

    async def score(self, response: Response) -> Scored:
        return Scored(response, 1.0, True)

    async def aclose(self) -> None:
        return None


def mean_centred(rewards: Sequence[float]) -> list[float]:
    return [x - sum(rewards) / len(rewards) for x in rewards]


def measured(outcomes: Sequence[Any]) -> Sequence[Any]:
    """The steps a bench reports: past the first (it compiles and warms up) when there are more."""
    return outcomes[1:] if len(outcomes) > 1 else outcomes


def reward_step_medians(outcomes: Sequence[Any], suffix: str = "") -> dict[str, Any]:
    """The per-step medians the reward benches report (`bench.judge`, `bench.reward_overlap`),
    each key ending in `suffix`: the step, its rollout and generation, the reward's exposed
    and busy time, and the responses scored."""
    steps = measured(outcomes)

    def med(values: Any) -> float:
        return statistics.median(list(values))

    return {"measured_steps": len(steps), **{f"{k}{suffix}": v for k, v in {
        "step_s": med(o.time_step_s for o in steps),
        "rollout_s": med(o.time_rollout_s for o in steps),
        "generation_s": med(o.round.last_response_at - o.round.started_at for o in steps),
        "reward_exposed_s": med(o.round.reward_exposed_s for o in steps),
        "reward_busy_s": med(o.round.reward_busy_s for o in steps),
        "responses": med(sum(len(g.members) for g in o.round.groups) for o in steps),
    }.items()}}


async def sim_steps(
    steps: int, policy: Any, engine: Any, trainer: Any, record: Callable[[Any], dict[str, Any]],
    **options: Any,
) -> list[dict[str, Any]]:
    """Steps 1..`steps` of the real loop (`run_step`) on a simulated engine or fleet and
    its virtual clock, every response rewarded 1, advantages centred on the group's
    mean; `options` go to `run_step`. One `record(outcome)` per step. Closes the
    trainer and the engine."""
    from rpk.loop.step import run_step

    scorer = FixedScorer()
    records = []
    try:
        for step in range(1, steps + 1):
            o = await run_step(step, policy, engine, scorer, trainer, mean_centred,
                               version=trainer.version, clock=engine.clock, **options)
            records.append(record(o))
    finally:
        await trainer.aclose()
        await engine.shutdown()
    return records


@dataclass(frozen=True, slots=True)
class Col:
    """A column of a printed table: its header, the row's key, its width and the cell's
    format spec, a unit after the number. A cell whose value is None prints `-`. The spec
    `<` left-aligns header and cells; a left-aligned column after the first is set off
    by two spaces."""

    head: str
    key: str
    width: int
    spec: str = ""
    unit: str = ""


def _fit(text: str, col: Col, first: bool) -> str:
    if not col.spec.startswith("<"):
        return text.rjust(col.width)
    return text.ljust(col.width) if first else "  " + text.ljust(col.width)


def table_header(cols: Sequence[Col]) -> str:
    return "".join(_fit(c.head, c, i == 0) for i, c in enumerate(cols))


def table_line(row: Mapping[str, Any], cols: Sequence[Col]) -> str:
    cells = ("-" if row[c.key] is None else format(row[c.key], c.spec) + c.unit for c in cols)
    return "".join(_fit(text, c, i == 0) for i, (text, c) in enumerate(zip(cells, cols)))


def print_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[Col]) -> None:
    print(table_header(cols))
    for row in rows:
        print(table_line(row, cols))
