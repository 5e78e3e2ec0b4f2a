"""The trainer's half of a checkpoint, written by every rank, readable at any world size.

- An HF model directory (config, tokenizer files, safetensors weights: one file, or several and an index),
  what vLLM and transformers load: the full weights are gathered bucket by bucket and
  written by rank 0 one shard file per bucket, so no rank holds more than a bucket.
- `trainer/`: model and optimizer state in `torch.distributed.checkpoint` (DCP) form,
  each rank writing its shards; loading reshards to the world it is loaded into (a run
  saved on 2 ranks resumes on 1 or on 4). Each rank's RNG state under a key of its own
  (DCP keeps one copy of a key saved by every rank). `trainer/meta.json`: version and the
  KL reference's directory.

Multi-node runs need the run directory on a filesystem every node sees.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rpk.core.protocols import WeightBucket
from rpk.gpu.launch import Sharding

STATE_DIR = "trainer"
META_FILE = "meta.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HF_SHARD_BYTES = 2 * 2**30

# What is copied from the source model directory next to the weights, so that the
# checkpoint is a complete model directory for transformers and vLLM.
_COPIED_FILES = (
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_COPIED_GLOBS = ("tokenizer*",)


def write_hf(
    target: Path, config: Any, source_dir: Path, buckets: Iterator[WeightBucket], writer: bool
) -> None:
    """Every rank iterates `buckets` (each takes part in gathering them); the `writer`
    (rank 0) writes one safetensors file per bucket, the index, the config (naming the
    dtype the weights are in) and the source's tokenizer files."""
    files: list[tuple[str, list[str]]] = []
    dtype = None
    for i, bucket in enumerate(buckets):
        if not writer:
            continue
        name = f"model-{i + 1:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
        dtype = dtype or next(iter(tensors.values())).dtype
        save_file(tensors, str(target / name), metadata={"format": "pt"})
        files.append((name, list(tensors)))
    if not writer:
        return
    if len(files) == 1:
        # One file takes transformers' single-file name and needs no index.
        (target / files[0][0]).rename(target / SINGLE_FILE)
    else:
        total = sum((target / name).stat().st_size for name, _ in files)
        weight_map = {tensor: name for name, names in files for tensor in names}
        (target / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if dtype is not None:
        # A source config that says bfloat16 over float32 weights makes vLLM warn on
        # every tensor it loads.
        config.dtype = dtype
    config.save_pretrained(target)
    for name in _copied_files(source_dir):
        shutil.copy2(source_dir / name, target / name)


def save_state(
    target: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    sharding: Sharding | None, meta: dict[str, Any],
) -> None:
    rank = sharding.rank if sharding is not None else 0
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    state = {"model": model_sd, "optim": optim_sd, f"rng_rank{rank}": torch.get_rng_state()}
    with _single_process_is_meant(sharding):
        dcp.save(state, checkpoint_id=str(target / STATE_DIR), no_dist=sharding is None)
    if rank == 0:
        (target / STATE_DIR / META_FILE).write_text(json.dumps(meta, indent=1))


def load_state(
    source: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    sharding: Sharding | None,
) -> dict[str, Any]:
    """Restore model, optimizer and (where this rank saved one) RNG state; returns the
    meta written with them."""
    rank = sharding.rank if sharding is not None else 0
    path = source / STATE_DIR
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path}: no trainer state (a checkpoint of another rpk?)")
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    rng_key = f"rng_rank{rank}"
    saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if rng_key in saved_keys:
        state[rng_key] = torch.empty_like(torch.get_rng_state())
    with _single_process_is_meant(sharding):
        dcp.load(state, checkpoint_id=str(path), no_dist=sharding is None)
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    return json.loads((path / META_FILE).read_text())


@contextlib.contextmanager
def _single_process_is_meant(sharding: Sharding | None) -> Iterator[None]:
    """DCP warns when it runs without a process group; unsharded, that is the plan."""
    with warnings.catch_warnings():
        if sharding is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _copied_files(source: Path) -> list[str]:
    names = {n for n in _COPIED_FILES if (source / n).is_file()}
    for pattern in _COPIED_GLOBS:
        names.update(p.name for p in source.glob(pattern) if p.is_file())
    return sorted(names)
