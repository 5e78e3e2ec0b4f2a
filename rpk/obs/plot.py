"""`python -m rpk.obs.plot RUN_DIR [--out DIR]`: PNGs of a run from its `metrics.jsonl` and
`timeline.jsonl` (default DIR: RUN_DIR/plots).

- `timeline.png`: requests in flight over each round, coloured by round kind, against
  the engine's concurrency limit; the shaded gap under the limit is the bubble. Each
  panel names the rollout TP of its round and the KV-cache preemptions it saw; with
  speculative decoding, the stretch where the round drafted (no more requests in
  flight than the largest batch its plan drafted at) is shaded purple under the curve.
- `bubble.png`, `reward.png`, `length.png`, `step_time.png`: per-step series.
- `val.png`: validation accuracy (greedy ± its standard error, mean@k, pass@k) against
  the steps trained, when the run validated.

Figures are built with `matplotlib.figure.Figure` and the Agg canvas, never pyplot, so
there is no global figure state and `write_plots` can run in a worker thread at the end
of a run. Keys missing from older runs skip their series (or plot) with a note.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from rpk.core.records import RoundKind

__all__ = ["PlotError", "Round", "RunData", "load_run", "write_plots", "main"]

KIND_COLORS = {RoundKind.SYNC: "#4c72b0", RoundKind.SHORT: "#55a868", RoundKind.LONG: "#c44e52"}
KIND_MARKERS = {RoundKind.SYNC: "o", RoundKind.SHORT: "s", RoundKind.LONG: "^"}
OTHER_COLOR = "#8c8c8c"
SPEC_COLOR = "#8172b2"  # where a round drafted (speculative decoding)
MAX_PANELS = 12
DPI = 110

Note = Callable[[str], None]


class PlotError(Exception):
    """The run directory cannot be plotted at all (missing, or nothing readable in it)."""


@dataclass(frozen=True, slots=True)
class Round:
    """One line of `timeline.jsonl`: in-flight count after each event, `t` seconds
    after the round started."""

    step: int
    kind: RoundKind | str
    t: tuple[float, ...]
    in_flight: tuple[int, ...]
    capacity: int | None
    slots: int | None = None  # min(capacity, requests launched): the bubble's reference
    tp: int | None = None  # the rollout TP the round ran at
    preemptions: int | None = None  # KV-cache preemptions, summed over the replicas
    spec_batch: int | None = None  # speculative decoding drafted at this many in flight or fewer


@dataclass(frozen=True, slots=True)
class RunData:
    records: tuple[dict[str, Any], ...]
    rounds: tuple[Round, ...]
    capacity: int | None  # from config.yaml, for rounds whose line does not carry one
    evals: tuple[dict[str, Any], ...] = ()  # validation records (phase "eval"), by step


def _kind(value: Any) -> RoundKind | str:
    """A record's round kind; runs written by other versions may hold other words."""
    try:
        return RoundKind(value)
    except ValueError:
        return str(value or "unknown")


def _color(kind: str) -> str:
    return KIND_COLORS.get(kind, OTHER_COLOR)


def _marker(kind: str) -> str:
    return KIND_MARKERS.get(kind, "D")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_jsonl(path: Path, note: Note) -> list[dict[str, Any]]:
    """Valid JSON objects of a jsonl file; a bad line (a crash mid-write) is counted and
    skipped rather than losing the whole file."""
    rows: list[dict[str, Any]] = []
    bad = 0
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise PlotError(f"{path}: cannot read it ({e.strerror or e})") from e
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if bad:
        note(f"{path.name}: skipped {bad} malformed line(s)")
    return rows


def _config_capacity(run_dir: Path, note: Note) -> int | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        value = yaml.safe_load(path.read_text())["rollout"]["max_num_seqs"]
        return int(value) if int(value) > 0 else None
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        note(f"config.yaml: no usable rollout.max_num_seqs ({type(e).__name__}: {e})")
        return None


