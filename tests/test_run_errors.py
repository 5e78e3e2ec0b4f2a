"""`python -m rpk.run` turns the user's mistakes into one clear line and exit code 2,
before any engine starts, and a failed start leaves no run directory behind; an
interrupt stops the run with 128 + the signal's number, naming what a resume starts from.

`rpk.run.main` runs in this process (it returns the exit code and prints the line to
stderr); one case (slow tier) runs `python -m rpk.run` for real, for the `__main__` entry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rpk import assembly, checkpoint, config, controller, manifest
from rpk import run as rpk_run
from rpk.assembly import settings
from rpk.gpu import layout
from rpk.run import _stopped_message

ROOT = Path(__file__).resolve().parents[1]
# torchelastic's error recording (`rpk.gpu.launch.record`) wants a real stderr for its
# fault handler; under capsys it has none, and says so.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")


@dataclass(frozen=True, slots=True)
class Ran:
    returncode: int
    stderr: str


@pytest.fixture
def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`python -m rpk.run --run.out_dir ... ARGS`, in this process: its exit code and stderr."""
    # The run quiets vLLM's logs in its environment (setdefault): keep that to this test.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))

    def call(*args: str) -> Ran:
        code = rpk_run.main(["--run.out_dir", str(tmp_path / "runs"), "--run.progress", "false", *args])
        return Ran(code, capsys.readouterr().err)

    return call


def one_clean_line(proc: Ran | subprocess.CompletedProcess[str], expected: str) -> None:
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


def test_missing_model_dir_leaves_no_run_directory(tmp_path, run):
    proc = run("--model.path", str(tmp_path / "nope"))
    one_clean_line(proc, f"model.path={str(tmp_path / 'nope')!r}: no HF model (config.json) there")
    assert not (tmp_path / "runs").exists()


def test_resume_without_checkpoint_moves_nothing(tmp_path, run):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "old").mkdir()
    (tmp_path / "runs" / "latest").symlink_to("old")
    proc = run("--run.resume", str(tmp_path / "runs" / "latest"))
    one_clean_line(proc, "no complete checkpoint in")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest", "old"]
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / "runs" / "old")


def test_a_half_written_checkpoint_is_refused_by_name(tmp_path, run):
    partial = tmp_path / "run" / "checkpoints" / ".tmp-step_000004"
    partial.mkdir(parents=True)
    proc = run("--run.resume", str(partial))
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

def test_sigint_abandons_the_step_and_names_the_checkpoint_a_resume_starts_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C, in process: the signal reaches rpk.run's handler (`_interruptible`), the
    run's task is cancelled (its cleanup runs) and the run exits 130 with one line naming
    what `--run.resume` continues from. A real run's process group under Ctrl-C is
    test_agent_signal.py's; SIGTERM to a real run, test_run_lifecycle.py's."""
    run_dir = tmp_path / "run"
    cleaned: list[bool] = []

    async def a_step_in_progress(cfg, placement, settings_, progress, status, joined=None):
        status.run_dir, status.step = run_dir, 2
        fake_checkpoint(run_dir, 1)
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    monkeypatch.setattr(rpk_run, "_run", a_step_in_progress)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
    cfg = config.from_argv(["--run.progress", "false"])
    code = rpk_run._controller(cfg, assembly.place(cfg.rollout, layout.from_env({})))
    err = capsys.readouterr().err
    assert code == 130 and cleaned == [True], err
    assert "rpk: SIGINT: stopping (abandoning the step in progress" in err
    assert (f"rpk: interrupted by SIGINT during step 2; `--run.resume {run_dir}` continues from "
            "step_000001") in err


@pytest.mark.parametrize(
    "made_with, now, message",
    [
        ({"rollout.policy": "sync"}, [], "made with rollout.policy='sync', this run has rollout.policy='tail'"),
        ({}, ["--rollout.prompts_per_step", "16"],
         "rollout.prompts_per_step=32, this run has rollout.prompts_per_step=16"),
        ({"data.builtin_size": 100}, [], "made with data.train_files='built-in task, 100 prompts'"),
        ({"model.tiny.hidden_size": 64, "model.tiny.num_heads": 2}, [], "made with model='tiny-"),
    ],
)
def test_an_incompatible_checkpoint_is_refused_before_anything_starts(tmp_path, run, made_with, now, message):
    fake_checkpoint(tmp_path / "run", 2, **made_with)
    proc = run("--run.resume", str(tmp_path / "run"), *now)
    one_clean_line(proc, message)
    assert "cannot resume from" in proc.stderr


def test_a_damaged_checkpoint_named_to_resume_stops_the_run_naming_the_file(tmp_path, run):
    ckpt = fake_checkpoint(tmp_path / "run", 2)
    size = (ckpt / checkpoint.STATE_FILE).stat().st_size
    with open(ckpt / checkpoint.STATE_FILE, "a") as f:
        f.write(" ")
    proc = run("--run.resume", str(ckpt))
    one_clean_line(proc, f"checkpoint step_000002 fails its check: rpk_state.json is {size + 1:,} "
                         f"bytes, its manifest says {size:,}")


def test_resume_past_the_last_step(tmp_path, run):
    ckpt = fake_checkpoint(tmp_path / "run", 5)
    proc = run("--run.resume", str(ckpt), "--run.steps", "5")
    one_clean_line(proc, "is already at step 5; raise run.steps to continue")


@pytest.mark.slow  # the guard cannot tell from argv that it stops at its config
def test_range_errors_name_the_full_field(tmp_path):
    """The one real `python -m rpk.run` of this module: the `__main__` entry exits with
    `main`'s code, its line on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "rpk.run", "--run.out_dir", str(tmp_path / "runs"), "--train.lr", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    one_clean_line(proc, "train.lr must be > 0, got -1.0")


def test_keep_checkpoints_prunes_all_but_the_newest_and_the_marked(tmp_path):
    ckpts = [fake_checkpoint(tmp_path / "run", s) for s in (1, 2, 3, 4)]
    (ckpts[0] / checkpoint.KEEP_MARK).touch()
    removed = checkpoint.prune(tmp_path / "run" / "checkpoints", keep=2)
    assert removed == ckpts[1:2]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step_000001", "step_000003", "step_000004"
    ]
