"""Spies on how a rank builds its trainer's models (tests/test_dist_load.py): which
checkpoints it read, where the parameters were when they were sharded, and what each
build left on the rank (its own shards, buffers, the head's tie, recomputed layers)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from rpk.train import fsdp, load
from rpk.train.head import PolicyModel, hf_name


@dataclass
class Built:
    trainable: bool
    tied: bool
    recomputed: bool  # every decoder layer's forward is checkpointed
    shards: dict[str, torch.Tensor]  # this rank's own part of each parameter (HF names)
    buffers: dict[str, torch.Tensor]


@dataclass
class Seen:
    reads: list[str] = field(default_factory=list)  # from_pretrained's directories
    sharded_on: list[set[str]] = field(default_factory=list)  # parameter devices at fsdp.shard
    built: list[Built] = field(default_factory=list)


def snapshot(policy: PolicyModel) -> Built:
    lm = policy.lm
    return Built(
        trainable=any(p.requires_grad for p in policy.parameters()),
        tied=lm.get_output_embeddings().weight is lm.get_input_embeddings().weight,
        recomputed=all(isinstance(layer.forward, functools.partial) for layer in lm.get_decoder().layers),
        shards={hf_name(n): (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in policy.named_parameters()},
        buffers={hf_name(n): b.clone() for n, b in policy.named_buffers()},
    )


@contextlib.contextmanager
def spying() -> Iterator[Seen]:
    """Record this process's model reads, shardings and builds until the block ends."""
    seen = Seen()
    read, shard, build = AutoModelForCausalLM.from_pretrained, fsdp.shard, load.load_policy_model

    def reading(source: Any, *args: Any, **kwargs: Any) -> Any:
        seen.reads.append(str(source))
        return read(source, *args, **kwargs)

    def sharding(policy: PolicyModel, *args: Any, **kwargs: Any) -> None:
        seen.sharded_on.append({p.device.type for p in policy.parameters()})
        shard(policy, *args, **kwargs)

    def building(*args: Any, **kwargs: Any) -> PolicyModel:
        policy = build(*args, **kwargs)
        seen.built.append(snapshot(policy))
        return policy

    # The class's own attribute (a classmethod descriptor) goes back as it was.
    descriptor = vars(AutoModelForCausalLM)["from_pretrained"]
    AutoModelForCausalLM.from_pretrained = reading  # type: ignore[method-assign]
    fsdp.shard, load.load_policy_model = sharding, building
    try:
        yield seen
    finally:
        AutoModelForCausalLM.from_pretrained = descriptor  # type: ignore[method-assign]
        fsdp.shard, load.load_policy_model = shard, build