def _parse_round(row: dict[str, Any]) -> Round:
    t = tuple(float(x) for x in row["t"])
    n = tuple(int(x) for x in row["in_flight"])
    if len(t) != len(n):
        raise ValueError(f"{len(t)} times but {len(n)} in-flight counts")
    cap, slots = row.get("capacity"), row.get("slots")
    tp, pre, spec = row.get("tp"), row.get("preemptions"), row.get("spec_batch")
    return Round(int(row["step"]), _kind(row.get("round_kind")), t, n,
                 int(cap) if cap else None, int(slots) if slots else None,
                 int(tp) if tp is not None else None, int(pre) if pre is not None else None,
                 int(spec) if spec else None)


def load_run(run_dir: Path, note: Note) -> RunData:
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir}: no such run directory")
    # Notes are held back until the run proves plottable, so a failure stays one line.
    notes: list[str] = []
    metrics, timeline = run_dir / "metrics.jsonl", run_dir / "timeline.jsonl"
    records = []
    rows = _read_jsonl(metrics, notes.append) if metrics.is_file() else []
    evals = tuple(r for r in rows if r.get("phase") == "eval" and _is_number(r.get("step")))
    rows = [r for r in rows if r.get("phase", "train") != "eval"]
    for i, rec in enumerate(rows):
        step = rec.setdefault("step", i + 1)
        if _is_number(step):
            kind = _kind(rec.get("round_kind"))
            records.append({**rec, "step": int(step), "round_kind": kind})
    if len(records) < len(rows):
        notes.append(f"metrics.jsonl: skipped {len(rows) - len(records)} record(s) "
                     "with a non-numeric step")
    rounds: list[Round] = []
    if timeline.is_file():
        bad = 0
        for row in _read_jsonl(timeline, notes.append):
            try:
                rounds.append(_parse_round(row))
            except (KeyError, TypeError, ValueError):
                bad += 1
        if bad:
            notes.append(f"timeline.jsonl: skipped {bad} round(s) without usable step/t/in_flight")
    elif records:
        notes.append("no timeline.jsonl (an older run): skipping timeline.png")
    if not records and not rounds:
        detail = f" ({'; '.join(notes)})" if notes else ""
        raise PlotError(f"{run_dir}: no step records in metrics.jsonl or timeline.jsonl{detail}")
    capacity = _config_capacity(run_dir, notes.append)
    for msg in notes:
        note(msg)
    return RunData(tuple(records), tuple(rounds), capacity, evals)


def _series(
    records: Sequence[dict[str, Any]], key: str
) -> tuple[list[int], list[float], list[str]]:
    """(steps, values, kinds) of the records that carry a numeric `key`."""
    steps, values, kinds = [], [], []
    for r in records:
        v = r.get(key)
        if _is_number(v):
            steps.append(r["step"])
            values.append(float(v))
            kinds.append(r["round_kind"])
    return steps, values, kinds


def _ordered_kinds(kinds: Sequence[str]) -> list[str]:
    known = list(KIND_COLORS)
    return sorted(set(kinds), key=lambda k: (known.index(k) if k in known else len(known), k))


def _kind_legend(kinds: Sequence[str], counts: bool = True, marker: bool = False) -> list[Line2D]:
    return [
        Line2D([], [], color=_color(kind), marker=_marker(kind) if marker else None,
               linestyle="" if marker else "-",
               label=f"{kind} ({kinds.count(kind)})" if counts else kind)
        for kind in _ordered_kinds(kinds)
    ]


def _scatter_by_kind(ax: Any, steps: Sequence[int], values: Sequence[float],
                     kinds: Sequence[str], size: float = 28) -> None:
    # Smaller markers on long runs, or a hundred steps become a solid band.
    size *= max(0.35, min(1.0, 40 / max(1, len(steps))))
    for kind in set(kinds):
        xs = [s for s, k in zip(steps, kinds) if k == kind]
        ys = [v for v, k in zip(values, kinds) if k == kind]
        # A triangle of the same area looks smaller than a square or a circle.
        area = size * (1.5 if _marker(kind) == "^" else 1.0)
        ax.scatter(xs, ys, s=area, color=_color(kind), marker=_marker(kind), zorder=3,
                   edgecolors="white", linewidths=0.5)


