"""A multi-turn run's step records carry the agent engine's wall clocks: the controller
laps `AgentEngine` around each step, so `engine_idle_s` and `tool_exposed_s` are the
step's own wall seconds (not a sum over trajectories, not validation's)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rich.console import Console

from rpk import assembly, controller
from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvStep
from rpk.agent.parse import ToolCall, format_tool_call
from rpk.agent.template import ObservationEncoder
from rpk.assembly.settings import run_settings
from rpk.config import TinySpec, from_argv
from rpk.core.records import Prompt, ToolUse
from rpk.loop.feed import Streaming
from rpk.loop.trainer import AsyncTrainer
from rpk.obs import recorder
from rpk.obs.metrics import read_records
from rpk.obs.progress import LiveProgress
from rpk.sched.policy import Sampling, SyncPolicy
from rpk.sim.trainer import NullTrainer
from rpk.tasks.tiny import build_tokenizer
from tests.agent_fakes import TurnEngine, turn_of
from tests.fakes import LengthScorer, build_settings

CALL_S = 0.3


class _OneSlowCall:
    """Answers the first turn after CALL_S of real time; the second turn ends it."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, prompt: Prompt) -> None:
        return None

    async def step(self, turn_text: str) -> EnvStep:
        self.steps += 1
        if self.steps > 1:
            return EnvStep(done=True)
        await asyncio.sleep(CALL_S)
        return EnvStep(({"role": "tool", "content": "r"},), tools=ToolUse(calls=1, seconds=CALL_S))

    async def close(self) -> None:
        return None


class _Scorer(LengthScorer):
    failure_kinds = ()
    judge = router = None  # as a RewardStack with nothing judged

    def metrics(self) -> dict[str, float]:
        return {}


class _Tracker:
    def log_scalars(self, step: int, scalars: Any) -> None:
        return None

    def log_config(self, config: Any) -> None:
        return None

    def log_texts(self, *args: Any) -> None:
        return None

    def close(self) -> None:
        return None


async def test_step_records_carry_the_steps_wall_clocks(tmp_path, monkeypatch) -> None:
    """Sync steps of 2 prompts x 2 trajectories, all in lockstep: their four 0.3 s tool
    calls overlap, so each step's exposed tool time is 0.3 s of wall time (the old sum
    over trajectories said 1.2 s), and all of the engine's idle time is that."""
    cfg = from_argv(["--run.steps", "2", "--run.eval_every", "0", "--run.samples_per_step", "0",
                     "--rollout.policy", "sync", "--rollout.prompts_per_step", "2",
                     "--rollout.responses_per_prompt", "2", "--rollout.max_tokens", "400",
                     "--run.checkpoint_every", "0"])
    tokenizer = build_tokenizer(TinySpec())
    ps = [Prompt(f"t{i}", (9, i), "test", str(i)) for i in range(4)]
    call = format_tool_call(ToolCall("add", {"a": 1}))
    inner = TurnEngine(lambda r: call if turn_of(r) == 1 else "done",
                       lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    engine = AgentEngine(inner, _OneSlowCall, ObservationEncoder(tokenizer), {p.uid: p for p in ps},
                         max_turns=4)
    trainer = AsyncTrainer(NullTrainer())
    sampling = Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=400)
    parts = assembly.Components(tmp_path, ps, SyncPolicy(ps, sampling, shuffle=False), _Scorer(),
                             engine, trainer, Streaming(), [], **build_settings(cfg))
    monkeypatch.setattr(recorder, "open_trackers", lambda *args: [_Tracker()])
    progress = LiveProgress(2, console=Console(file=None, quiet=True), live=False)
    try:
        await controller._steps(run_settings(cfg), tmp_path, parts, progress, controller.RunStatus(), None)
    finally:
        await trainer.aclose()
    steps = read_records(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["tool_seconds"] == pytest.approx(4 * CALL_S)
        assert s["tool_exposed_s"] == pytest.approx(CALL_S, abs=0.1)
        assert s["engine_idle_s"] == pytest.approx(s["tool_exposed_s"], abs=0.05)
