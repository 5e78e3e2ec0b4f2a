"""The one distinction the run's top level needs: whose fault an error is."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave is wrong (config, data, model, reward, checkpoint).

    `rpk.run` prints it as one line and exits 2; anything else is a bug in rpk and gets
    a traceback. Subclasses say which stage refused."""


class NodeFailure(RuntimeError):
    """A node of a multi-node run is gone (its engine host or a rank): the run stops
    with one line naming it, and a resume continues from the last checkpoint."""

    def __init__(self, node: int | None, what: str) -> None:
        where = f"node {node}" if node is not None else "a node"
        super().__init__(f"{where} failed: {what}")
        self.node = node
        self.what = what


class ConfigError(UserError, ValueError):
    """A config value or key is wrong; the message names the dotted field and the value.

    A section's own checks raise it with `field` set and the message saying what is
    wrong with that field ("must be > 0, got -1"); `build` then names the full dotted
    field ("train.lr must be > 0, got -1")."""

    def __init__(self, problem: str, field: str | None = None) -> None:
        super().__init__(f"{field} {problem}" if field else problem)
        self.field = field
        self.problem = problem


def bad(field: str, problem: str) -> ConfigError:
    """The error for one field of the section being checked."""
    return ConfigError(problem, field)
