"""Methods vLLM grafts onto its worker class (`worker_extension_cls`), so that
`AsyncLLM.collective_rpc("rpk_reload_weights", ...)` runs them inside the worker.

Imported by the worker, never by rpk's main process.
"""

from __future__ import annotations

from safetensors import safe_open


class RpkWorkerExtension:
    def rpk_reload_weights(self, path: str) -> None:
        """Load the HF-named tensors of a safetensors file into the running model.

        `Worker.reload_weights` is the in-place path: a plain second `model.load_weights`
        fails on CPU because the linear layers repacked their weights after the first
        load. An iterator (not `weights_path`) keeps vLLM from repointing the model
        config at a file that is deleted right after this call.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )

        with safe_open(path, framework="pt") as f:
            self.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=((name, f.get_tensor(name)) for name in f.keys())
            )
        # A tied LM head shares the embedding's parameter, so the reload skips it as an
        # alias and never re-processes it: on CPU it keeps computing logits from the
        # GEMM weights packed at start-up. Re-pack it from the parameter's new values
        # (a no-op on GPU, where the head reads the parameter itself).
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            if isinstance(module, ParallelLMHead) and isinstance(
                module.quant_method, UnquantizedEmbeddingMethod
            ):
                module.quant_method.process_weights_after_loading(module)
