"""The trainer's half of a checkpoint, written by every rank, readable at any world size.

- An HF model directory (config, tokenizer files, safetensors weights: one file, or several and an index),
  what vLLM and transformers load: the full weights are gathered bucket by bucket and
  written by rank 0 one shard file per bucket, so no rank holds more than a bucket.
- `trainer/`: model and optimizer state in `torch.distributed.checkpoint` (DCP) form,
  each rank writing its shards; loading reshards to the world it is loaded into (a run
  saved on 2 ranks resumes on 1 or on 4). Each rank's RNG state under a key of its own
  (DCP keeps one copy of a key saved by every rank). `trainer/meta.json`: version and the
  KL reference's directory.

Every rank checks up front that its part fits on the disk. A failed write (a full disk,
an I/O error) on any rank is raised on every rank, after the collectives the others
are in, so that all ranks stop the save together (`rpk.manifest.WriteFailed`).

Multi-node runs need the run directory on a filesystem every node sees.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rpk.core.protocols import WeightBucket
from rpk.gpu.launch import Sharding
from rpk.manifest import WriteFailed, check_free, describe
from rpk.sync.adapter import write_adapter

STATE_DIR = "trainer"
META_FILE = "meta.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HF_SHARD_BYTES = 2 * 2**30
_TENSOR_FRAMING = 2048

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


def save(
    target: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    sharding: Sharding | None, hf: tuple[Any, Path, Iterator[WeightBucket]],
    meta: dict[str, Any],
) -> None:
    """The whole trainer half of a checkpoint on this rank. `hf`: the model config, the
    source directory and the weight buckets `write_hf` writes."""
    rank = sharding.rank if sharding is not None else 0
    writer = rank == 0
    config, source_dir, buckets = hf
    failed: OSError | None = None
    try:
        copied = sum((source_dir / n).stat().st_size for n in _copied_files(source_dir)) if writer else 0
        check_free(target, checkpoint_bytes(policy, optimizer, writer) + copied)
        if writer:
            target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        failed = e
    failed = write_hf(target, config, source_dir, buckets, writer and failed is None) or failed
    if writer and failed is None:
        try:
            meta_path = target / STATE_DIR / META_FILE
            meta_path.parent.mkdir(exist_ok=True)
            meta_path.write_text(json.dumps(meta, indent=1))
        except OSError as e:
            failed = e
    _agree(failed, sharding)
    save_state(target, policy, optimizer, sharding)


def save_adapter(
    target: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    sharding: Sharding | None, adapter: tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]],
    meta: dict[str, Any],
) -> None:
    """A LoRA trainer's half of a checkpoint: the adapter in PEFT's format
    (`adapter_config.json`, `adapter_model.safetensors`: what PEFT and vLLM load, the
    base named in the config), written by rank 0, every rank gathering each tensor; then
    the adapters' and optimizer's state in DCP form, the frozen base left out (it is the
    run's model directory, unchanged)."""
    rank = sharding.rank if sharding is not None else 0
    config, named = adapter
    tensors = [(name, _gathered(t)) for name, t in named]
    failed: OSError | None = None
    if rank == 0:
        try:
            check_free(target, checkpoint_bytes(policy, optimizer, True, frozen=False))
            write_adapter(target, config, tensors)
            (target / STATE_DIR).mkdir(exist_ok=True)
            (target / STATE_DIR / META_FILE).write_text(json.dumps(meta, indent=1))
        except OSError as e:
            failed = e
    _agree(failed, sharding)
    save_state(target, policy, optimizer, sharding, frozen=False)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor.detach()


def write_hf(
    target: Path, config: Any, source_dir: Path, buckets: Iterator[WeightBucket], writer: bool,
) -> OSError | None:
    """Every rank iterates `buckets` to the end (each takes part in gathering them); the
    `writer` (rank 0) writes one safetensors file per bucket, the index, the config
    (naming the dtype the weights are in) and the source's tokenizer files. A failed
    write stops the writing, not the gathering, and is returned."""
    files: list[tuple[str, list[str]]] = []
    dtype = None
    failed: OSError | None = None
    for i, bucket in enumerate(buckets):
        if not writer or failed is not None:
            continue
        name = f"model-{i + 1:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
        dtype = dtype or next(iter(tensors.values())).dtype
        try:
            save_file(tensors, str(target / name), metadata={"format": "pt"})
        except OSError as e:
            failed = e
        else:
            files.append((name, list(tensors)))
    if not writer or failed is not None:
        return failed
    try:
        _write_hf_rest(target, config, source_dir, files, dtype)
    except OSError as e:
        return e
    return None


def _write_hf_rest(
    target: Path, config: Any, source_dir: Path, files: list[tuple[str, list[str]]],
    dtype: torch.dtype | None,
) -> None:
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
    sharding: Sharding | None, frozen: bool = True,
) -> None:
    """Model and optimizer state in DCP form, each rank its shards (`frozen=False`: the
    trainable parameters' alone). DCP itself shares a failed write with every rank."""
    rank = sharding.rank if sharding is not None else 0
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=StateDictOptions(ignore_frozen_params=not frozen))
    state = {"model": model_sd, "optim": optim_sd, f"rng_rank{rank}": torch.get_rng_state()}
    try:
        with _single_process_is_meant(sharding):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target / STATE_DIR)), no_dist=sharding is None)
    except CheckpointException as e:
        first = min(e.failures)
        error = e.failures[first][0]
        if not isinstance(error, OSError):
            raise RuntimeError(str(e)) from None
        raise WriteFailed(error.errno, _on_rank(first, sharding) + describe(error)) from None


