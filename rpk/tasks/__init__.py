"""Built-in verifiable tasks: prompts, reference solutions and veRL-style reward functions.

`rpk.tasks.arith` is the default: multi-digit addition whose needed response length grows
with the digit count, which is heavy-tailed across prompts (the long tail rpk exists for).

`TASKS` is the registry `data.task` names a task from; `task` looks one up and refuses a
name it does not hold. A task's modules load when it is used, so a run of one task never
imports the other's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rpk.core.errors import ConfigError
from rpk.tasks.specs import TinySpec

if TYPE_CHECKING:
    from rpk.tasks.tiny import Recipe


@dataclass(frozen=True, slots=True)
class Task:
    """One built-in task: the module of its rows (`make_rows`, `held_out_rows`; a
    multi-turn task's also `TOOLS` and `TOOL_SCHEMAS`, its tools as `agent.tools` would
    name them), the tiny model it trains (the `model` section's field of its spec, and
    the build recipe, as `module:NAME`), and how a checkpoint's fingerprint names it."""

    name: str
    rows: str
    tiny_field: str
    recipe: str
    multi_turn: bool
    fingerprint_words: str

    def module(self) -> ModuleType:
        return importlib.import_module(self.rows)

    def tiny_spec(self, model: object) -> TinySpec:
        """The spec of its tiny model, read off the config's `model` section."""
        spec: TinySpec = getattr(model, self.tiny_field)
        return spec

    def tiny_recipe(self) -> Recipe:
        module, _, name = self.recipe.partition(":")
        recipe: Any = getattr(importlib.import_module(module), name)
        return recipe


TASKS: dict[str, Task] = {
    # arith's fingerprint words are those of checkpoints from before data.task, which resume
    "arith": Task("arith", "rpk.tasks.arith", "tiny", "rpk.tasks.tiny:ARITH", False, "built-in task"),
    "arith_judged": Task("arith_judged", "rpk.tasks.arith_judged", "tiny", "rpk.tasks.tiny:ARITH", False,
                         "built-in task arith_judged"),
    "tool_add": Task("tool_add", "rpk.tasks.tool_add", "tiny_tool_add", "rpk.tasks.tiny_multi:TOOL_ADD",
                     True, "built-in task tool_add"),
}


def task(name: str) -> Task:
    """The task `data.task` names; a name the registry lacks is refused with the ones it has."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"{name!r} is not one of {', '.join(TASKS)}", "data.task") from None
