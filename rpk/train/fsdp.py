"""Sharding the policy with FSDP2, as a small transform, and the gradient rules rpk needs.

`shard` applies `fully_shard` per decoder layer and to the root (`PolicyModel`, which
then owns the embedding, the tied LM head and the final norm), with bf16 compute and
fp32 reduction on GPU. Two rules make a sharded step equal a single-process one:

- Sum, do not average: every FSDP module reduces gradients by summing (a divide factor
  of 1 and sum reductions; the setters are not recursive, so each module gets them). The
  trainer divides once by the loss normaliser counted over all ranks.
- No reduction until the round is over (the paper's stream trainer): streamed
  backwards keep their gradients unsharded and local (`requires_gradient_sync(False)`);
  `flush` then runs one backward of a zero loss with synchronisation on, which
  reduce-scatters everything accumulated. Every rank runs it, once, at the step's end.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rpk.gpu.launch import Sharding
from rpk.train.head import PolicyModel


def shard(policy: PolicyModel, sharding: Sharding, bf16: bool, frozen: bool = False) -> None:
    """`frozen`: a model that only runs forward (the KL reference). FSDP keeps the root
    gathered after its forward for the backward that follows; with no backward to come,
    nothing would ever reshard it, so a frozen root reshards after its forward."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": sharding.mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs, **({"reshard_after_forward": True} if frozen else {}))
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def defer_reduction(policy: torch.nn.Module) -> None:
    if isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(False)


def flush(policy: torch.nn.Module, dummy_loss: torch.Tensor) -> None:
    """Reduce-scatter the gradients accumulated since the step began: one backward of
    `dummy_loss` (a zero-weighted pass every rank runs) with synchronisation on."""
    if isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(True)
    dummy_loss.backward()


def all_sum(values: torch.Tensor, sharding: Sharding | None) -> torch.Tensor:
    """Sum a small host tensor of counts or stats over the data-parallel ranks. It goes
    over the control group, gloo on every box: `sharding.group` may serve cuda alone."""
    if sharding is not None:
        dist.all_reduce(values, group=sharding.control)
    return values


def settled(sharding: Sharding | None) -> None:
    """Wait until every rank got here (on the control group): what a rank released
    before is free on every GPU once this returns."""
    if sharding is not None:
        dist.barrier(group=sharding.control)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; every rank must call it, in
    the same order."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor.detach()
