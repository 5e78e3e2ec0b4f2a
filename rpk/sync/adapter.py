"""LoRA adapters into vLLM replicas: every sync installs a new adapter version.

A LoRA run's replicas load the base model once, when they start, and are started with
vLLM's LoRA support (`enable_lora`). Each weight sync then carries the adapter alone
(the trainer's buckets hold its tensors, PEFT-named): `AdapterTransport` writes them
once as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
in /dev/shm when it has room, else the temp dir, and every replica installs it
through vLLM's own loading path (`AsyncLLM.add_lora`) under a name and id of its own,
`rpk-lora-v<version>`, then retires the previous one. vLLM keys its prefix cache by
the adapter's name and path, never its id: reusing a name with new weights would serve
KV computed under the old ones. Requests then carry the current adapter
(`VLLMEngine.add`).

A replica whose base weights were dropped (a level-2 sleep: `base_dropped`) cannot take
an adapter: the base never travels again, so the transport refuses it, naming it. A
replica started anew serves the base from disk and is stale until it gets the adapter.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from rpk.core.protocols import WeightBucket

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# vLLM 0.32's choices of max_lora_rank (`vllm.config.lora.MaxLoRARanks`).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds a rank-`rank` adapter."""
    for allowed in VLLM_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_RANKS[-1]}")


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One installed adapter: what a request's `LoRARequest` names."""

    name: str
    lora_id: int  # > 0, unique within the run
    path: str

    @classmethod
    def of(cls, version: int, path: Path) -> AdapterVersion:
        return cls(f"rpk-lora-v{version}", version + 1, str(path))


class AdapterLoading(Protocol):
    """A replica that installs adapters (`VLLMEngine`)."""

    name: str
    weight_version: int | None
    base_dropped: bool

    async def load_adapter(self, adapter: AdapterVersion, version: int) -> None: ...


def write_adapter(target: Path, config: Mapping[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """An adapter directory in PEFT's format (what vLLM and PEFT load)."""
    target.mkdir(parents=True, exist_ok=True)
    weights = {n: t.detach().to("cpu").contiguous() for n, t in tensors}
    if not weights:
        raise ValueError(f"{target}: an adapter with no tensors")
    save_file(weights, str(target / WEIGHTS_FILE), metadata={"format": "pt"})
    (target / CONFIG_FILE).write_text(json.dumps(dict(config), indent=1))


class AdapterDirs:
    """Where adapter versions live on one machine (one directory each, `v<version>`),
    and their removal once no replica serves them: vLLM reloads an adapter from its
    path if it ever drops it from its CPU cache, so a served one's files stay."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else Path(tempfile.mkdtemp(prefix="rpk-lora-", dir=_room()))
        self._serving: dict[int, str] = {}  # id(replica) -> the directory it serves

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def serving(self, replicas: Iterable[object], path: Path) -> None:
        """`replicas` now serve the adapter in `path`; directories nobody serves go."""
        self._serving.update({id(r): path.name for r in replicas})
        live = set(self._serving.values())
        for old in self.root.iterdir():
            if old.name not in live:
                shutil.rmtree(old, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class AdapterTransport:
    """The weight path of a LoRA fleet (a `WeightTransport`): each push is one adapter
    version, written once and installed on every replica. `config`: the adapter's
    `adapter_config.json` content (`rpk.train.lora.adapter_config`). Directories of
    versions no replica serves any more are removed."""

    def __init__(self, config: Mapping[str, Any], root: Path | None = None) -> None:
        self.config = dict(config)
        self.dirs = AdapterDirs(root)

    async def push(
        self, buckets: AsyncIterable[WeightBucket], replicas: Sequence[AdapterLoading], version: int
    ) -> None:
        dropped = [r.name for r in replicas if r.base_dropped]
        if dropped:
            raise RuntimeError(
                f"LoRA sync of version {version}: replicas {dropped} dropped their base weights "
                f"(a level-2 sleep); a LoRA run sends only the adapter, so its replicas must keep them"
            )
        tensors = [pair async for bucket in buckets for pair in bucket]
        path = self.dirs.path(version)
        await asyncio.to_thread(write_adapter, path, self.config, tensors)
        adapter = AdapterVersion.of(version, path)
        await asyncio.gather(*(r.load_adapter(adapter, version) for r in replicas))
        self.dirs.serving(replicas, path)

    async def close(self) -> None:
        self.dirs.remove()


def _room() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 256 * 2**20 else None
