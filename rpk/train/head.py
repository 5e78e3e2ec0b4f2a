"""The policy as one module: decoder and LM head together, returning the log-prob and
entropy of each response token.

Why a module of its own: the fused head (`rpk.kernels.logprob`) multiplies hidden states
by the LM-head weight itself instead of calling the head. Under FSDP2 a weight read
outside its module's forward is a shard, not the matrix; inside the forward of the
module that holds it, it is whole. Wrapping decoder and head in one root module puts the
head weight (tied to the embedding in Qwen) in the root's FSDP group, gathered for this
forward. The HF model stays inside, under the name `lm`, so state dicts keep HF names
behind that prefix.
"""

from __future__ import annotations

import torch

from rpk.kernels.logprob import token_logprobs_entropy
from rpk.train.losses import token_logprobs_and_entropy

PREFIX = "lm."


class PolicyModel(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, temperature: float, entropy_grad: bool) -> None:
        super().__init__()
        head = lm.get_output_embeddings()
        # The fused head takes hidden @ weight.T as the logits: a head with a bias would
        # be silently wrong.
        if head is None or getattr(head, "bias", None) is not None:
            raise ValueError(f"the trainer needs a bias-free linear LM head, got {head!r}")
        self.lm = lm
        self.temperature = temperature
        self.entropy_grad = entropy_grad

    def forward(
        self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of `targets` at positions (rows, cols) of `input_ids`,
        from the decoder's final hidden states there and the LM head weight, without
        the [B, T, V] logits."""
        out = self.lm.get_decoder()(input_ids=input_ids, use_cache=False)
        hidden = out.last_hidden_state[rows, cols]
        weight = self.lm.get_output_embeddings().weight
        if hidden.dtype == torch.float64:  # the exactness tests: the fused kernel is fp32
            logp, entropy = token_logprobs_and_entropy(
                hidden @ weight.T, targets, self.temperature, entropy_grad=self.entropy_grad
            )
        else:
            logp, entropy = token_logprobs_entropy(hidden, weight, targets, self.temperature)
        # FSDP hooks a root module's outputs for its backward; a view there could lose
        # the hook to an in-place op, so the outputs are tensors of their own.
        return logp.clone(), entropy.clone()


def hf_name(name: str) -> str:
    """A PolicyModel state-dict key as the HF model's own."""
    return name.removeprefix(PREFIX)
