"""The names a config value is chosen from, as plain data.

`rpk.config` checks a value against these without importing the packages that implement
the choices; each of those keys its registry by the same names (`rpk.sched.policy.
POLICIES`, `rpk.obs.trackers.TRACKERS`, `rpk.train.losses.LOSSES`, `rpk.tasks.TASKS`),
and a test holds the two equal.
"""

from __future__ import annotations

POLICIES = ("tail", "sync", "oversample", "partial", "length_aware")
TRACKERS = ("tensorboard", "wandb", "mlflow")
LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
TASKS = ("arith", "arith_judged", "tool_add")  # the built-in tasks (`data.task`)
JUDGED_TASKS = ("arith_judged",)  # those with judged rows (`rpk.tasks.Task.judged`)
