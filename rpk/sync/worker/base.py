"""What every rpk worker engine shares: vLLM's `WeightTransferEngine` protocol with
the digests of what it received (`record_digests` / `digests`, for `run.verify_sync`,
`rpk.sync.verify`) and vLLM's layerwise reload around each update.

A subclass receives; `load` hands what it received to the model (recording digests
first), `reloads` says whether an update goes through the reload at all (m2n's
in-place destinations do not).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from rpk.sync.verify import digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

InitInfo = TypeVar("InitInfo")
UpdateInfo = TypeVar("UpdateInfo")


class RpkWeightEngine(WeightTransferEngine[InitInfo, UpdateInfo]):  # type: ignore[type-var]
    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.record_digests = False
        self.digests: dict[str, str] = {}  # HF name -> sha256, of the last update

    @property
    def reloads(self) -> bool:
        return True

    def start_weight_update(self) -> None:
        self.digests = {}
        if self.reloads:
            start_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.reloads:
            finish_reload(self.model, self.model_config)

    def record(self, name: str, tensor: torch.Tensor) -> None:
        """The sha256 of a whole tensor as received, when the run verifies."""
        if self.record_digests:
            self.digests[name] = digest(tensor)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`weights` (HF-named, whole) into the model through its `load_weights`."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)


def repack_tied_head(model: torch.nn.Module) -> None:
    """A tied LM head shares the embedding's parameter, so vLLM's reload skips it as an
    alias and never re-processes it: on CPU it keeps computing logits from the GEMM
    weights packed at start-up. Re-pack it from the parameter's new values (a no-op on
    GPU, where the head reads the parameter itself)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and isinstance(
            module.quant_method, UnquantizedEmbeddingMethod
        ):
            module.quant_method.process_weights_after_loading(module)


def start_reload(model: torch.nn.Module) -> None:
    """Before the first bucket: vLLM's layerwise reload takes checkpoint-format weights."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    """After the last bucket: every layer processed (re-packed on CPU), the tied head too."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    repack_tied_head(model)
