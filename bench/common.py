"""What every benchmark shares: config overrides after `--`, and the JSON result file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
