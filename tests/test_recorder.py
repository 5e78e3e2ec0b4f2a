"""The step recorder writes each step where it goes: metrics.jsonl (the step's own
columns first, then what the parts add, which may override them), the trackers, the
timeline, the samples and the display."""

from __future__ import annotations

import io
import json

from rich.console import Console

from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.obs import recorder
from rpk.obs.metrics import step_record
from rpk.obs.progress import LiveProgress
from rpk.sched.policy import Sampling, SyncPolicy
from tests.fakes import LengthScorer, RecordingTrainer, ScriptedEngine, mean_centred
from tests.test_loop import make_prompts, resp_index


class FakeTracker:
    name = "fake"

    def __init__(self) -> None:
        self.scalars: list[tuple[int, dict[str, float]]] = []
        self.texts: list[tuple[int, str, int]] = []

    def log_scalars(self, step, scalars):
        self.scalars.append((step, dict(scalars)))

    def log_config(self, config):
        pass

    def log_texts(self, step, rows, tag):
        self.texts.append((step, tag, len(rows)))

    def close(self):
        pass


async def test_a_step_goes_to_every_record_with_the_parts_columns(tmp_path, monkeypatch):
    prompts = make_prompts(6)
    policy = SyncPolicy(prompts, Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=32))
    runner = AsyncTrainer(RecordingTrainer())
    try:
        outcome = await run_step(1, policy, ScriptedEngine(lambda r: 5 + 5 * resp_index(r.request_id)),
                                 LengthScorer(), runner, mean_centred, version=0)
    finally:
        await runner.aclose()
    tracker = FakeTracker()
    monkeypatch.setattr(recorder, "open_trackers", lambda *args: [tracker])
    out = io.StringIO()
    display = LiveProgress(1, console=Console(file=out, width=200), live=False)
    rec = recorder.StepRecorder.open(tmp_path, display, trackers=["fake"], project="p", name="n",
                                     samples_per_step=3, show_samples=True)
    rec.step(outcome, {"policy_col": 1.5, "prompts": 99})
    rec.close()

    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    own = step_record(outcome)
    assert len(written) == 1 and list(written[0])[: len(own)] == list(own)
    assert written[0]["policy_col"] == 1.5 and written[0]["prompts"] == 99  # the parts' win
    assert tracker.scalars[0][0] == 1 and tracker.scalars[0][1]["policy_col"] == 1.5
    assert len((tmp_path / "timeline.jsonl").read_text().splitlines()) == 1
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 3
    assert tracker.texts == [(1, "samples", 3)]
    shown = out.getvalue()
    assert shown.startswith("step    1/1  reward 0.500") and "  sample (sync round" in shown
