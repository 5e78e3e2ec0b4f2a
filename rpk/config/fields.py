"""What every config section is made of: `opt` (a field with its help text, which
`--help` prints) and the per-field checks the sections run in `__post_init__`, each
raising a `ConfigError` that names the field and its value."""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from rpk.cli_config import bad


def opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def positive(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value > 0:
            raise bad(name, f"must be > 0, got {value!r}")


def whole(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise bad(name, f"must be a positive integer, got {value!r}")


def is_finite_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def non_negative(section: object, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not value >= 0:
            raise bad(name, f"must be >= 0, got {value!r}")
