"""What the memory plan (rpk.gpu.plan) is asked about: the model's shape, read from its
`config.json`, and the machine (`Target`); and `PlanRefused`, the one-line refusal of a
config that does not fit, which a config that is no decoder-only model gets too.

The counts here are what the plan prices: parameters per decoder layer and root (the
embedding, the LM head unless tied, the final norm), each tensor's rows as FSDP shards
them, each weight as vLLM fuses it, the KV cache and the activations per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rpk.core.errors import UserError


class PlanRefused(UserError, ValueError):
    """The config does not fit; the message is one line: phase, GPU, what to change."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shape fields of a decoder-only HF config (Qwen2/Llama family)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tied: bool
    head_dim: int
    attention_bias: bool = True  # Qwen2's q/k/v projections have biases

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a `config.json` dict; names the missing field."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            shape = cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                vocab_size=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
            )
        except KeyError as e:
            raise PlanRefused(f"model config.json has no {e.args[0]!r}: not a decoder-only HF config") from None
        return shape

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.attention_bias else 0)
        return attention + 3 * h * self.intermediate_size + 2 * h  # + two RMSNorms

    @property
    def root_params(self) -> int:
        """Embedding, LM head (unless tied) and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tied else 2) + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.root_params

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single weight (the embedding)."""
        return max(self.vocab_size * self.hidden_size, self.hidden_size * self.intermediate_size)

    def tensors(self) -> list[tuple[int, int]]:
        """Every parameter tensor as (rows, elements per row): what FSDP shards by row."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.kv_dim, self.intermediate_size
        bias = [(q, 1), (kv, 1), (kv, 1)] if self.attention_bias else []
        layer = [(q, h), (kv, h), (kv, h), (h, q), *bias, (i, h), (i, h), (h, i), (h, 1), (h, 1)]
        root = [(self.vocab_size, h)] * (1 if self.tied else 2) + [(h, 1)]
        return layer * self.num_layers + root

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token, whole model (a TP-t shard holds 1/t)."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def activation_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """What one decoder layer keeps for backward per token, with SDPA/flash
        attention (no seq x seq scores): the norms' inputs and outputs, q/k/v before and
        after rotary, the attention output, and the MLP's gate, up, act(gate) and product."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.kv_dim
        return dtype_bytes * (7 * h + 3 * kv + 4 * i)


@dataclass(frozen=True, slots=True)
class Target:
    """The machine: nodes x GPUs per node, each with `gpu_bytes` of memory."""

    nodes: int
    gpus_per_node: int
    gpu_bytes: int
    host_bytes: int = 0  # RAM per node; 0 = unknown (the host rows are not checked)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node
