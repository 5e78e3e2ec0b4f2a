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