def _agree(failed: OSError | None, sharding: Sharding | None) -> None:
    """Raise `failed` of any rank on every rank (a collective: every rank calls it)."""
    if sharding is None:
        if failed is not None:
            raise failed
        return
    said: list[Any] = [None] * sharding.world
    mine = None if failed is None else (failed.errno, describe(failed))
    dist.all_gather_object(said, mine, group=sharding.group)
    for rank, what in enumerate(said):
        if what is not None:
            raise WriteFailed(what[0], _on_rank(rank, sharding) + what[1])


def _on_rank(rank: int, sharding: Sharding | None) -> str:
    return f"rank {rank}: " if sharding is not None else ""


def checkpoint_bytes(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, writer: bool, frozen: bool = True,
) -> int:
    """What this rank's part of a checkpoint takes on disk, measured from its tensors:
    the full weights (the writer), its shard of them and of the optimizer state (DCP,
    which stores each tensor apart: about 2 KiB of framing each). `frozen=False`: the
    trainable parameters alone (a LoRA checkpoint)."""
    params = [p for p in policy.parameters() if frozen or p.requires_grad]  # unique: a tied weight counts once
    full = sum(p.numel() * p.element_size() for p in params) if writer else 0
    optim = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    local = sum(_local_bytes(t) for t in (*params, *optim))
    return full + local + _TENSOR_FRAMING * (len(params) + len(optim))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def load_state(
    source: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
    sharding: Sharding | None, frozen: bool = True,
) -> dict[str, Any]:
    """Restore model (`frozen=False`: its trainable parameters), optimizer and (where
    this rank saved one) RNG state; returns the meta written with them."""
    rank = sharding.rank if sharding is not None else 0
    path = source / STATE_DIR
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path}: no trainer state (a checkpoint of another rpk?)")
    # Without the frozen base the loaded dict is partial by design; DCP itself refuses a
    # requested key the checkpoint lacks.
    options = StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)
    model_sd, optim_sd = get_state_dict(policy, optimizer, options=options)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    rng_key = f"rng_rank{rank}"
    saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if rng_key in saved_keys:
        state[rng_key] = torch.empty_like(torch.get_rng_state())
    with _single_process_is_meant(sharding):
        dcp.load(state, checkpoint_id=str(path), no_dist=sharding is None)
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
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


def copy_model_files(source: Path, target: Path) -> None:
    """The source model's tokenizer and generation files beside weights written elsewhere."""
    for name in _copied_files(source):
        shutil.copy2(source / name, target / name)


def _copied_files(source: Path) -> list[str]:
    names = {n for n in _COPIED_FILES if (source / n).is_file()}
    for pattern in _COPIED_GLOBS:
        names.update(p.name for p in source.glob(pattern) if p.is_file())
    return sorted(names)
