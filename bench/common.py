"""What every benchmark shares: config overrides after `--`, a short `rpk.run` in a
throwaway run directory, and the JSON result file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Sequence


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, rpk config overrides given after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def write_json(path: Path | None, result: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def run_steps(argv: Sequence[str]) -> tuple[int, list[dict[str, Any]]]:
    """`python -m rpk.run argv` with its run directory in a temporary folder: its exit
    code and step records (none when it failed; it has said why)."""
    from rpk import run
    from rpk.obs.metrics import read_records

    with tempfile.TemporaryDirectory() as tmp:
        code = run.main([*argv, "--run.out_dir", tmp])
        return code, read_records(Path(tmp) / "latest" / "metrics.jsonl") if code == 0 else []
