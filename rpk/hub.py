"""`model.path` as a Hugging Face Hub id (`Qwen/Qwen2.5-7B-Instruct`): resolved by
huggingface_hub into its usual cache (`HF_HOME`, or `model.hub_cache`), and found there
without the network once cached (`HF_HUB_OFFLINE=1`, or when the Hub cannot be reached).
Only what a run loads is fetched: config, tokenizer, generation config and safetensors
weights; the chat template is the tokenizer's own."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rpk.core.errors import ConfigError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def is_hub_id(path: str) -> bool:
    """A name like `org/model` that is not a local path."""
    return _HUB_ID.fullmatch(path) is not None and not Path(path).exists()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(repo_id: str, cache_dir: str | None = None, config_only: bool = False) -> Path:
    """The local directory of `repo_id`'s files (only config.json with `config_only`: a
    dry run). Blocking (a download)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    offline = _offline()
    try:
        if config_only:
            return Path(hf_hub_download(repo_id, "config.json", cache_dir=cache_dir,
                                        local_files_only=offline)).parent
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=_PATTERNS,
                                      local_files_only=offline))
    except Exception as e:  # huggingface_hub's errors: not found, offline and not cached, ...
        where = f" (offline: looked in {cache_dir or 'the HF cache'})" if offline else ""
        raise ConfigError(
            f"model.path={repo_id!r}: not a local directory, and the Hub id could not be "
            f"resolved{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
