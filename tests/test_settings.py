"""The settings records `rpk.assembly.settings` makes from the config for the parts that take no
config (the trainer, the reward stack, the controller): what a part gets by default is
what the config's defaults give it, and a changed field reaches it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rpk.assembly import settings
from rpk.config import from_argv
from rpk.reward import RewardSettings
from rpk.reward.code import SandboxSettings
from rpk.reward.pool import worker_memory_mb
from rpk.train.trainer import TrainerSettings


def test_the_trainers_defaults_are_the_train_sections():
    assert settings.trainer_settings(from_argv([]).train, lora=False) == TrainerSettings()
    changed = settings.trainer_settings(from_argv(["--train.lr", "0.001", "--train.loss", "dapo"]).train, lora=False)
    assert (changed.lr, changed.loss) == (0.001, "dapo")


def test_the_reward_stacks_defaults_are_the_reward_sections():
    made = settings.reward_settings(from_argv([]).reward)
    assert made.pool.memory_mb == worker_memory_mb(made.pool.max_workers)  # sized by the machine
    assert dataclasses.replace(made, pool=dataclasses.replace(made.pool, memory_mb=None)) == RewardSettings()
    assert RewardSettings().sandbox == SandboxSettings()
    changed = settings.reward_settings(
        from_argv(["--reward.backend", "thread", "--reward.sandbox.memory_mb", "512"]).reward)
    assert (changed.backend, changed.sandbox.limits.memory_mb) == ("thread", 512)


def test_the_controllers_settings_come_from_the_run_reward_and_dist_sections():
    cfg = from_argv(["--run.steps", "7", "--run.resume", "runs/latest", "--reward.max_failure_steps", "2",
                     "--dist.heartbeat_misses", "5"])
    s = settings.run_settings(cfg)
    assert (s.steps, s.resume, s.max_failure_steps, s.heartbeat_misses) == (7, Path("runs/latest"), 2, 5)
    assert s.config["run"]["steps"] == 7 and "steps: 7" in s.config_yaml
