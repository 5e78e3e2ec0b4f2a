"""What every config section is made of: `opt` (a field with its help text, which
`--help` prints) and the per-field checks the sections run in `__post_init__`, each
raising a `ConfigError` that names the field and its value."""

from __future__ import annotations

import math
import typing
from dataclasses import field
from typing import Any, Literal

from rpk.core.errors import bad


def opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def again(base: type, name: str, default: Any) -> Any:
    """A subclass's other default for `base`'s field `name`, with the base's help: the
    field means the same, only its value differs."""
    return opt(default, base.__dataclass_fields__[name].metadata["help"])


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


def one_of(section: object, *names: str) -> None:
    """Each named field holds one of the values its `Literal` type lists: the type is the
    one place the choices are spelled."""
    hints = typing.get_type_hints(type(section))
    for name in names:
        hint, value = hints[name], getattr(section, name)
        assert typing.get_origin(hint) is Literal, f"{name} is not a Literal field"
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise bad(name, f"must be one of {', '.join(allowed)}, got {value!r}")
