"""The run's record: the one object the controller hands each step's outcome and each
validation pass. It turns them into records (`rpk.obs.metrics`, `rpk.obs.validation`)
and writes them everywhere they go: `metrics.jsonl` and the trackers, the round's
timeline, the sampled responses and the live display. What the other parts add to a
step's record (the policy's, the elastic TP's, the scorer's and the reward watch's
columns) comes in as `extra`, already counted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpk.core.outcomes import EvalRun, StepOutcome
from rpk.obs.metrics import MetricsWriter, pick_samples, step_record
from rpk.obs.progress import LiveProgress
from rpk.obs.trackers import open_trackers
from rpk.obs.validation import sample_rows, val_record


@dataclass(slots=True)
class StepRecorder:
    """`samples_per_step` sampled responses a step go to samples.jsonl and the trackers;
    with `show_samples` the last of them is also printed."""

    writer: MetricsWriter
    display: LiveProgress
    samples_per_step: int
    show_samples: bool

    @classmethod
    def open(
        cls, run_dir: Path, display: LiveProgress, *, trackers: Sequence[str], project: str,
        name: str, samples_per_step: int, show_samples: bool, resume_after: int | None = None,
    ) -> StepRecorder:
        """The trackers started and the run's files opened (a resumed run's cut back to
        `resume_after`, its checkpoint's step). Blocking (a tracker may start a process)."""
        started = open_trackers(trackers, run_dir, project, name, display.message, resume_after)
        writer = MetricsWriter(run_dir, started, display.message, resume_after)
        return cls(writer, display, samples_per_step, show_samples)

    def config(self, config: Mapping[str, Any]) -> None:
        self.writer.log_config(config)

    def step(self, outcome: StepOutcome, extra: Mapping[str, Any]) -> None:
        record = {**step_record(outcome), **extra}
        self.writer.write(record)
        self.writer.write_timeline(outcome, tp=record.get("tp"), preemptions=record.get("preemptions"),
                                   spec_batch=record.get("spec_batch_max"))
        samples = pick_samples(outcome, self.samples_per_step)
        self.writer.write_samples(samples)
        self.display.step_done(record)
        if self.show_samples and samples:
            self.display.sample(samples[-1])

    def validated(self, run: EvalRun) -> None:
        """A validation pass, its own phase in metrics.jsonl."""
        record = val_record(run)
        self.writer.write(record)
        self.writer.log_texts(run.step, sample_rows(run), tag="val_samples")
        self.display.validated(record)

    def close(self) -> None:
        """Blocking (trackers flush and stop)."""
        self.writer.close()