def _new_figure(w: float, h: float, layout: str | None = "constrained") -> Figure:
    fig = Figure(figsize=(w, h), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    return path


def _step_axis(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _pick_rounds(rounds: Sequence[Round], k: int) -> list[Round]:
    """Up to k rounds spread evenly over the run, with at least one of each kind so a
    rare long round is not skipped by the even spacing."""
    if len(rounds) <= k:
        return list(rounds)
    idx = {round(i * (len(rounds) - 1) / (k - 1)) for i in range(k)}
    for kind in {r.kind for r in rounds}:
        if any(rounds[i].kind == kind for i in idx):
            continue
        first = next(i for i, r in enumerate(rounds) if r.kind == kind)
        # Give up the pick nearest the missing kind's round whose kind is not the last one left.
        kinds_left = [rounds[i].kind for i in idx]
        swappable = [i for i in idx if kinds_left.count(rounds[i].kind) > 1]
        if swappable:
            idx.remove(min(swappable, key=lambda i: abs(i - first)))
        idx.add(first)
    return [rounds[i] for i in sorted(idx)]


def _curve(r: Round) -> tuple[list[float], list[int]]:
    """Step-function points starting from (0, 0) at the round's start."""
    return [0.0, *r.t], [0, *r.in_flight]


def _step_path(r: Round) -> np.ndarray:
    """The in-flight curve as explicit step-post vertices, for a LineCollection (one
    artist per kind draws far faster than one `step` per round)."""
    xs, ys = _curve(r)
    x = np.repeat(np.asarray(xs, dtype=float), 2)[1:]
    y = np.repeat(np.asarray(ys, dtype=float), 2)[:-1]
    return np.column_stack([x, y])


def _overlay(ax: Any, rounds: Sequence[Round], cap: int | None) -> None:
    per_kind = Counter(r.kind for r in rounds)
    # Long rounds drawn last: they are rarer and would vanish under the short ones.
    for kind in sorted(per_kind, key=lambda k: (k == RoundKind.LONG, k)):
        paths = [_step_path(r) for r in rounds if r.kind == kind]
        # Fainter the more rounds of a kind overlap, so each kind reads as a band.
        alpha = max(0.12, min(0.9, 4 / per_kind[kind]))
        ax.add_collection(LineCollection(paths, colors=_color(kind), alpha=alpha, linewidths=1.2))
    ax.autoscale_view()
    handles = _kind_legend([r.kind for r in rounds])
    if cap:
        ax.axhline(cap, color="black", linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color="black", linestyle="--", label=f"engine limit ({cap})"))
    ax.legend(handles=handles, title="round kind (rounds)", loc="upper right", fontsize=9)
    ax.set_title(f"Requests in flight over each round, all {len(rounds)} rounds overlaid; "
                 "the gap under the dashed limit is idle decode slots (the bubble)",
                 fontsize=11, y=1.0, pad=6)
    if cap:
        # At the right end: that is where the rounds have drained and the text is clear.
        for text, dy, va in (("above: queued in the engine", 3, "bottom"),
                             ("below: idle decode slots", -3, "top")):
            ax.annotate(text, (0.995, cap), xycoords=("axes fraction", "data"), xytext=(0, dy),
                        textcoords="offset points", fontsize=8, color="#444444",
                        ha="right", va=va)
    ax.set_xlabel("seconds since round start")
    ax.set_ylabel("requests in flight")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)


def _panel(ax: Any, r: Round, cap: int | None, bubble: float | None) -> None:
    xs, ys = _curve(r)
    ax.step(xs, ys, where="post", color=_color(r.kind), linewidth=1.3)
    if cap:
        ax.axhline(cap, color="black", linestyle="--", linewidth=0.9)
        # A round launching fewer requests than the engine's limit can only fill that
        # many slots: the bubble (and its shading) is measured against those.
        top = min(cap, r.slots) if r.slots else cap
        ax.fill_between(xs, [min(y, top) for y in ys], top, step="post",
                        color=_color(r.kind), alpha=0.25, linewidth=0)
    if r.spec_batch:
        ax.fill_between(xs, 0, ys, where=[0 < y <= r.spec_batch for y in ys], step="post",
                        color=SPEC_COLOR, alpha=0.45, linewidth=0)
    label = f"step {r.step} · {r.kind}"
    if r.spec_batch:
        label += f" · spec ≤{r.spec_batch}"
    if r.tp is not None:
        label += f" · tp {r.tp}"
    if bubble is not None:
        label += f" · bubble {bubble:.2f}"
    if r.preemptions:
        label += f" · {r.preemptions} preempted"
    # An explicit y skips matplotlib's title auto-placement, which measures every tick
    # label of the axes: a third of the figure's time over a dozen panels.
    ax.set_title(label, fontsize=9, color=_color(r.kind), y=1.0, pad=4)
    ax.tick_params(labelsize=8)
    ax.locator_params(nbins=4)
    ax.grid(True, alpha=0.3)


