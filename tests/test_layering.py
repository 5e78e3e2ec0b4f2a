"""The tree's import arrows point one way: no module of rpk imports itself back through
others (lazy imports inside functions count too), nor does any package (`rpk.engine`,
`rpk.train`, ...; a top-level module such as `rpk.run` is its own node); `rpk.core`
imports nothing of rpk's, the config (the `rpk.config` package, `rpk.config.cli`) only `rpk.core`
and the task specs (`rpk.tasks.specs`), no module but the assembly and `rpk.run` reaches
the config through any chain of imports, the pure layers (`core`, `sched`, `loop`) never import torch or
vLLM, and the trainer (`rpk.train`) imports neither the fleet (`rpk.engine`) nor what runs
inside vLLM's workers (`rpk.sync.worker`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "rpk"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module (of `known`, or a third-party top level) that `path` imports."""
    return _imports_of(ast.parse(path.read_text(), str(path)), path, name, known)


def _imports_of(tree: ast.Module, path: Path, name: str, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            # importing a.b.c runs a and a.b as well: the arrow goes to the deepest known one
            while target and target not in known and target.startswith("rpk"):
                target = target.rpartition(".")[0]
            found.add(target)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_rpk() -> None:
    # A package's __init__ importing its own submodules is not a cycle of the design.
    graph = {
        m: {t for t in deps if not (m == t.rpartition(".")[0])} for m, deps in _graph().items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _package(module: str) -> str:
    """`rpk.engine.fleet` -> `rpk.engine`; `rpk.run` stays itself."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for name, deps in graph.items():
        mine = packages.setdefault(_package(name), set())
        mine.update(_package(d) for d in deps if d.startswith("rpk.") and _package(d) != _package(name))
    return packages


def test_no_import_cycle_between_packages() -> None:
    cycle = _find_cycle(_package_graph(_graph()))
    assert cycle is None, "package import cycle: " + " -> ".join(cycle or [])


def test_package_graph_collapses_modules_to_their_package() -> None:
    graph = {"rpk.a.x": {"rpk.b.y"}, "rpk.a.z": set(), "rpk.b.y": {"rpk.a.z"}, "rpk.c": {"rpk.a.x"}}
    packages = _package_graph(graph)
    assert packages == {"rpk.a": {"rpk.b"}, "rpk.b": {"rpk.a"}, "rpk.c": {"rpk.a"}}
    assert _find_cycle(packages) == ["rpk.a", "rpk.b", "rpk.a"]


def _is_config(module: str) -> bool:
    return module in ("rpk.config", "rpk.config.cli") or module.startswith("rpk.config.")


# What the config may import besides itself and `rpk.core`: the task specs and the task
# registry, which import nothing but core and each other at their top (the registry loads
# a task's modules inside its loaders, when the task is used).
_CONFIG_MAY_IMPORT = ("rpk.tasks", "rpk.tasks.specs")


def _top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """`_imports` of the module's top-level statements only (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text(), str(path))
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return _imports_of(tree, path, name, known)


def test_config_imports_only_core_and_the_task_registry() -> None:
    modules = _modules()
    known = set(modules)
    graph = _graph()
    for name, deps in graph.items():
        if not _is_config(name):
            continue
        bad = {d for d in deps if d.startswith("rpk") and not _is_config(d)
               and not d.startswith("rpk.core") and d not in _CONFIG_MAY_IMPORT}
        assert not bad, f"{name} imports {sorted(bad)}"
    for name in _CONFIG_MAY_IMPORT:
        deps = _top_level_imports(modules[name], name, known)
        bad = {d for d in deps if d.startswith("rpk") and not d.startswith("rpk.core")
               and d not in _CONFIG_MAY_IMPORT}
        assert not bad, f"{name} imports {sorted(bad)} at its top"


def test_importing_the_config_loads_no_task_module() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, rpk.config; print(' '.join(m for m in sys.modules if m.startswith('rpk')))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    allowed = ("rpk", *_CONFIG_MAY_IMPORT)
    assert {m for m in out if not (m.startswith(("rpk.core", "rpk.config")) or m in allowed)} == set()


def _with_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing `rpk.tasks.specs` runs `rpk.tasks` (its `__init__`) first: each arrow
    gains arrows to the packages above its target."""
    full: dict[str, set[str]] = {}
    for name, deps in graph.items():
        more = set(deps)
        for d in deps:
            while "." in d:
                d = d.rpartition(".")[0]
                if d in graph and d != name:
                    more.add(d)
        full[name] = more
    return full


# Who may read the config: the assembly turns it into the parts' settings, `rpk.run`
# parses it; everything else takes records.
_READS_CONFIG = ("rpk.config", "rpk.assembly", "rpk.run")


def test_only_the_assembly_reads_the_config() -> None:
    """No chain of imports from a part of the run reaches `rpk.config`: the parts take the
    settings records `rpk.assembly` makes (a task module importing the config would carry
    it into the reward functions, and from there into the controller)."""
    graph = _with_parents(_graph())
    for name in sorted(graph):
        if any(name == r or name.startswith(r + ".") for r in _READS_CONFIG):
            continue
        chain = _reaches(graph, name, ("rpk.config",))
        assert chain is None, " -> ".join(chain or [])


def test_the_config_check_is_transitive() -> None:
    graph = _with_parents({"rpk.controller": {"rpk.reward.f"}, "rpk.reward": set(),
                           "rpk.reward.f": {"rpk.tasks.t"}, "rpk.tasks": set(),
                           "rpk.tasks.t": {"rpk.config"}, "rpk.config": set()})
    assert _reaches(graph, "rpk.controller", ("rpk.config",)) == [
        "rpk.controller", "rpk.reward.f", "rpk.tasks.t", "rpk.config"]
    assert _with_parents({"a.b.c": {"rpk.x.y"}, "rpk.x": set(), "rpk.x.y": set()})["a.b.c"] == {"rpk.x.y", "rpk.x"}


def _reaches(graph: dict[str, set[str]], start: str, banned: tuple[str, ...]) -> list[str] | None:
    """An import chain from `start` to a module under one of `banned`, if any: what a
    module imports runs with it, so a ban holds for the whole chain."""
    seen, paths = {start}, [[start]]
    while paths:
        path = paths.pop()
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt in seen or not nxt.startswith("rpk"):
                continue
            if any(nxt == b or nxt.startswith(b + ".") for b in banned):
                return path + [nxt]
            seen.add(nxt)
            paths.append(path + [nxt])
    return None


def test_the_trainer_imports_neither_the_fleet_nor_the_workers_side() -> None:
    """`rpk.train` depends on the trainer's side of the weight path (`rpk.sync.m2n_send`,
    `m2n_plan`, `adapter`), never on the rollout package nor on vLLM's worker code."""
    graph = _graph()
    for name in sorted(graph):
        if name == "rpk.train" or name.startswith("rpk.train."):
            chain = _reaches(graph, name, ("rpk.engine", "rpk.sync.worker"))
            assert chain is None, " -> ".join(chain or [])


def test_the_chain_finder_follows_imports_through_other_modules() -> None:
    graph = {"rpk.train.a": {"rpk.sync.b"}, "rpk.sync.b": {"rpk.sync.worker.c"}, "rpk.sync.worker.c": set()}
    assert _reaches(graph, "rpk.train.a", ("rpk.sync.worker",)) == ["rpk.train.a", "rpk.sync.b", "rpk.sync.worker.c"]
    assert _reaches(graph, "rpk.train.a", ("rpk.engine",)) is None


def test_the_cycle_finder_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_nothing_of_rpk() -> None:
    for name, deps in _graph().items():
        if name == "rpk.core" or name.startswith("rpk.core."):
            bad = {d for d in deps if d.startswith("rpk") and not d.startswith("rpk.core")}
            assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("layer", ["rpk.core", "rpk.sched", "rpk.loop"])
def test_pure_layers_import_no_torch_or_vllm(layer: str) -> None:
    for name, deps in _graph().items():
        if name == layer or name.startswith(layer + "."):
            heavy = {d for d in deps if d.split(".")[0] in ("torch", "vllm", "transformers")}
            assert not heavy, f"{name} imports {sorted(heavy)}"


def test_the_registries_hold_the_names_config_checks_against() -> None:
    from rpk.core import names
    from rpk.obs.trackers import TRACKERS
    from rpk.sched.policies import POLICIES
    from rpk.train.losses import LOSSES

    assert tuple(POLICIES) == names.POLICIES
    assert tuple(TRACKERS) == names.TRACKERS
    assert tuple(LOSSES) == names.LOSSES


# The function-level imports of rpk's own modules that stay, each with why (docs/design.md,
# "Imports"): every other module of rpk is imported at the top of the file that uses it.
_LAZY_RPK_IMPORTS = {
    # the task registry loads a task's modules when it is used, so that the config (which
    # reads the registry) and a run of one task never import another task's
    "rpk/tasks/__init__.py": {"rpk.tasks", "rpk.tasks.tiny", "rpk.tasks.tiny_multi"},
    # triton_stats imports triton at its top, which CPU machines lack
    "rpk/kernels/logprob.py": {"rpk.kernels.triton_stats"},
}


def _function_level_rpk_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import of rpk (or a relative one) inside a function."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if a.name.split(".")[0] == "rpk")
            elif in_function and isinstance(child, ast.ImportFrom):
                module = "." * child.level + (child.module or "")
                if child.level or module.split(".")[0] == "rpk":
                    found.append((child.lineno, module))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


def test_rpk_modules_are_imported_at_the_top() -> None:
    bad, used = [], {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        allowed = _LAZY_RPK_IMPORTS.get(rel, set())
        for line, module in _function_level_rpk_imports(ast.parse(path.read_text(), str(path))):
            if module in allowed:
                used.setdefault(rel, set()).add(module)
            else:
                bad.append(f"{rel}:{line} {module}")
    assert not bad, "rpk modules imported inside functions (move them to the top): " + ", ".join(bad)
    assert used == _LAZY_RPK_IMPORTS, "the allow-list names imports that are gone: keep it short"


def test_the_lazy_import_finder_finds_one() -> None:
    source = ("import torch\nfrom rpk import hub\n"
              "def f():\n    import torch\n    from rpk.sync import backends\n"
              "    def g():\n        from . import x\n        import rpk.core\n")
    assert _function_level_rpk_imports(ast.parse(source)) == [(5, "rpk.sync"), (7, "."), (8, "rpk.core")]
