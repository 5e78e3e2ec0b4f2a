"""Fused kernels, each with a plain-torch path that runs anywhere and a naive reference
it is tested against. Triton modules are imported only when a call needs them."""

from rpk.kernels.chunked import reference_token_logprobs_entropy
from rpk.kernels.logprob import token_logprobs_entropy

__all__ = ["reference_token_logprobs_entropy", "token_logprobs_entropy"]