def plot_timeline(data: RunData, path: Path) -> Path:
    """The overlay of all rounds on top, small multiples of up to MAX_PANELS rounds
    below with the bubble shaded. Fixed margins rather than constrained layout: the
    layout solver over a dozen axes took most of the time."""
    rounds = data.rounds
    steps, ratios, _ = _series(data.records, "bubble_ratio")
    bubble = dict(zip(steps, ratios))
    caps = {r.capacity or data.capacity for r in rounds} - {None}
    picks = _pick_rounds(rounds, MAX_PANELS)
    ncols = min(4, len(picks))
    nrows = math.ceil(len(picks) / ncols)
    # Rows in inches: margin 0.4, overlay 3.65, gap 0.9 (its x label, the panel titles),
    # 2 per row of panels, margin 0.55; the ratios equal the inches, whatever nrows is.
    height = 5.5 + 2.0 * nrows
    fig = _new_figure(14, height, layout=None)
    outer = fig.add_gridspec(3, 1, height_ratios=[3.65, 0.9, 2.0 * nrows], hspace=0,
                             left=0.06, right=0.99, top=1 - 0.4 / height, bottom=0.55 / height)
    _overlay(fig.add_subplot(outer[0]), rounds, max(caps) if caps else None)
    grid = outer[2].subgridspec(nrows, ncols, hspace=0.45, wspace=0.06)
    first = None
    for i, r in enumerate(picks):
        ax = fig.add_subplot(grid[i // ncols, i % ncols], sharex=first, sharey=first)
        first = first or ax
        _panel(ax, r, r.capacity or data.capacity, bubble.get(r.step))
        if i % ncols == 0:
            ax.set_ylabel("in flight", fontsize=8)
        if i + ncols >= len(picks):
            ax.set_xlabel("s since round start", fontsize=8)
        else:
            ax.tick_params(labelbottom=False)
        if i % ncols:
            ax.tick_params(labelleft=False)
    assert first is not None, "a timeline has at least one round"
    first.set_ylim(bottom=0)
    first.set_xlim(left=0)
    return _save(fig, path)


def plot_bubble(data: RunData, path: Path, note: Note) -> Path | None:
    steps, values, kinds = _series(data.records, "bubble_ratio")
    if not steps:
        note(f"no 'bubble_ratio' in metrics.jsonl: skipping {path.name}")
        return None
    fig = _new_figure(10, 4.5)
    ax = fig.add_subplot()
    ax.plot(steps, values, color=OTHER_COLOR, linewidth=0.8, alpha=0.6, zorder=1)
    _scatter_by_kind(ax, steps, values, kinds, size=40)
    handles = _kind_legend(kinds, marker=True)
    for kind, h in zip(_ordered_kinds(kinds), handles):
        med = statistics.median(v for v, k in zip(values, kinds) if k == kind)
        ax.axhline(med, color=_color(kind), linestyle=":", linewidth=1.2)
        h.set_label(f"{h.get_label()}, median {med:.2f}")
    ax.legend(handles=handles, title="round kind (steps)", fontsize=9, loc="upper left",
              bbox_to_anchor=(1.01, 1))
    ax.set_ylim(bottom=0, top=max(1e-3, max(values)) * 1.15)
    _step_axis(ax, "Bubble ratio per step (share of decode slots idle; dotted = median per kind)",
               "bubble ratio")
    return _save(fig, path)


def _lines_plot(data: RunData, path: Path, title: str, ylabel: str,
                series: Sequence[tuple[str, str, str]], note: Note, smooth: int = 0) -> Path | None:
    """Lines for each (key, label, style) over steps; round kind as marker colour on the
    first series present, plus its trailing `smooth`-step mean when the run is long
    enough for one to help. Series whose key no record carries are noted and skipped."""
    fig = _new_figure(10, 4.5)
    ax = fig.add_subplot()
    drawn: dict[str, tuple[list[int], list[float]]] = {}
    kind_handles: list[Line2D] = []
    missing = []
    for key, label, style in series:
        steps, values, kinds = _series(data.records, key)
        if not steps:
            missing.append(f"'{key}'")
            continue
        # A binary reward makes accuracy equal reward; say so, or one line seems missing.
        twin = next((lbl for lbl, xy in drawn.items() if xy == (steps, values)), None)
        ax.plot(steps, values, style, label=f"{label} (= {twin})" if twin else label,
                linewidth=1.4, zorder=2)
        if not drawn:
            _scatter_by_kind(ax, steps, values, kinds, size=36)
            kind_handles = _kind_legend(kinds, counts=False, marker=True)
            if smooth and len(values) >= 2 * smooth:
                mean = np.convolve(values, np.ones(smooth) / smooth, mode="valid")
                ax.plot(steps[smooth - 1:], mean, color="black", alpha=0.45, linewidth=2.5,
                        label=f"{label}, mean of last {smooth} steps", zorder=1)
        drawn[label] = (steps, values)
    if not drawn:
        note(f"no {', '.join(missing)} in metrics.jsonl: skipping {path.name}")
        return None
    if missing:
        note(f"{path.name}: no {', '.join(missing)} in metrics.jsonl, not drawn")
    series_legend = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    ax.add_artist(series_legend)
    ax.legend(handles=kind_handles, title="round kind", loc="lower left",
              bbox_to_anchor=(1.01, 0), fontsize=9)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    _step_axis(ax, title, ylabel)
    return _save(fig, path)


def _bars(ax: Any, x: Sequence[float], bottom: Sequence[float], height: Sequence[float],
          width: float, colors: Sequence[str]) -> None:
    """Bars as one PolyCollection: `ax.bar` makes a patch per bar, several times slower
    over a few hundred bars."""
    x0 = np.asarray(x, dtype=float) - width / 2
    y0 = np.asarray(bottom, dtype=float)
    y1 = y0 + np.asarray(height, dtype=float)
    verts = np.stack([np.column_stack(c) for c in
                      ((x0, y0), (x0 + width, y0), (x0 + width, y1), (x0, y1))], axis=1)
    ax.add_collection(PolyCollection(verts, facecolors=colors, linewidths=0))


def plot_step_time(data: RunData, path: Path, note: Note) -> Path | None:
    """Stacked bars: rollout (coloured by round kind, since the kind drives it), train,
    weight sync, and the rest of the step (reward tail, bookkeeping)."""
    recs = [r for r in data.records if _is_number(r.get("time_rollout_s"))]
    if not recs:
        note(f"no 'time_rollout_s' in metrics.jsonl: skipping {path.name}")
        return None
    missing = [k for k in ("time_train_s", "time_sync_s", "time_step_s")
               if not any(_is_number(r.get(k)) for r in recs)]
    if missing:
        note(f"{path.name}: no {', '.join(map(repr, missing))} in metrics.jsonl, not drawn")

    def col(key: str) -> list[float]:
        return [float(r[key]) if _is_number(r.get(key)) else 0.0 for r in recs]

    steps = [r["step"] for r in recs]
    rollout, train, sync = col("time_rollout_s"), col("time_train_s"), col("time_sync_s")
    other = [max(0.0, t - a - b - c)
             for t, a, b, c in zip(col("time_step_s"), rollout, train, sync)]
    kinds = [r["round_kind"] for r in recs]
    fig = _new_figure(10, 4.8)
    ax = fig.add_subplot()
    width = 0.8 if len(steps) < 2 else 0.8 * min(b - a for a, b in zip(steps, steps[1:]) if b > a)
    _bars(ax, steps, [0.0] * len(steps), rollout, width, [_color(k) for k in kinds])
    bottom = rollout
    handles: list[Any] = [Patch(color=_color(k), label=f"rollout, {k} round")
                          for k in _ordered_kinds(kinds)]
    for values, color, label in ((train, "#dd8452", "train"), (sync, "#333333", "weight sync"),
                                 (other, "#cccccc", "other (reward tail, bookkeeping)")):
        # Sub-1% slivers (sync on a tiny model, clock jitter in "other") only add clutter.
        if max(values) > 0.01 * max(rollout):
            _bars(ax, steps, bottom, values, width, [color] * len(steps))
            handles.append(Patch(color=color, label=label))
            bottom = [a + b for a, b in zip(bottom, values)]
    ax.autoscale_view()
    ax.set_ylim(bottom=0)
    ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    _step_axis(ax, "Time per step", "seconds")
    return _save(fig, path)


def plot_validation(data: RunData, path: Path) -> Path | None:
    """Validation accuracy over the steps trained: greedy with a band of ± one standard
    error over the validation prompts, mean@k likewise, pass@k as a line."""
    evals = [e for e in data.evals if _is_number(e.get("val/acc_greedy"))]
    if not evals:
        return None
    fig = _new_figure(10, 4.5)
    ax = fig.add_subplot()
    steps = [int(e["step"]) for e in evals]
    keys = ["acc_greedy"] + sorted(
        k[4:] for k in evals[0] if k.startswith(("val/mean@", "val/pass@")) and not k.endswith("_se")
    )
    for key, color in zip(keys, ("#4c72b0", "#55a868", "#c44e52")):
        values = [float(e.get(f"val/{key}", math.nan)) for e in evals]
        ax.plot(steps, values, "-o", color=color, markersize=4, linewidth=1.4,
                label="greedy (pass@1)" if key == "acc_greedy" else key)
        if f"val/{key}_se" in evals[0]:
            se = np.asarray([float(e.get(f"val/{key}_se", 0.0)) for e in evals])
            ax.fill_between(steps, np.asarray(values) - se, np.asarray(values) + se,
                            color=color, alpha=0.15, linewidth=0)
    n = int(evals[-1].get("val/prompts", 0))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9,
              title=f"{n} prompts; band = ±1 s.e.")
    ax.set_ylim(bottom=0)
    _step_axis(ax, "Validation accuracy over training", "accuracy")
    ax.set_xlabel("steps trained")
    return _save(fig, path)


def write_plots(run_dir: Path, out_dir: Path | None = None, *,
                note: Note | None = None) -> list[Path]:
    """Write the PNGs of `run_dir` into `out_dir` (default run_dir/plots) and return
    their paths. Raises PlotError when the directory has nothing to plot; each plot
    whose data is missing is skipped and reported through `note` (default: stderr)."""
    say: Note = note or (lambda msg: print(f"rpk.plot: {msg}", file=sys.stderr))
    run_dir = Path(run_dir)
    data = load_run(run_dir, say)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path | None] = []
    if data.rounds:
        written.append(plot_timeline(data, out / "timeline.png"))
    if data.records:
        written += [
            plot_bubble(data, out / "bubble.png", say),
            _lines_plot(data, out / "reward.png", "Reward over steps", "mean over responses", [
                ("reward_mean", "reward mean", "-"), ("accuracy", "accuracy", "--")],
                say, smooth=5),
            _lines_plot(data, out / "length.png", "Response length over steps", "tokens", [
                ("response_len_mean", "mean", "-"), ("response_len_p90", "p90", "--"),
                ("response_len_max", "max", ":")], say),
            plot_step_time(data, out / "step_time.png", say),
        ]
    else:
        say("no step records in metrics.jsonl: only timeline.png")
    written.append(plot_validation(data, out / "val.png"))
    return [p for p in written if p is not None]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rpk.obs.plot", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a run directory, e.g. runs/latest")
    parser.add_argument(
        "--out", type=Path, default=None, help="where the PNGs go (default RUN_DIR/plots)"
    )
    args = parser.parse_args(argv)
    try:
        paths = write_plots(args.run_dir, args.out)
    except PlotError as e:
        print(f"rpk.plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
