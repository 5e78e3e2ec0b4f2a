"""`python -m rpk.run` turns the user's mistakes into one clear line and exit code 2,
before any engine starts, and a failed start leaves no run directory behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rpk import checkpoint, config, controller, manifest
from rpk.assembly import settings
from rpk.run import _stopped_message

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rpk.run", "--run.out_dir", str(tmp_path / "runs"),
         "--run.progress", "false", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )


def one_clean_line(proc: subprocess.CompletedProcess[str], expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("rpk:")]) == 1


def fake_checkpoint(run_dir: Path, step: int, **overrides: object) -> Path:
    """A run directory with one checkpoint's state file, made by the default config
    changed by `overrides` (dotted names)."""
    made_with = config.from_argv([x for k, v in overrides.items() for x in (f"--{k}", str(v))])
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    state = {"step": step, "policy": {}, "fingerprint": settings.fingerprint(made_with)}
    (ckpt / checkpoint.STATE_FILE).write_text(json.dumps(state))
    manifest.seal(ckpt, step, 0, manifest.config_hash(state["fingerprint"]))
    return ckpt


def test_missing_model_dir_leaves_no_run_directory(tmp_path):
    proc = run(tmp_path, "--model.path", str(tmp_path / "nope"))
    one_clean_line(proc, f"model.path={str(tmp_path / 'nope')!r}: no HF model (config.json) there")
    assert not (tmp_path / "runs").exists()


def test_resume_without_checkpoint_moves_nothing(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "old").mkdir()
    (tmp_path / "runs" / "latest").symlink_to("old")
    proc = run(tmp_path, "--run.resume", str(tmp_path / "runs" / "latest"))
    one_clean_line(proc, "no complete checkpoint in")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "old"]
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / "runs" / "old")


def test_a_half_written_checkpoint_is_refused_by_name(tmp_path):
    partial = tmp_path / "run" / "checkpoints" / ".tmp-step_000004"
    partial.mkdir(parents=True)
    proc = run(tmp_path, "--run.resume", str(partial))
    one_clean_line(proc, "write never finished")


def test_a_half_written_checkpoint_is_never_picked(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 2)
    (ckpt.parent / ".tmp-step_000003").mkdir()
    (ckpt.parent / ".tmp-step_000003" / checkpoint.STATE_FILE).write_text("{}")
    assert checkpoint.resume_point(tmp_path / "run").checkpoint == ckpt
    assert checkpoint.clean_partial(tmp_path / "run") == [ckpt.parent / ".tmp-step_000003"]
    assert [p.name for p in ckpt.parent.iterdir()] == [ckpt.name]



def test_the_stop_line_names_the_checkpoint_on_disk_even_before_the_status_hears(tmp_path):
    status = controller.RunStatus(run_dir=tmp_path / "run", step=2)
    assert "no checkpoint yet" in _stopped_message("node 1 failed", status)
    fake_checkpoint(tmp_path / "run", 1)
    line = _stopped_message("node 1 failed", status, anywhere=True)
    assert line.endswith(f"`--run.resume {tmp_path / 'run'}` continues from step_000001, "
                         "on this many nodes or another"), line

@pytest.mark.parametrize(
    "made_with, now, message",
    [
        ({"rollout.policy": "sync"}, [], "made with rollout.policy='sync', this run has rollout.policy='tail'"),
        ({}, ["--rollout.prompts_per_step", "16"], "rollout.prompts_per_step=32, this run has rollout.prompts_per_step=16"),
        ({"data.builtin_size": 100}, [], "made with data.train_files='built-in task, 100 prompts'"),
        ({"model.tiny.hidden_size": 64, "model.tiny.num_heads": 2}, [], "made with model='tiny-"),
    ],
)
def test_an_incompatible_checkpoint_is_refused_before_anything_starts(tmp_path, made_with, now, message):
    fake_checkpoint(tmp_path / "run", 2, **made_with)
    proc = run(tmp_path, "--run.resume", str(tmp_path / "run"), *now)
    one_clean_line(proc, message)
    assert "cannot resume from" in proc.stderr


def test_a_damaged_checkpoint_named_to_resume_stops_the_run_naming_the_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 2)
    size = (ckpt / checkpoint.STATE_FILE).stat().st_size
    with open(ckpt / checkpoint.STATE_FILE, "a") as f:
        f.write(" ")
    proc = run(tmp_path, "--run.resume", str(ckpt))
    one_clean_line(proc, f"checkpoint step_000002 fails its check: rpk_state.json is {size + 1:,} "
                         f"bytes, its manifest says {size:,}")


def test_resume_past_the_last_step(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 5)
    proc = run(tmp_path, "--run.resume", str(ckpt), "--run.steps", "5")
    one_clean_line(proc, "is already at step 5; raise run.steps to continue")


def test_range_errors_name_the_full_field(tmp_path):
    proc = run(tmp_path, "--train.lr", "-1")
    assert proc.returncode == 2 and "train.lr must be > 0, got -1.0" in proc.stderr


def test_keep_checkpoints_prunes_all_but_the_newest_and_the_marked(tmp_path):
    ckpts = [fake_checkpoint(tmp_path / "run", s) for s in (1, 2, 3, 4)]
    (ckpts[0] / checkpoint.KEEP_MARK).touch()
    removed = checkpoint.prune(tmp_path / "run" / "checkpoints", keep=2)
    assert removed == ckpts[1:2]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000001", "step_000003", "step_000004"
    ]
