"""Generic machinery behind rpk's config: nested frozen dataclasses <-> YAML and dotted
CLI overrides, with `--help` generated from the fields.

Kept apart from `rpk.config` (which only declares fields and checks values) so that the
declaration reads like documentation.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from rpk.core.errors import ConfigError


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _convert(tp: Any, value: Any, where: str) -> Any:
    """Coerce a YAML or CLI value to the annotated type, or raise naming `where`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot take {value!r}")
    if origin is Literal:
        for choice in args:
            if value == choice or str(value) == str(choice):
                return choice
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
    if origin is tuple:
        items = value
        if isinstance(value, str):
            items = [v for v in (p.strip() for p in value.split(",")) if v]
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        elem = args[0] if args else str
        return tuple(_convert(elem, v, f"{where}[{i}]") for i, v in enumerate(items))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


# Keys that existed once, and what replaced them.
MOVED = {
    "train.streaming": "use train.stream_mode (none | thread | borrow); true was thread, false none",
}


def build(cls: type, values: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping; unknown keys and bad values raise
    ConfigError with the dotted path."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    for key in unknown:
        if (moved := MOVED.get(_join(where, key))) is not None:
            raise ConfigError(f"config key {_join(where, key)!r} is gone: {moved}")
    if unknown:
        raise ConfigError(
            f"unknown config key {_join(where, unknown[0])!r}; "
            f"{where or 'the top level'} takes: {', '.join(sorted(names))}"
        )
    kwargs: dict[str, Any] = {}
    for name, raw in values.items():
        path = _join(where, name)
        tp = hints[name]
        if _is_dataclass_type(tp):
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{path}: expected a section (mapping), got {raw!r}")
            kwargs[name] = build(tp, raw, path)
        else:
            kwargs[name] = _convert(tp, raw, path)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.field is None:
            raise
        raise ConfigError(f"{_join(where, e.field)} {e.problem}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where + ': ' if where else ''}{e}") from None


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def to_dict(obj: Any) -> dict[str, Any]:
    """A plain nested dict (tuples as lists) that YAML can write and `build` can read."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {p!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(argv: list[str]) -> tuple[Path | None, dict[str, Any]]:
    """Split `--config FILE` and `--a.b VALUE` / `--a.b=VALUE` pairs into a nested dict.
    A leading `--` (how a launcher passes arguments through) is skipped."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    config_file: Path | None = None
    tree: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --train.lr 1e-5")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_file = Path(value)
        else:
            _set_dotted(tree, key, value)
    return config_file, tree


def load(
    cls: type, argv: list[str],
    presets: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> Any:
    """Defaults, then `presets` of the file and overrides' tree (a tree of values that
    replace defaults, for what the tree chose), then the YAML file of `--config`, then
    dotted CLI overrides."""
    config_file, overrides = parse_overrides(argv)
    tree: dict[str, Any] = {}
    if config_file is not None:
        try:
            loaded = yaml.safe_load(config_file.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"--config {config_file}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {config_file}: not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {config_file}: the top level must be a mapping")
        tree = loaded
    tree = _merge(tree, overrides)
    if presets is not None:
        tree = _merge(dict(presets(tree)), tree)
    return build(cls, tree)


def iter_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted name, type, default, help) for every leaf field, in declaration order."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        name = _join(prefix, f.name)
        if _is_dataclass_type(tp):
            yield from iter_fields(tp, name)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        yield name, tp, default, f.metadata.get("help", "")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        return "list"
    return getattr(tp, "__name__", str(tp))


def help_text(cls: type, prog: str) -> str:
    lines = [
        f"usage: {prog} [--config FILE.yaml] [--section.field VALUE ...]",
        "",
        "Every field can be set in the YAML file (nested sections) or on the command line",
        "(dotted). Command-line values win over the file, which wins over the defaults.",
        "",
    ]
    section = None
    for name, tp, default, help_ in iter_fields(cls):
        head = name.rsplit(".", 1)[0] if "." in name else ""
        if head != section:
            section = head
            lines.append(f"{section}:")
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        lines.append(f"  --{name} {_type_name(tp)}  (default: {shown})")
        if help_:
            lines.append(f"      {help_}")
    return "\n".join(lines)


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)
