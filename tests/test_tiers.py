"""The tiers' guard (tests/conftest.py): which commands are whole runs, and, in a pytest
session of its own, that a test not marked `slow` fails the moment it (or a fixture it
uses, or an asyncio subprocess of it) starts one, while a marked test, a dry run and
`--help` go on. Its processes run `python -c pass`: argv that looks like a whole run to
the guard, and costs nothing. And the rule that keeps fixtures shared: no test module
imports another."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import starts_a_whole_run

pytest_plugins = ["pytester"]

PY = sys.executable


@pytest.mark.parametrize("argv, whole", [
    ([PY, "-m", "rpk.run"], True),
    ([PY, "-m", "rpk.run", "--run.steps", "3", "--model.cache_dir", "/tmp/c"], True),
    ([PY, "-m", "rpk.run", "--run.dry_run", "true", "--model.path", "/m"], False),
    ([PY, "-m", "rpk.run", "--run.dry_run=true"], False),
    ([PY, "-m", "rpk.run", "--run.dry_run", "false"], True),
    ([PY, "-m", "rpk.run", "--help"], False),
    ([PY, "-m", "torch.distributed.run", "--nnodes", "2", "-m", "rpk.run", "--", "--run.steps", "2"], True),
    (["/usr/bin/torchrun", "--nproc-per-node", "2", "-m", "rpk.run"], True),
    ([PY, "-m", "torch.distributed.run", "--help"], False),
    ([PY, "-m", "bench.multi_turn", "--steps", "2"], True),
    ([PY, "-m", "bench.multi_turn", "--help"], False),
    ([PY, "-m", "rpk.cluster.host", "--node", "1"], False),  # an engine host, not a run
    ([PY, "-m", "tests.dist_harness", "4242"], False),
    ([PY, "-c", "import rpk.run"], False),
    ("python -m rpk.run", False),  # a shell line: the suite starts none
    ([b"python", b"-m", b"rpk.run"], True),
])
def test_what_counts_as_a_whole_run(argv, whole: bool) -> None:
    assert starts_a_whole_run(argv) is whole


INNER = '''
import asyncio
import subprocess
import sys

import pytest

RUN = [sys.executable, "-c", "pass", "-m", "rpk.run", "--run.steps", "1"]


def test_unmarked_starts_a_run():
    subprocess.run(RUN, check=True)


@pytest.mark.slow
def test_marked_starts_a_run():
    subprocess.run(RUN, check=True)


def test_unmarked_dry_run_and_help():
    subprocess.run([*RUN, "--run.dry_run", "true"], check=True)
    subprocess.run([*RUN, "--help"], check=True)


@pytest.fixture(scope="module")
def started_in_a_fixture():
    subprocess.run(RUN, check=True)


def test_unmarked_with_a_fixture_that_starts_a_run(started_in_a_fixture):
    pass


@pytest.mark.asyncio
async def test_unmarked_asyncio_subprocess():
    proc = await asyncio.create_subprocess_exec(*RUN)
    await proc.wait()


def test_unmarked_that_swallows_exceptions():
    try:
        subprocess.run(RUN, check=True)
    except Exception:
        pass
'''


def test_an_unmarked_test_that_starts_a_whole_run_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from tests.conftest import pytest_configure, pytest_runtest_protocol\n")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    slow: whole runs\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=3, errors=1)
    result.stdout.fnmatch_lines([
        "*test_unmarked_starts_a_run starts * -c pass -m rpk.run --run.steps 1: a whole run "
        "belongs to the slow tier: mark it `slow`*",
    ])
    failed = {r.nodeid.split("::")[-1] for r in result.reprec.getreports("pytest_runtest_logreport") if r.failed}
    assert failed == {
        "test_unmarked_starts_a_run", "test_unmarked_with_a_fixture_that_starts_a_run",
        "test_unmarked_asyncio_subprocess", "test_unmarked_that_swallows_exceptions",
    }


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [f"{node.module}.{a.name}" for a in node.names]  # `from tests import test_x` too
    return []


def test_no_test_module_imports_another() -> None:
    """A fixture imported from a test module is registered again in the importer (a
    session fixture then runs once per importing module), and a helper in a test module
    ties its users to that module: fixtures go to a conftest.py, helpers to modules of
    their own (docs/testing.md)."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node):
                parts = name.split(".")
                if parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:]):
                    found.append(f"{path.relative_to(tests.parent)}:{node.lineno} imports {name}")
                    break
    assert not found, "test modules imported by others:\n" + "\n".join(sorted(set(found)))


GROUPED = '''
import pytest

@pytest.fixture(scope="module")
def server():
    return 1

@pytest.fixture(scope="session")
def reference_run():
    return 2

def test_reads_the_reference(reference_run):
    pass

def test_uses_the_module_server(server):
    pass

def test_stands_alone(tmp_path):
    pass
'''


def test_xdist_groups_keep_module_fixtures_and_the_reference_run_on_one_worker(pytester: pytest.Pytester) -> None:
    """`.ci/run`'s slow tier runs under `--dist loadgroup`: a test of a module-scoped
    fixture is grouped with its module, a reader of `reference_run` with the other
    readers, and any other test is left to go wherever a worker is free."""
    pytest.importorskip("xdist")
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems\n")
    pytester.makepyfile(test_grouped=GROUPED)
    items, _ = pytester.inline_genitems("-p", "xdist", "-p", "no:cacheprovider")
    groups = {
        item.name: [m.args[0] for m in item.iter_markers("xdist_group")] for item in items
    }
    assert groups == {
        "test_reads_the_reference": ["reference_run"],
        "test_uses_the_module_server": ["test_grouped"],
        "test_stands_alone": [],
    }
