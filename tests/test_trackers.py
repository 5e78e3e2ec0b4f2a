"""Trackers with their packages present (TensorBoard, wandb offline, an MLflow file
store: nothing leaves the machine) and absent, a tracker failing at start or mid-run,
and the config's checks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from rpk.config import from_argv
from rpk.obs import trackers
from rpk.obs.metrics import MetricsWriter, read_records
from rpk.obs.trackers import TRACKERS, open_trackers

CONFIG = {"train": {"lr": 0.0002, "loss": "grpo"}, "data": {"train_files": ["a.jsonl"]},
          "model": {"path": None}}
ROWS = [{"prompt": "What is 1 + 2?", "response": "A1+a2+0=03\nAnswer: 3", "correct": True,
         "tokens": 12},
        {"prompt": "What is 5 + 5?", "response": "Answer: 9", "correct": False, "tokens": 4}]


def exercise(run_dir: Path, name: str, notes: list[str]) -> None:
    """What a run does with a tracker: config, scalars at two steps, texts, close."""
    started = open_trackers([name], run_dir, "rpk-test", "run-1", notes.append)
    assert [t.name for t in started] == [name], notes
    writer = MetricsWriter(run_dir, started, note=notes.append)
    writer.log_config(CONFIG)
    writer.write({"step": 0, "phase": "eval", "val/acc_greedy": 0.25, "val/mean@4": 0.2})
    writer.write({"step": 1, "reward_mean": 0.5, "round_kind": "short", "truncated": False})
    writer.write({"step": 2, "reward_mean": 0.75, "round_kind": "long"})
    writer.log_texts(2, ROWS, tag="val_samples")
    writer.close()
    assert notes == []


def test_tensorboard_gets_scalars_config_and_texts(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    notes: list[str] = []
    exercise(tmp_path, "tensorboard", notes)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("val/acc_greedy")] == [(0, 0.25)]
    tags = events.Tags()
    assert "round_kind" not in tags["scalars"] and "step" not in tags["scalars"]
    texts = {tag: events.Tensors(tag) for tag in tags["tensors"]}
    config = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "train.lr: 0.0002" in config and "data.train_files: ['a.jsonl']" in config
    samples = texts["val_samples/text_summary"][0]
    assert samples.step == 2 and "Answer: 9" in samples.tensor_proto.string_val[0].decode()
    # the file has every record, the trackers' loss of strings notwithstanding
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]


def test_wandb_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wb").mkdir()
    notes: list[str] = []
    started = open_trackers(["wandb"], tmp_path, "rpk-test", "run-1", notes.append)
    assert notes == [] and len(started) == 1
    run = started[0]._run
    assert run.name == "run-1" and run.project == "rpk-test"
    writer = MetricsWriter(tmp_path, started, note=notes.append)
    writer.log_config(CONFIG)
    writer.write({"step": 0, "val/acc_greedy": 0.25, "val/mean@4": 0.2})
    writer.write({"step": 3, "reward_mean": 0.75, "round_kind": "long"})
    writer.log_texts(3, ROWS, tag="val_samples")
    assert run.config["train"]["lr"] == 0.0002
    writer.close()
    assert notes == []
    [offline] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    [log] = offline.glob("run-*.wandb")
    # wandb's service process writes the run's log; on a busy machine it may still be
    # flushing when `finish` returns.
    deadline = time.monotonic() + 30
    while b"reward_mean" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(key in log.read_bytes() for key in (b"val/acc_greedy", b"val/mean@4", b"reward_mean"))
    [table] = (offline / "files" / "media" / "table").glob("val_samples_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == ["prompt", "response", "correct", "tokens"]
    assert data["data"][1] == ["What is 5 + 5?", "Answer: 9", False, 4]


def test_mlflow_local_file_store_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    notes: list[str] = []
    exercise(tmp_path, "mlflow", notes)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("rpk-test")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    # `@` is not allowed in MLflow metric names
    assert client.get_metric_history(run.info.run_id, "val/mean_4")[0].value == 0.2
    assert run.data.params["train.lr"] == "0.0002"
    assert run.data.params["data.train_files"] == '["a.jsonl"]'
    assert run.data.params["model.path"] == "null"
    text = (tmp_path / "mlruns" / experiment.experiment_id / run.info.run_id / "artifacts"
            / "val_samples" / "step_000002.jsonl").read_text()
    assert [json.loads(line) for line in text.splitlines()] == ROWS


@pytest.mark.parametrize("name, extra", [("tensorboard", "tb"), ("wandb", "wandb"),
                                         ("mlflow", "mlflow")])
def test_a_missing_package_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, name, extra):
    monkeypatch.setitem(sys.modules, TRACKERS[name].package, None)  # import -> ImportError
    notes: list[str] = []
    assert open_trackers([name], tmp_path, "rpk", "r", notes.append) == []
    assert notes == [f"tracker {name}: {TRACKERS[name].package} is not installed "
                     f"(pip install 'rpk[{extra}]'); not used"]


def test_a_tracker_that_fails_to_start_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    notes: list[str] = []
    assert open_trackers(["mlflow"], tmp_path, "rpk", "r", notes.append) == []
    assert len(notes) == 1
    assert notes[0].startswith("tracker mlflow: failed to start (") and notes[0].endswith("not used")
    assert "\n" not in notes[0] and "bogus://nowhere" in notes[0]


class Flaky:
    name = "flaky"

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.logged: list[int] = []
        self.closed = False

    def log_scalars(self, step, scalars):
        if self.fail and step == 2:
            raise OSError("disk full")
        self.logged.append(step)

    def log_config(self, config):
        pass

    def log_texts(self, step, rows, tag):
        pass

    def close(self):
        self.closed = True


def test_a_tracker_failing_mid_run_is_dropped_once_and_the_rest_go_on(tmp_path):
    bad, good = Flaky(fail=True), Flaky(fail=False)
    notes: list[str] = []
    writer = MetricsWriter(tmp_path, [bad, good], note=notes.append)
    for step in (1, 2, 3):
        writer.write({"step": step, "reward_mean": 0.1 * step})
    writer.close()
    assert bad.logged == [1] and bad.closed
    assert good.logged == [1, 2, 3] and good.closed
    assert notes == ["tracker flaky failed (OSError: disk full); dropped"]
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_flatten_names_every_leaf():
    assert dict(trackers.flatten({"a": {"b": 1, "c": {"d": [2]}}, "e": None})) == {
        "a.b": 1, "a.c.d": [2], "e": None}


def test_trackers_and_validation_config():
    cfg = from_argv(["--run.trackers", "wandb,mlflow", "--run.name", "exp-3",
                     "--data.val_files", "v.jsonl", "--run.eval_k", "0"])
    assert cfg.run.trackers == ("wandb", "mlflow") and cfg.run.name == "exp-3"
    assert cfg.data.val_files == ("v.jsonl",) and cfg.run.eval_k == 0
    assert from_argv(["--run.trackers", ""]).run.trackers == ()
    assert from_argv([]).run.trackers == ("tensorboard",)
