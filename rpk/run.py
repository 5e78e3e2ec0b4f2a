"""`python -m rpk.run`: argv -> config -> the run (`rpk.controller`).

On a CPU machine with no arguments it builds rpk's tiny model, generates the built-in
long-tail arithmetic task, starts vLLM's async engine and trains with GRPO.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from rpk import checkpoint, config, controller
from rpk.config import ConfigError
from rpk.core.errors import UserError
from rpk.obs.progress import LiveProgress, summary_table


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            yield from _leaves(inner)
    else:
        yield e


def run_async(cfg: Config, coro: Any) -> Any:
    if cfg.run.uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def quiet_libraries() -> None:
    """vLLM logs every weight reload and transformers draws a bar per load and save;
    rpk shows its own progress. VLLM_LOGGING_LEVEL=INFO brings vLLM's logs back."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config.from_argv(args)
    except ConfigError as e:
        print(f"rpk: config error: {e}", file=sys.stderr)
        return 2
    quiet_libraries()
    run_dir = checkpoint.new_run_dir(Path(cfg.run.out_dir))
    (run_dir / "config.yaml").write_text(config.dump_yaml(cfg))
    progress = LiveProgress(cfg.run.steps, live=cfg.run.progress)
    try:
        with progress:
            result = run_async(cfg, controller.run(cfg, run_dir, progress))
    except Exception as e:
        # Errors in what the user gave (config, data, model, reward) get one clear line
        # each, also when they come out of a TaskGroup; anything else is a bug: traceback.
        leaves = list(_leaves(e))
        if not all(isinstance(x, UserError) for x in leaves):
            raise
        for x in leaves:
            progress.console.print(f"rpk: {x}", style="red", markup=False)
        return 2
    progress.console.print(summary_table(result.summary, str(run_dir)))
    progress.console.print(f"final checkpoint: {result.last_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
