"""What a `TorchTrainer` trains, syncs and saves, chosen once at its construction:
every weight (`FullWeights`), or LoRA adapters on a frozen base (`Adapters`,
`rpk.train.lora`). The trainer asks its mode instead of checking for adapters at each
place the two differ:
- the tensors a weight sync sends (the whole state dict, or the adapter alone: the base
  moves once, when vLLM loads it);
- the KL reference (a frozen copy of the initial model, loaded apart; or the policy
  itself with its adapters off);
- the checkpoint (an HF model directory; or the adapter in PEFT's format, naming the
  base) and what of the model its state holds (every parameter; or the adapters alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from rpk.core.protocols import WeightBucket
from rpk.gpu.launch import Sharding
from rpk.train import lora, state
from rpk.train.head import PolicyModel, hf_name


class WeightMode(Protocol):
    # load_state's `frozen`: the state holds the frozen parameters too (a full model's)
    state_holds_frozen: bool

    def named_weights(self, policy: PolicyModel) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight sync sends, under the names its receiver loads them by."""
        ...

    def reference(self, policy: PolicyModel, load: Callable[[], PolicyModel]) -> PolicyModel:
        """The KL reference (`load` builds a frozen copy of the initial model)."""
        ...

    def reference_context(self, policy: PolicyModel) -> contextlib.AbstractContextManager[None]:
        """What a reference pass runs under."""
        ...

    def before_reference(self, sharded: bool, forward: Callable[[], object]) -> None:
        """What must run before a reference pass (`forward`: one policy forward)."""
        ...

    def save(
        self, directory: Path, policy: PolicyModel, optimizer: torch.optim.Optimizer,
        sharding: Sharding | None, meta: dict[str, Any], source_dir: Path,
        buckets: Callable[[int], Iterator[WeightBucket]],
    ) -> None:
        """The trainer's half of a checkpoint (`buckets`: the trainer's weight buckets)."""
        ...


class FullWeights:
    """Every weight trains and syncs; the reference is a frozen copy of the initial model."""

    state_holds_frozen = True

    def named_weights(self, policy: PolicyModel) -> Iterator[tuple[str, torch.Tensor]]:
        return ((hf_name(n), t) for n, t in policy.state_dict().items())

    def reference(self, policy: PolicyModel, load: Callable[[], PolicyModel]) -> PolicyModel:
        return load()

    def reference_context(self, policy: PolicyModel) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def before_reference(self, sharded: bool, forward: Callable[[], object]) -> None:
        pass

    def save(
        self, directory: Path, policy: PolicyModel, optimizer: torch.optim.Optimizer,
        sharding: Sharding | None, meta: dict[str, Any], source_dir: Path,
        buckets: Callable[[int], Iterator[WeightBucket]],
    ) -> None:
        hf = (policy.lm.config, source_dir, buckets(state.HF_SHARD_BYTES))
        state.save(directory, policy, optimizer, sharding, hf, meta)


class Adapters:
    """LoRA adapters on a frozen base: only they train and sync; the reference is the
    base, the policy with its adapters off."""

    state_holds_frozen = False

    def __init__(self, settings: lora.LoraSettings) -> None:
        self.settings = settings
        self._dtypes_fixed = False  # FSDP has seen a forward with the adapters on

    def named_weights(self, policy: PolicyModel) -> Iterator[tuple[str, torch.Tensor]]:
        return lora.adapter_tensors(policy)

    def reference(self, policy: PolicyModel, load: Callable[[], PolicyModel]) -> PolicyModel:
        return policy

    def reference_context(self, policy: PolicyModel) -> contextlib.AbstractContextManager[None]:
        return lora.adapters_off(policy.lm)

    def before_reference(self, sharded: bool, forward: Callable[[], object]) -> None:
        if not sharded or self._dtypes_fixed:
            return
        # FSDP2 fixes each group's reduce dtype at the root's first forward, from the
        # parameters that then require grad (`_init_mp_dtypes`, torch's
        # fsdp/_fully_shard/_fsdp_param_group.py); adapters off, none do, and their
        # gradients would be reduce-scattered in bf16, not float32.
        with torch.no_grad():
            forward()
        self._dtypes_fixed = True

    def save(
        self, directory: Path, policy: PolicyModel, optimizer: torch.optim.Optimizer,
        sharding: Sharding | None, meta: dict[str, Any], source_dir: Path,
        buckets: Callable[[int], Iterator[WeightBucket]],
    ) -> None:
        # The adapter in PEFT's format, naming the base (`python -m rpk.checkpoint merge`).
        config = lora.adapter_config(self.settings, source_dir.resolve())
        state.save_adapter(directory, policy, optimizer, sharding, (config, lora.adapter_tensors(policy)), meta)


def weight_mode(adapters: lora.LoraSettings | None) -> WeightMode:
    return FullWeights() if adapters is None else Adapters(adapters)
