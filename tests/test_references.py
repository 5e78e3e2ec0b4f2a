"""Every backticked `rpk.x.y` name in rpk's docstrings and comments, docs/*.md and the
README names something that exists: a module, or an attribute of one (a class, a
function, a method, a constant). Renames leave no stale pointer behind."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"`(rpk(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`")


def _exists(name: str) -> bool:
    """`name` is a module, or attributes reached from the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _references(paths: list[Path]) -> list[tuple[str, str]]:
    return [(f"{p.relative_to(ROOT)}:{n}", m.group(1))
            for p in paths for n, line in enumerate(p.read_text().splitlines(), 1)
            for m in _NAME.finditer(line)]


def test_every_named_rpk_object_exists() -> None:
    paths = [*sorted((ROOT / "rpk").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    refs = _references(paths)
    assert len(refs) > 100  # the check reads what it should
    stale = [f"{where} {name}" for where, name in refs if not _exists(name)]
    assert not stale, "\n".join(stale)


def test_the_check_tells_a_stale_name_from_a_live_one() -> None:
    assert _exists("rpk.sync.backends.Backend.SPOOL") and _exists("rpk.tasks")
    assert not _exists("rpk.loop.colocate") and not _exists("rpk.sync.backends.Nope")
