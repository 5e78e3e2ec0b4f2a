"""A run of the real step loop, checkpoint writer and trainer (a tiny Qwen2 on CPU) under
checkpoint faults, a scripted engine standing in for vLLM: what test_checkpoint_faults.py
and test_checkpoint_kill_rank.py drive, on one rank or two."""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from rpk import controller
from rpk.assembly.settings import run_settings
from rpk.config import Config, RewardConfig, RolloutConfig, RunConfig
from rpk.core.records import GenRequest
from rpk.gpu.launch import Joined
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.progress import LiveProgress
from rpk.train.dist import DistTrainer
from tests.dist_harness import make
from tests.fakes import ScriptedEngine, components, make_prompts
from tests.faults import Fault, KeptOpen, set_follower_fault, shown_writes
from tests.trainers import trainer

STEPS = 3
FAILED_STEP = 2  # the save that fails; checkpoint 1 is the one to fall back to
# What must match step for step (not timings).
SAME = ("step", "prompts", "responses", "reward_mean", "reward_std", "accuracy",
        "response_len_mean", "response_len_max", "train_loss", "train_grad_norm", "version")
# Where the follower rank of the two-rank tests reads the fault in force.
FAULT_FILE = Path(tempfile.gettempdir()) / f"rpk-fault-{os.getpid()}.json"
# The shard rank 1 writes in a two-rank save.
RANK1_SHARD = "trainer/__1_0.distcp"


def config(resume: Path | None = None) -> Config:
    return Config(
        rollout=RolloutConfig(policy="sync", prompts_per_step=2, responses_per_prompt=2, max_tokens=8),
        reward=RewardConfig(backend="thread", function="tests.reward_fns:exact"),
        run=RunConfig(steps=STEPS, checkpoint_every=1, trackers=(), eval_before_train=False,
                      samples_per_step=0, resume=None if resume is None else str(resume)),
    )


def answer(request: GenRequest) -> str:
    """Right for some responses, wrong for others, by the request's seed: rewards and
    lengths vary within each group, so every step trains."""
    seed = request.seed or 0
    return str(request.prompt_token_ids[-1]) if seed % 3 else "x" * (1 + seed % 5)


async def run(cfg: Config, run_dir: Path, model: Path, hook: Any = None, make: Any = None) -> str:
    """Steps 1..STEPS (or on from `run.resume`'s checkpoint) through the controller's
    loop, every file of every save shown to `hook` (a follower rank's too, through
    `FAULT_FILE`); returns the console's text."""
    point = controller._resume_point(run_settings(cfg))
    prompts = make_prompts(8)
    inner = (make or (lambda d: trainer(d, torch_threads=1)))(point.checkpoint if point else model)
    closes = not isinstance(inner, DistTrainer)
    out = io.StringIO()
    parts = components(cfg, run_dir, prompts, ScriptedEngine(lambda r: 4, text_of=answer),
                       AsyncTrainer(KeptOpen(inner, closes)))
    progress = LiveProgress(cfg.run.steps, console=Console(file=out, width=400), live=False)
    set_follower_fault(FAULT_FILE, hook if isinstance(hook, Fault) else None)
    try:
        with shown_writes(hook):
            if point is not None:
                await parts.trainer.load(point.checkpoint)
                parts.policy.load_state_dict(point.state.policy)
            await controller._steps(run_settings(cfg), run_dir, parts, progress, controller.RunStatus(), point)
    finally:
        set_follower_fault(FAULT_FILE, None)
        await parts.aclose()
    return out.getvalue()


def same(record: dict) -> dict:
    return {k: record.get(k) for k in SAME}


def on_two(joined: Joined) -> Callable[[Path], DistTrainer]:
    return lambda d: DistTrainer(joined.channel, lambda m: make(m, joined.sharding), str(d))
