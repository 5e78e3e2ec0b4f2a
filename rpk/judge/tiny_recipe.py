"""The tiny judge's build recipe (`rpk.tasks.tiny.Recipe`): its corpus and cases
(`rpk.judge.tiny`), and the held-out figures its build records (`rpk.judge.tiny_eval`,
which reads the cases, so the recipe sits in a module of its own)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

from rpk.judge.tiny import CODE_VERSION, corpus, examples
from rpk.judge.tiny_eval import build_figures
from rpk.tasks.tiny import Recipe, TinySpec, build_tiny_model, model_dir

JUDGE = Recipe("judge", CODE_VERSION, corpus, examples, build_figures, threads=1)


def build_judge_model(spec: TinySpec, cache_root: pathlib.Path,
                      log: Callable[[str], None] = print) -> pathlib.Path:
    """The tiny judge's directory for `spec`, built on a cache miss."""
    return build_tiny_model(spec, cache_root, log=log, recipe=JUDGE)


def judge_dir(spec: TinySpec, cache_root: pathlib.Path) -> pathlib.Path:
    """Where `build_judge_model` puts (or finds) the judge for `spec`."""
    return model_dir(spec, cache_root, JUDGE)
