"""Experiment trackers: where a run's scalars, config and sample texts go besides
`metrics.jsonl`. `run.trackers` names any of TRACKERS; each backend is an optional
package, imported only when asked for.

- `tensorboard` (the default): `RUN_DIR/tensorboard/` (`pip install 'rpk[tb]'`).
- `wandb`: `wandb.init(project=run.project, name=run.name)`, files under `RUN_DIR/wandb/`
  unless `WANDB_DIR` says otherwise; `WANDB_MODE=offline` needs no network, and every
  other `WANDB_*` variable works as usual (`pip install 'rpk[wandb]'`).
- `mlflow`: experiment `run.project`, run `run.name`, on `MLFLOW_TRACKING_URI` when set,
  else a local file store in `RUN_DIR/mlruns` (`mlflow ui --backend-store-uri
  RUN_DIR/mlruns`; `pip install 'rpk[mlflow]'`).

A tracker that cannot start (package missing, bad credentials, no server) costs one
line at start-up and the run goes on without it: `metrics.jsonl` always has everything.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Note = Callable[[str], None]
Rows = Sequence[Mapping[str, Any]]


class Tracker(Protocol):
    name: str

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_texts(self, step: int, rows: Rows, tag: str) -> None:
        """A table of texts (prompts, responses, verdicts): one mapping per row."""
        ...

    def close(self) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """("section.field", value) for every leaf of a nested mapping."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def _columns(rows: Rows) -> list[str]:
    """Every key of the rows, in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in row))


def _cell(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(
        self, run_dir: Path, project: str, run_name: str, resume_after: int | None = None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run's event files drop what was logged past its checkpoint.
        purge = None if resume_after is None else resume_after + 1
        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        lines = "\n".join(f"    {k}: {v!r}" for k, v in flatten(config))
        self._writer.add_text("config", lines, 0)

    def log_texts(self, step: int, rows: Rows, tag: str) -> None:
        # TensorBoard renders text as markdown: one indented (verbatim) block per row.
        blocks = []
        for i, row in enumerate(rows):
            fields = "\n".join(f"    {k}: {v}".replace("\n", "\n    ") for k, v in row.items())
            blocks.append(f"**{i}**\n\n{fields}")
        self._writer.add_text(tag, "\n\n".join(blocks), step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(
        self, run_dir: Path, project: str, run_name: str, resume_after: int | None = None
    ) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=project,
            name=run_name,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            # rpk draws its own live display; wandb's console capture would wrap it.
            settings=wandb.Settings(console="off"),
        )

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_texts(self, step: int, rows: Rows, tag: str) -> None:
        columns = _columns(rows)
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        self._run.log({tag: self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self._run.finish()


# MLflow metric names allow letters, digits, _ - . / and spaces; rpk's `mean@4` does not fit.
_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")


class MLflowTracker:
    """Through an `MlflowClient` and an explicit run id, not mlflow's global active
    run, so that runs made one after another in a process (the benchmarks) stay apart."""

    name = "mlflow"

    def __init__(
        self, run_dir: Path, project: str, run_name: str, resume_after: int | None = None
    ) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses a file store unless told it is wanted: here it is the
            # default, and MLFLOW_TRACKING_URI picks a database or a server instead.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(project)
        )
        self._run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            self._metric(_MLFLOW_BAD_CHARS.sub("_", k), float(v), now, step)
            for k, v in scalars.items()
        ]
        self._client.log_batch(self._run_id, metrics=metrics)

    def log_config(self, config: Mapping[str, Any]) -> None:
        params = [self._param(k, json.dumps(v) if not isinstance(v, str) else v)
                  for k, v in flatten(config)]
        self._client.log_batch(self._run_id, params=params)

    def log_texts(self, step: int, rows: Rows, tag: str) -> None:
        text = "".join(json.dumps({k: _cell(v) for k, v in row.items()}) + "\n" for row in rows)
        self._client.log_text(self._run_id, text, f"{tag}/step_{step:06d}.jsonl")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


@dataclass(frozen=True, slots=True)
class TrackerRow:
    """A `run.trackers` choice: its class, the package imported first (missing, it is a
    note and not a failure) and rpk's extra that installs it."""

    cls: type[TensorBoardTracker | WandbTracker | MLflowTracker]
    package: str
    extra: str


TRACKERS: dict[str, TrackerRow] = {
    row.cls.name: row
    for row in (
        TrackerRow(TensorBoardTracker, "tensorboard", "tb"),
        TrackerRow(WandbTracker, "wandb", "wandb"),
        TrackerRow(MLflowTracker, "mlflow", "mlflow"),
    )
}


def open_trackers(
    names: Sequence[str], run_dir: Path, project: str, run_name: str, note: Note,
    resume_after: int | None = None,
) -> list[Tracker]:
    """Start each named tracker. One that cannot start is one line through `note`, and
    the run goes on without it. `resume_after`: a resumed run's checkpoint step (wandb
    and MLflow start a new run that continues the step count). Blocking (wandb starts a
    service process)."""
    started: list[Tracker] = []
    for name in names:
        row = TRACKERS[name]
        try:
            importlib.import_module(row.package)
        except ImportError:
            note(f"tracker {name}: {row.package} is not installed "
                 f"(pip install 'rpk[{row.extra}]'); not used")
            continue
        try:
            started.append(row.cls(run_dir, project, run_name, resume_after))
        except Exception as e:  # any backend's failure to start, reported the same way
            note(f"tracker {name}: failed to start ({describe(e)}); not used")
    return started


def close_all(trackers: Sequence[Tracker], note: Note) -> None:
    """Close every tracker (wandb finishes its run and stops its service); one that
    fails to is reported, and the others are still closed."""
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # closing is best effort: the run's files are written
            note(f"tracker {tracker.name}: failed to close ({describe(e)})")


def describe(e: BaseException) -> str:
    """An exception as one short line (backends raise multi-line essays)."""
    text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return text if len(text) <= 300 else text[:297] + "..."
