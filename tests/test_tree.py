"""What the repository tracks stays source-sized: a binary committed by accident (a 10 MB
wheel once was) is a failure here, not a surprise in every clone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1 << 20  # bytes

# Tracked files allowed past LIMIT, each with why. Empty: nothing needs to be.
ALLOWED: dict[str, str] = {}


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def _over(names: list[str], root: Path) -> dict[str, int]:
    sizes = {name: (root / name).stat().st_size for name in names if (root / name).is_file()}
    return {name: size for name, size in sizes.items() if size > LIMIT and name not in ALLOWED}


def test_no_tracked_file_is_over_1_mb() -> None:
    big = _over(_tracked(), ROOT)
    assert not big, f"tracked files over 1 MB (remove them, or name them in ALLOWED with why): {big}"


def test_the_size_check_finds_a_big_file(tmp_path: Path) -> None:
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "tool.whl").write_bytes(b"\0" * (LIMIT + 1))
    assert _over(["small.py", "tool.whl", "deleted.txt"], tmp_path) == {"tool.whl": LIMIT + 1}
