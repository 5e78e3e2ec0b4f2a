"""`rpk.plot` draws valid PNGs from a run directory, skips what older runs lack and
turns an unusable directory into one line and exit code 2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from matplotlib.image import imread

from rpk.obs import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = {"timeline.png", "bubble.png", "reward.png", "length.png", "step_time.png"}


def _kind(step: int) -> str:
    return "sync" if step <= 2 else ("long" if step % 5 == 0 else "short")


def _timeline(step: int, launched: int, rng: random.Random) -> dict:
    """Requests start in a burst, then finish one by one with a long tail; a short
    round aborts the stragglers at once."""
    t = [round(0.001 * i, 4) for i in range(1, launched + 1)]
    n = list(range(1, launched + 1))
    now = t[-1]
    stop = launched // 3 if _kind(step) == "short" else 0
    for left in range(launched - 1, stop - 1, -1):
        now += rng.expovariate(40 if left > 10 else 4)
        t.append(round(now, 4))
        n.append(left)
    if stop:
        t.append(round(now + 0.01, 4))
        n.append(0)
    return {"step": step, "round_kind": _kind(step), "t": t, "in_flight": n}


def make_run(root: Path, steps: int = 8, timeline: bool = True, seed: int = 0) -> Path:
    rng = random.Random(seed)
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text("rollout:\n  policy: tail\n  max_num_seqs: 16\n")
    metrics, lines = [], []
    for step in range(1, steps + 1):
        reward = min(1.0, 0.2 + 0.02 * step + rng.uniform(-0.05, 0.05))
        metrics.append({
            "step": step, "round_kind": _kind(step), "reward_mean": reward, "accuracy": reward,
            "response_len_mean": rng.uniform(30, 40), "response_len_p50": 28.0,
            "response_len_p90": rng.uniform(60, 90), "response_len_max": rng.randint(100, 300),
            "bubble_ratio": rng.uniform(0.0, 0.4), "time_rollout_s": rng.uniform(3, 7),
            "time_train_s": rng.uniform(2, 3), "time_sync_s": 0.05, "time_step_s": 10.0,
            "tokens_wasted": rng.randint(0, 9000), "queue_size": float(step % 5),
        })
        lines.append(_timeline(step, 40 if _kind(step) == "short" else 24, rng))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if timeline:
        (run / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, (path, len(data))
    h, w = imread(path).shape[:2]
    assert w >= 800 and h >= 400, (path, w, h)


def test_write_plots_full_run(tmp_path):
    run = make_run(tmp_path)
    notes: list[str] = []
    paths = plot.write_plots(run, note=notes.append)
    assert {p.name for p in paths} == ALL
    assert all(p.parent == run / "plots" for p in paths)
    for p in paths:
        assert_png(p)
    assert notes == []


def test_timeline_picks_every_kind_and_spreads_out(tmp_path):
    rounds = plot.load_run(make_run(tmp_path, steps=40), note=lambda _: None).rounds
    picks = plot._pick_rounds(rounds, 12)
    assert len(picks) == 12
    assert {r.kind for r in picks} == {"sync", "short", "long"}
    assert picks[0].step == 1 and picks[-1].step == 40
    # A lone rare kind must survive the even spacing.
    only_one_sync = [r for r in rounds if r.step != 1]
    assert "sync" in {r.kind for r in plot._pick_rounds(only_one_sync, 12)}


def test_cli_writes_to_out_and_prints_paths(tmp_path, capsys):
    """`python -m rpk.obs.plot RUN --out DIR`, through its `main` (test_readme.py runs the
    module as a process)."""
    run = make_run(tmp_path)
    out = tmp_path / "pngs"
    assert plot.main([str(run), "--out", str(out)]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.split()]
    assert {p.name for p in printed} == ALL
    assert all(p.parent == out and p.is_file() for p in printed)
    assert not (run / "plots").exists()


def test_older_run_without_timeline_or_some_keys(tmp_path, capsys):
    run = make_run(tmp_path, timeline=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        del r["round_kind"], r["bubble_ratio"], r["response_len_p90"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot.main([str(run)]) == 0
    out, err = capsys.readouterr()
    assert {Path(p).name for p in out.split()} == {"reward.png", "length.png", "step_time.png"}
    assert "no timeline.jsonl" in err
    assert "skipping bubble.png" in err
    assert "no 'response_len_p90'" in err
    for name in ("reward.png", "length.png", "step_time.png"):
        assert_png(run / "plots" / name)


def test_malformed_lines_are_counted_and_skipped(tmp_path):
    run = make_run(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "reward_me\n[1, 2]\n{"step": "nine", "reward_mean": 0.5}\n')
        f.write('{"step": 10, "round_kind": "long", "bubble_ratio": null, "time_train_s": "?",'
                ' "time_rollout_s": 1.0, "reward_mean": NaN}\n')
    with (run / "timeline.jsonl").open("a") as f:
        f.write('{"step": 9, "t": [0.1, 0.2], "in_flight": [1]}\n')
    notes: list[str] = []
    paths = plot.write_plots(run, note=notes.append)
    assert {p.name for p in paths} == ALL
    assert notes == [
        "metrics.jsonl: skipped 2 malformed line(s)",
        "metrics.jsonl: skipped 1 record(s) with a non-numeric step",
        "timeline.jsonl: skipped 1 round(s) without usable step/t/in_flight",
    ]


@pytest.mark.parametrize("setup", ["missing", "empty", "garbage"])
def test_unusable_dir_is_one_line_exit_2(tmp_path, capsys, setup):
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "garbage":
        (run / "metrics.jsonl").write_text("not json\n")
    assert plot.main([str(run)]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    expected = "no such run directory" if setup == "missing" else "no step records"
    assert len(lines) == 1 and lines[0].startswith(f"rpk.plot: {run}") and expected in lines[0]
    if setup == "garbage":
        assert "skipped 1 malformed line(s)" in lines[0]
    assert out == ""
    assert not (run / "plots").exists()


def test_a_round_that_speculated_is_shaded_where_it_drafted(tmp_path):
    run = make_run(tmp_path)
    lines = [json.loads(x) for x in (run / "timeline.jsonl").read_text().splitlines()]
    lines[-1]["spec_batch"] = 8
    (run / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = plot.load_run(run, note=lambda _: None)
    assert data.rounds[-1].spec_batch == 8 and data.rounds[0].spec_batch is None
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    plot._panel(ax, data.rounds[-1], 16, None)
    assert "spec ≤8" in ax.get_title()
    shaded = [c for c in ax.collections if isinstance(c, PolyCollection)
              and tuple(c.get_facecolor()[0][:3]) == tuple(int(plot.SPEC_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5))]
    assert shaded, "the drafting stretch is shaded"
    assert_png(plot.plot_timeline(data, tmp_path / "timeline.png"))
