"""Building the trainer's models (the policy and the KL reference) from an HF directory.

Unsharded, the model is read whole and moved to the device. Sharded, no rank ever holds
the whole model on a device, and only rank 0 reads the checkpoint:

1. rank 0 reads the weights on host (float32 for a 14B model is 59 GB: once per node 0,
   not once per rank); every rank reads only `config.json`;
2. every rank builds the same skeleton on the meta device (no memory), wraps it in
   `PolicyModel` and shards it (`rpk.train.fsdp.shard`): parameters become DTensor shards,
   still without storage;
3. `to_empty` gives each rank storage for its own shards, on its device;
4. `set_model_state_dict(..., broadcast_from_rank0=True)` sends rank 0's tensors one at a
   time; each rank keeps its slice. Buffers are copied from rank 0 last (see
   `_broadcast_buffers`).

So the peak on a GPU is one shard plus one tensor in flight, and on host one model on
node 0 (rank 0's), none on the other nodes (rpk.gpu.plan counts it so).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rpk.gpu.launch import Sharding
from rpk.train import fsdp, lora, offload
from rpk.train.head import PREFIX, PolicyModel


def load_policy_model(
    source: Path, dtype: torch.dtype, device: torch.device, sharding: Sharding | None, *,
    temperature: float, entropy_grad: bool, recompute: bool, trainable: bool = True,
    adapters: lora.LoraSettings | None = None,
) -> PolicyModel:
    """The model in `source` as a `PolicyModel` on `device`: whole when `sharding` is
    None, else this rank's shards. `recompute` checkpoints each decoder layer's
    activations; `trainable=False` freezes every parameter (the KL reference);
    `adapters`: LoRA on a frozen base (`rpk.train.lora`), added before sharding."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if sharding is None:
        lm = _adapted(AutoModelForCausalLM.from_pretrained(source, dtype=dtype), adapters)
        policy = _wrap(lm.to(device), temperature, entropy_grad)
        _prepare(policy, recompute, trainable)
        return policy

    whole = _read_on_rank0(source, dtype, sharding)
    if whole is not None:
        # Rank 0's adapters are the ones every rank gets (their A is random).
        whole = _adapted(whole, adapters)
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
        lm = _adapted(skeleton, adapters)
    policy = _wrap(lm, temperature, entropy_grad)
    _prepare(policy, recompute, trainable)
    fsdp.shard(policy, sharding, bf16=device.type == "cuda", frozen=not trainable)
    policy.to_empty(device=device)
    _check_tied(skeleton)
    full = {PREFIX + name: t for name, t in whole.state_dict().items()} if whole is not None else {}
    set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _broadcast_buffers(policy, whole, sharding)
    return policy


def _adapted(lm: torch.nn.Module, adapters: lora.LoraSettings | None) -> torch.nn.Module:
    return lm if adapters is None else lora.add_adapters(lm, adapters)


def _wrap(lm: torch.nn.Module, temperature: float, entropy_grad: bool) -> PolicyModel:
    # eval(): the sampler has no dropout, so neither may the trainer, or the PPO ratio
    # would compare two different distributions. Gradients flow regardless.
    policy = PolicyModel(lm.eval(), temperature, entropy_grad)
    lora.dropout_on(lm)
    return policy


def _prepare(policy: PolicyModel, recompute: bool, trainable: bool) -> None:
    if not trainable:
        policy.requires_grad_(False)
    if recompute:
        offload.recompute_layers(policy.lm.get_decoder().layers)


def _read_on_rank0(source: Path, dtype: torch.dtype, sharding: Sharding) -> torch.nn.Module | None:
    """Rank 0's whole model on host; None elsewhere. The other ranks wait for the read
    on the control group (gloo, no short timeout): reading a large checkpoint can take
    longer than the bounded timeout of the default group, which the broadcasts use."""
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(source, dtype=dtype) if sharding.rank == 0 else None
    dist.barrier(group=sharding.control)
    return whole


def _check_tied(lm: torch.nn.Module) -> None:
    """A tied head must still be the embedding once materialised: FSDP shards the shared
    parameter once, and the head's gradient must land on the embedding's shard. Checked,
    not re-tied: `tie_weights` here would set the module attribute only, and FSDP, which
    swaps each parameter it manages in and out of its module, would undo it."""
    if not getattr(lm.config, "tie_word_embeddings", False):
        return
    head, embedding = lm.get_output_embeddings().weight, lm.get_input_embeddings().weight
    if head is not embedding:
        raise RuntimeError(f"{type(lm).__name__}: the LM head is no longer tied to the embedding after sharding")


@torch.no_grad()
def _broadcast_buffers(policy: PolicyModel, whole: torch.nn.Module | None, sharding: Sharding) -> None:
    """Every buffer from rank 0's model. Non-persistent buffers (the rotary `inv_freq`)
    are not in a state dict, and `to_empty` left them uninitialised; a model computes
    them in its constructor, which ran on the meta device. Buffers are small and the same
    on every rank (FSDP does not shard them), so rank 0 sends them all, persistent or
    not, rather than each model being taught how to recompute its own."""
    source = dict(whole.named_buffers()) if whole is not None else {}
    for name, buffer in policy.named_buffers():
        if whole is not None:
            buffer.copy_(source[name.removeprefix(PREFIX)])
        dist.broadcast(buffer, src=0, group=sharding.group)
