"""Methods vLLM grafts onto its worker class (`worker_extension_cls`), so that
`AsyncLLM.collective_rpc("rpk_reload_weights", ...)` runs them inside the worker.

Imported by the worker, never by rpk's main process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from safetensors import safe_open

from rpk.sync.adapter import WEIGHTS_FILE
from rpk.sync.verify import digest
from rpk.sync.worker import spec
from rpk.sync.worker.base import RpkWeightEngine, repack_tied_head


class RpkWorkerExtension:
    # Grafted onto vLLM's worker, which runs no __init__ of ours: defaults, replaced
    # (never changed in place) per worker.
    _rpk_record_digests: bool = False
    _rpk_digests: dict[str, str] = {}

    def rpk_reload_weights(self, paths: list[str]) -> None:
        """Load the HF-named tensors of safetensors files (one per bucket) into the
        running model, in one pass.

        `Worker.reload_weights` is the in-place path: a plain second `model.load_weights`
        fails on CPU because the linear layers repacked their weights after the first
        load. An iterator (not `weights_path`) keeps vLLM from repointing the model
        config at a file that is deleted right after this call.
        """
        digests: dict[str, str] = {}
        record = self._rpk_record_digests

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _tensors(paths):
                if record:
                    digests[name] = digest(tensor)
                yield name, tensor

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]
        self._rpk_digests = digests
        repack_tied_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def rpk_adapter_files(self, path: str) -> None:
        """A LoRA adapter directory this worker is about to load (`add_lora` reads it
        there): a verified run records the sha256 of each of its tensors, PEFT-named."""
        if self._rpk_record_digests:
            self._rpk_digests = {n: digest(t) for n, t in _tensors([f"{path}/{WEIGHTS_FILE}"])}

    def rpk_record_digests(self, on: bool) -> None:
        """Record a sha256 per HF name of every weight received (`rpk_weight_digests`),
        whichever path it came by (spool files, or rpk's own engines)."""
        self._rpk_record_digests = on
        engine = self._rpk_engine()
        if engine is not None:
            engine.record_digests = on

    def rpk_weight_digests(self) -> dict[str, str]:
        """HF name -> sha256 of the last update this worker received."""
        engine = self._rpk_engine()
        if engine is not None and engine.digests:
            return dict(engine.digests)
        return dict(self._rpk_digests)

    def rpk_spec_round(self, schedule: Sequence[Sequence[int]], sources: Sequence[int],
                       prompts: Sequence[Sequence[Any]]) -> None:
        """A round's draft-length schedule, draft sources and its prompts' draft texts
        (`rpk.sync.worker.spec`); nothing without rpk's proposer."""
        spec.set_round(self, schedule, sources, prompts)

    def rpk_spec_add(self, prompts: Sequence[Sequence[Any]]) -> None:
        """More draft texts mid-round (siblings that finished)."""
        spec.add(self, prompts)

    def rpk_spec_kernels(self) -> str:
        """Correct vLLM's CPU fallback the rejection sampler needs (`spec.install_cpu_kernels`)."""
        return spec.install_cpu_kernels()

    def rpk_spec_take(self) -> dict[int, list[int]]:
        """What each draft source's drafts did since the last call."""
        return spec.take(self)

    def _rpk_engine(self) -> RpkWeightEngine | None:
        """rpk's own transfer engine of this worker (`rpk.sync.worker`), if it has one
        (vLLM's worker holds its engine, or None, in `weight_transfer_engine`)."""
        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        return engine if isinstance(engine, RpkWeightEngine) else None


def _tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, read as the loader asks for it."""
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
