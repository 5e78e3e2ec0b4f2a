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
from tests.fakes import LengthScorer, RecordingTrainer, ScriptedEngine, components, make_prompts, mean_centred
from tests.helpers import resp_index


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


async def test_the_controller_records_off_the_event_loop(tmp_path, monkeypatch):
    """A tracker's calls (HTTP for wandb and mlflow) run on a thread, as its open and
    close do: the loop keeps serving the run's other tasks meanwhile."""
    import threading

    from rpk import controller
    from rpk.assembly.settings import run_settings
    from rpk.config import Config, RewardConfig, RolloutConfig, RunConfig

    loop_thread = threading.current_thread()
    seen: list[tuple[str, bool]] = []

    class ThreadTracker(FakeTracker):
        def log_scalars(self, step, scalars):
            seen.append(("scalars", threading.current_thread() is loop_thread))

        def log_config(self, config):
            seen.append(("config", threading.current_thread() is loop_thread))

        def log_texts(self, step, rows, tag):
            seen.append((tag, threading.current_thread() is loop_thread))

    monkeypatch.setattr(recorder, "open_trackers", lambda *args: [ThreadTracker()])
    cfg = Config(
        rollout=RolloutConfig(policy="sync", prompts_per_step=2, responses_per_prompt=2, max_tokens=8),
        reward=RewardConfig(backend="thread", function="tests.reward_fns:exact"),
        run=RunConfig(steps=1, checkpoint_every=0, eval_every=0, eval_before_train=False,
                      samples_per_step=1, trackers=()),
    )
    prompts = make_prompts(8)
    parts = components(cfg, tmp_path, prompts, ScriptedEngine(lambda request: 4), AsyncTrainer(RecordingTrainer()))
    display = LiveProgress(1, console=Console(file=io.StringIO(), width=200), live=False)
    saved: list[int] = []

    async def save(run_dir, state, save_model, keep=0):
        saved.append(state.step)
        return run_dir / "checkpoints" / f"step_{state.step:06d}"

    monkeypatch.setattr(controller.checkpoint, "save", save)
    try:
        await controller._steps(run_settings(cfg), tmp_path, parts, display, controller.RunStatus(), None)
    finally:
        await parts.aclose()
    assert saved == [1]
    assert [name for name, _ in seen] == ["config", "scalars", "samples"]
    assert not any(on_loop for _, on_loop in seen)
