"""The suite's shared fixtures, and its two tiers (docs/testing.md).

Fixtures live here, not in test modules: a fixture imported into another module is
registered again there, so a "session" fixture would run once per importing module.

Tiers: a test that starts a whole `python -m rpk.run`, torchrun or bench process is marked
`slow`; the README's line (`pytest -m 'not slow'`) skips those and CI runs them after.
A guard fails an unmarked test that starts one anyway, and the summary prints the tier's
total and its slowest tests.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def rpk_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-model cache every whole run of the session passes as `--model.cache_dir`.
    rpk keys it by the model's spec: the first run of a spec builds, the rest find it.
    RPK_TEST_CACHE names one to keep across sessions."""
    kept = os.environ.get("RPK_TEST_CACHE")
    if kept:
        return Path(kept)
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker has its own basetemp below one shared root: the
    # workers share one cache, so that a spec is built once for the whole run.
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "rpk-cache"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 (tests/trainers.py) for the trainer's tests."""
    from tests import trainers  # torch and transformers: only where a test asks

    return trainers.tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), seed=1234)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen's tied embedding / LM head: the case FSDP must get right (one parameter,
    two names, the head weight read inside the root's forward)."""
    from tests import trainers

    return trainers.tiny_qwen2(tmp_path_factory.mktemp("tied-qwen2"), seed=7, tied=True, hints=False)


@pytest.fixture(scope="module")
def restore_torch_threads() -> Iterator[None]:
    """For modules whose trainers run with torch_threads=1 (tiny shapes: two threads on a
    shared 2-core box spend more time contending than computing): the setting is
    process-wide, so put it back for whatever runs next."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def collective_guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Every collective rpk issues is of a device its group serves on the GPU box
    (tests/collective_guard.py), for one test."""
    from rpk.gpu.launch import default_backend
    from tests.collective_guard import guarding  # torch: only where a test asks

    with guarding(default_backend(True), monkeypatch) as guard:
        yield guard
    assert not guard.violations, "\n".join(guard.violations)


# -- the tiers' guard -------------------------------------------------------------------

_WHOLE_MODULES = ("rpk.run", "torch.distributed.run")
# The items running now, innermost last (a test of the guard runs a pytest inside one).
_RUNNING: list[pytest.Item] = []


def starts_a_whole_run(argv: Any) -> bool:
    """Whether `argv` (Popen's first argument) starts a whole run: `python -m rpk.run`,
    torchrun or `python -m torch.distributed.run`, or `python -m bench.X`, unless it
    only asks for `--help` or a `--run.dry_run true`."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        return False  # a shell line or a bare program: none of the suite's runs
    words = [os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in argv]
    modules = [b for a, b in zip(words, words[1:], strict=False) if a == "-m"]
    whole = (
        any(m in _WHOLE_MODULES or m.startswith("bench.") for m in modules)
        or (bool(words) and Path(words[0]).name == "torchrun")
    )
    return whole and "--help" not in words and not _dry_run(words)


def _dry_run(words: Sequence[str]) -> bool:
    for a, b in zip(words, [*words[1:], ""], strict=True):
        if a == "--run.dry_run" and b.lower() in ("true", "1", "yes"):
            return True
        if a.startswith("--run.dry_run=") and a.split("=", 1)[1].lower() in ("true", "1", "yes"):
            return True
    return False


_REAL_POPEN_INIT = subprocess.Popen.__init__
_STARTED = pytest.StashKey[float]()


def _guarded_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
    if _RUNNING and _RUNNING[-1].get_closest_marker("slow") is None and starts_a_whole_run(args):
        pytest.fail(
            f"{_RUNNING[-1].nodeid} starts {' '.join(map(str, args))[:200]}: a whole run belongs "
            "to the slow tier: mark it `slow` (docs/testing.md)", pytrace=False,
        )
    _REAL_POPEN_INIT(self, args, *rest, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    # Once, for the process: asyncio's subprocesses go through Popen too, and fixtures of
    # any scope are set up inside some item's protocol, where the guard sees the item.
    subprocess.Popen.__init__ = _guarded_init  # type: ignore[method-assign]
    config.stash[_STARTED] = time.monotonic()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (`.ci/run` runs the slow tier on two workers: a whole run
    keeps about one of the two cores busy). A test that asks for a module-scoped fixture
    (a server, a fleet) goes with its module, so that the fixture starts once; those that
    read the session's `reference_run` share one group, so that it runs once; every
    other test is scheduled alone, wherever a worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        names = getattr(item, "fixturenames", ())
        # pytest keeps no public record of a requested fixture's scope: `_fixtureinfo`,
        # as pytest's own `--setup-plan` reads it.
        info = getattr(item, "_fixtureinfo", None)
        scopes = {defs[-1].scope for defs in info.name2fixturedefs.values()} if info else set()
        if "reference_run" in names:
            item.add_marker(pytest.mark.xdist_group("reference_run"))
        elif "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _RUNNING.append(item)
    try:
        return (yield)
    finally:
        _RUNNING.pop()


# -- the tier's time --------------------------------------------------------------------


def _tier(config: pytest.Config) -> str:
    expr = config.option.markexpr
    return {"not slow": "fast tier", "slow": "slow tier", "": "all tiers"}.get(expr, f"-m {expr!r}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The tier's total and its 10 slowest tests (setup, call and teardown together).
    Reported, never enforced: times on a shared 2-core machine vary too much to fail on."""
    took: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                took[report.nodeid] += report.duration
    if not took:
        return
    wall = time.monotonic() - config.stash.get(_STARTED, time.monotonic())
    terminalreporter.section(f"{_tier(config)}: time")
    terminalreporter.write_line(
        f"{len(took)} tests, {sum(took.values()):.1f} s in tests, {wall:.1f} s wall "
        f"({wall / 60:.1f} min)"
    )
    for nodeid, seconds in sorted(took.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
