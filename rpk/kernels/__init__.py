"""Fused kernels, each with a plain-torch path that runs anywhere and a naive reference
it is tested against. Triton modules are imported only when a CUDA call needs them."""

from rpk.kernels.logprob import (
    chunked_token_logprobs_entropy,
    reference_token_logprobs_entropy,
    token_logprobs_entropy,
)

__all__ = [
    "chunked_token_logprobs_entropy",
    "reference_token_logprobs_entropy",
    "token_logprobs_entropy",
]
