"""The fused log-prob head: per-token log-prob and entropy from hidden states and the LM
head weight, without the [tokens x vocab] logits, through one autograd function whose
forward statistics come from Triton (CUDA) or chunked torch (anywhere) and whose
backward is always the chunked torch recompute (`rpk.kernels.chunked`)."""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from rpk.kernels.chunked import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_CHUNK_VOCAB,
    LogprobEntropyFunction,
    StatsFn,
    chunked_stats,
    validate_inputs,
)

Impl = Literal["auto", "torch", "triton"]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _stats_fn(hidden: torch.Tensor, impl: Impl) -> StatsFn:
    if impl == "triton" or (impl == "auto" and hidden.is_cuda and triton_available()):
        # Imported here: the module imports triton at its top, which CPU machines lack.
        from rpk.kernels.triton_stats import triton_stats

        return triton_stats
    if impl not in ("auto", "torch"):
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    return chunked_stats


def token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target under softmax(hidden @ weight.T / temperature) and the
    entropy of that distribution, float32 [N] each (float64 stays float64),
    differentiable w.r.t. hidden and weight (the entropy too).

    `impl`: "auto" takes the Triton forward on CUDA when triton imports, else chunked
    torch; "torch" and "triton" force one (Triton on CPU needs TRITON_INTERPRET=1).
    `chunk_tokens` x `chunk_vocab` bounds the block of logits the torch paths hold."""
    validate_inputs(hidden, weight, targets, temperature, chunk_tokens, chunk_vocab)
    return LogprobEntropyFunction.apply(
        hidden, weight, targets, temperature, chunk_tokens, chunk_vocab, _stats_fn(hidden, impl)
    )
