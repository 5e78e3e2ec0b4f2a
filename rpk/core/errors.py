"""The one distinction the run's top level needs: whose fault an error is."""

from __future__ import annotations


class UserError(Exception):
    """Something the user gave is wrong (config, data, model, reward, checkpoint).

    `rpk.run` prints it as one line and exits 2; anything else is a bug in rpk and gets
    a traceback. Subclasses say which stage refused."""
