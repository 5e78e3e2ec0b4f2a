"""Built-in verifiable tasks: prompts, reference solutions and veRL-style reward functions.

`rpk.tasks.arith` is the default: multi-digit addition whose needed response length grows
with the digit count, which is heavy-tailed across prompts (the long tail rpk exists for).

`TASKS` is the registry `data.task` names a task from: one `Task` record per task holds
everything the run asks of it (its rows and checker, its tiny model, whether it is judged
or multi-turn, and the config defaults of its job); `task` looks one up and refuses a
name it does not hold. The config reads it (`rpk.config` imports this module, which
imports nothing but `rpk.core` and the specs), the reward functions find a built-in
checker through it (`by_source`), and the assembly builds from it. A task's modules load
when it is used, so a run of one task never imports another's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rpk.core.errors import ConfigError
from rpk.tasks.specs import TinySpec

if TYPE_CHECKING:
    from rpk.tasks.tiny import Recipe


# The loaders below import a task's modules inside the function, on purpose: the registry
# is read by the config and by every run, and must not carry the other tasks in with it.


def _arith() -> ModuleType:
    from rpk.tasks import arith

    return arith


def _arith_judged() -> ModuleType:
    from rpk.tasks import arith_judged

    return arith_judged


def _tool_add() -> ModuleType:
    from rpk.tasks import tool_add

    return tool_add


def _arith_recipe() -> Recipe:
    from rpk.tasks.tiny import ARITH

    return ARITH


def _tool_add_recipe() -> Recipe:
    from rpk.tasks.tiny_multi import TOOL_ADD

    return TOOL_ADD


@dataclass(frozen=True, slots=True)
class Task:
    """One built-in task.

    - `load`: its module, imported on first use: the rows (`make_rows`, `held_out_rows`),
      the checker (`compute_score`), and a multi-turn task's tools (`TOOLS`, as
      `agent.tools` would name them, and `TOOL_SCHEMAS`);
    - `data_source`: the rows' `data_source`, by which the reward functions find the
      checker (`by_source`);
    - `tiny_field`: the `model` section's field that holds its tiny model's spec, and
      `recipe` the build's recipe (`rpk.tasks.tiny.Recipe`);
    - `judged`: some of its rows (`data.judged_frac`, which `make_rows` takes) are
      scored by a judge model (`rpk.reward.judge`);
    - `multi_turn`: its requests are trajectories (`rpk.agent`);
    - `defaults`: where its default job differs from the run's defaults, by config
      section (the YAML file and the command line still win);
    - `fingerprint_words`: how a checkpoint's fingerprint names it."""

    name: str
    data_source: str
    load: Callable[[], ModuleType]
    tiny_field: str
    recipe: Callable[[], Recipe]
    fingerprint_words: str
    judged: bool = False
    multi_turn: bool = False
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def module(self) -> ModuleType:
        return self.load()

    def checker(self) -> Callable[..., Any]:
        """Its rule checker, veRL's `compute_score` signature."""
        fn: Callable[..., Any] = self.load().compute_score
        return fn

    def tiny_spec(self, model: object) -> TinySpec:
        """The spec of its tiny model, read off the config's `model` section."""
        spec: TinySpec = getattr(model, self.tiny_field)
        return spec

    def tiny_recipe(self) -> Recipe:
        return self.recipe()


TASKS: dict[str, Task] = {t.name: t for t in (
    # arith's fingerprint words are those of checkpoints from before data.task, which resume
    Task("arith", "rpk/arith", _arith, "tiny", _arith_recipe, "built-in task"),
    # The judged rows keep arith's checker too: it checks them beside the judge.
    Task("arith_judged", "rpk/arith_judged", _arith_judged, "tiny", _arith_recipe,
         "built-in task arith_judged", judged=True),
    # A 20-digit sum's trajectory, with its retries and running sums, is up to ~620 tokens
    # beside its prompt, which arith's 320 cuts short; and a step of 16 prompts (half
    # arith's) takes ~7 s on the 2-core machine, so 120 steps train as many prompts as 60
    # of 32 but with twice the updates, validated three times (512 prompts each: a
    # standard error near 0.02).
    Task("tool_add", "rpk/tool_add", _tool_add, "tiny_tool_add", _tool_add_recipe,
         "built-in task tool_add", multi_turn=True,
         defaults={"rollout": {"max_tokens": 640, "prompts_per_step": 16},
                   "run": {"steps": 120, "eval_every": 60}}),
)}


def task(name: str) -> Task:
    """The task `data.task` names; a name the registry lacks is refused with the ones it has."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"{name!r} is not one of {', '.join(TASKS)}", "data.task") from None


def by_source(data_source: str) -> Task | None:
    """The built-in task whose rows carry `data_source`, or None."""
    return next((t for t in TASKS.values() if t.data_source == data_source), None)
