"""Methods vLLM grafts onto its worker class (`worker_extension_cls`), so that
`AsyncLLM.collective_rpc("rpk_reload_weights", ...)` runs them inside the worker.

Imported by the worker, never by rpk's main process.
"""

from __future__ import annotations

from typing import Iterator

import torch
from safetensors import safe_open


class RpkWorkerExtension:
    def rpk_reload_weights(self, paths: list[str]) -> None:
        """Load the HF-named tensors of safetensors files (one per bucket) into the
        running model, in one pass.

        `Worker.reload_weights` is the in-place path: a plain second `model.load_weights`
        fails on CPU because the linear layers repacked their weights after the first
        load. An iterator (not `weights_path`) keeps vLLM from repointing the model
        config at a file that is deleted right after this call.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )

        self.reload_weights(weights_iterator=_tensors(paths))  # type: ignore[attr-defined]
        # A tied LM head shares the embedding's parameter, so the reload skips it as an
        # alias and never re-processes it: on CPU it keeps computing logits from the
        # GEMM weights packed at start-up. Re-pack it from the parameter's new values
        # (a no-op on GPU, where the head reads the parameter itself).
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            if isinstance(module, ParallelLMHead) and isinstance(
                module.quant_method, UnquantizedEmbeddingMethod
            ):
                module.quant_method.process_weights_after_loading(module)


def _tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files, read as the loader asks for it."""
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
