"""Prompt datasets in veRL's layout, checked row by row before any training starts.

A row is a mapping with
  prompt:        a chat message list [{"role": ..., "content": ...}, ...]
  data_source:   which reward function scores it
  reward_model:  {"ground_truth": ..., "style": ...}
  extra_info:    optional mapping handed to the reward function
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rpk.core.errors import UserError
from rpk.core.records import Prompt

MAX_ERRORS_SHOWN = 10


class DataError(UserError, ValueError):
    """Bad input data; the message names the file, the row and the problem."""


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


_REQUIRED = ("prompt", "data_source", "reward_model")

# (where, row): `where` names the row in messages: "line N" of a jsonl file (blank lines
# count, as an editor shows them), "row N" (from 1) of a parquet file.
Numbered = tuple[str, Any]


def read_rows(path: Path) -> list[Numbered]:
    """Rows of a .jsonl / .ndjson or .parquet file, each with where it stands."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(f"{path}: unsupported file type {suffix!r} (use .jsonl or .parquet)")


def _read_jsonl(path: Path) -> list[Numbered]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: line {lineno}: not UTF-8 ({e.reason} at byte {e.start})"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {lineno}: not valid JSON ({e.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[Numbered]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"{path}: cannot read parquet: {e}") from None
    # A column absent from the file's schema is one problem, not one per row.
    missing = [c for c in _REQUIRED if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: no column {', '.join(map(repr, missing))} "
            f"(the file has {', '.join(table.column_names) or 'no columns'})"
        )
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def _row_problem(row: Any) -> str | None:
    """What is wrong with a row's shape, or None."""
    if not isinstance(row, Mapping):
        return f"expected an object, got {type(row).__name__}"
    for key in _REQUIRED:
        if key not in row:
            return f"missing column {key!r}"
    messages = row["prompt"]
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        return "'prompt' must be a non-empty list of chat messages"
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(
            m.get("content"), str
        ):
            return f"'prompt'[{j}] must be a message with string 'role' and 'content'"
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        return "'data_source' must be a non-empty string"
    rm = row["reward_model"]
    if not isinstance(rm, Mapping) or "ground_truth" not in rm:
        return "'reward_model' must be an object with a 'ground_truth'"
    if rm["ground_truth"] is None:
        return "'reward_model.ground_truth' is null"
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        return "'extra_info' must be an object when present"
    return None


def to_prompts(
    rows: Iterable[Numbered],
    source: str,
    tokenizer: ChatTokenizer,
    max_prompt_tokens: int,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[Prompt]:
    """Validate and tokenise every row; raise one DataError listing the bad rows. A
    prompt's uid is `source:where`, stable as long as the file is. `tools`: OpenAI tool
    schemas a multi-turn run's template renders into the prompt."""
    extra = {"tools": [dict(t) for t in tools]} if tools else {}
    prompts: list[Prompt] = []
    errors: list[str] = []
    for where, row in rows:
        problem = _row_problem(row)
        if problem is None:
            text = tokenizer.apply_chat_template(
                list(row["prompt"]), tokenize=False, add_generation_prompt=True, **extra
            )
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) > max_prompt_tokens:
                problem = (
                    f"prompt is {len(ids)} tokens, longer than data.max_prompt_tokens="
                    f"{max_prompt_tokens}"
                )
        if problem is not None:
            errors.append(f"{source}: {where}: {problem}")
            continue
        prompts.append(
            Prompt(
                uid=f"{source}:{where}",
                token_ids=ids,
                data_source=row["data_source"],
                ground_truth=row["reward_model"]["ground_truth"],
                extra_info=dict(row.get("extra_info") or {}),
                text=text,
                reward_style=str(row["reward_model"].get("style") or "rule"),
                last_user=last_user(row["prompt"]),
            )
        )
    if errors:
        more = len(errors) - MAX_ERRORS_SHOWN
        shown = "\n  ".join(errors[:MAX_ERRORS_SHOWN])
        tail = f"\n  ... and {more} more bad rows" if more > 0 else ""
        raise DataError(f"{len(errors)} bad row(s):\n  {shown}{tail}")
    if not prompts:
        raise DataError(f"{source}: no rows")
    return prompts


def last_user(messages: Sequence[Mapping[str, Any]]) -> str:
    """The content of the last user message ("" when there is none)."""
    return next((str(m["content"]) for m in reversed(messages) if m["role"] == "user"), "")


def numbered(rows: Sequence[Any]) -> list[Numbered]:
    """Rows made in memory (the built-in task), numbered from 1 like parquet rows."""
    return [(f"row {i}", row) for i, row in enumerate(rows, 1)]


def load_files(
    paths: Sequence[str | Path], tokenizer: ChatTokenizer, max_prompt_tokens: int,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[Prompt]:
    prompts: list[Prompt] = []
    for p in paths:
        path = Path(p)
        prompts.extend(to_prompts(read_rows(path), str(path), tokenizer, max_prompt_tokens, tools))
    return prompts
