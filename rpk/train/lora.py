"""LoRA adapters on the trainer's model (PEFT), and the adapter as it leaves the trainer.

With `model.lora_rank > 0` the policy's HF model gets PEFT LoRA adapters on its
`lora_targets` (`all-linear`: every linear layer but the LM head) before anything else
happens to it: adapters, then freezing (PEFT leaves only the adapters trainable), then
sharding (`rpk.train.fsdp.shard`), as torchtune and veRL order it. FSDP2 shards every
parameter as a DTensor of its own, so the frozen base and the trainable adapters share
one `fully_shard` group per layer. FSDP2 asks one dtype of a group's trainable
parameters only (`_init_mp_dtypes`, torch's fsdp/_fully_shard/_fsdp_param_group.py) and
all-gathers mixed dtypes as bytes, so the adapters and their AdamW moments stay float32
beside a bf16 base (as PEFT makes them): bf16 moments lose the small updates of a long run.

The KL reference is the same model with the adapters switched off (`adapters_off`): the
base is frozen, so that is exactly the initial model, and no second copy is built.

What leaves the trainer for the rollout engine is the adapter alone, in PEFT's own
layout: tensors named as `adapter_model.safetensors` names them, and the adapter's
config as `adapter_config.json` holds it (`adapter_config`); `rpk.sync.adapter` writes
them as the directory vLLM and PEFT load.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rpk.sync.adapter import CONFIG_FILE
from rpk.train.state import copy_model_files

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

ADAPTER = "default"  # PEFT's name for the one adapter
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The config's `model.lora_*` fields (`rpk.config.ModelConfig` says what each means)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = (ALL_LINEAR,)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {self.rank}")
        if not self.targets:
            raise ValueError("LoRA targets must name at least one module (or all-linear)")

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig

        targets: str | list[str] = ALL_LINEAR if self.targets == (ALL_LINEAR,) else list(self.targets)
        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=targets, bias="none", task_type="CAUSAL_LM",
        )


def add_adapters(lm: torch.nn.Module, settings: LoraSettings) -> PeftModel:
    """`lm` with LoRA adapters, only they trainable, in float32 at least (a float64 base's
    own dtype). The adapters are initialised from torch's RNG (A random, B zero: the model
    is unchanged)."""
    from peft import get_peft_model

    dtype = torch.promote_types(next(lm.parameters()).dtype, torch.float32)
    model = get_peft_model(lm, settings.peft_config(), autocast_adapter_dtype=False)
    for name, param in model.named_parameters():
        # Set here, not left to PEFT: it follows the base layer's dtype, and on the meta
        # device (the sharded skeleton) torch's default dtype.
        if is_adapter_name(name) and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def dropout_on(lm: torch.nn.Module) -> None:
    """The adapters' dropout in training mode, the rest of `lm` left as it is: the
    policy runs in eval mode (the sampler has no dropout), so a `lora_dropout` asked
    for applies there alone. A no-op without adapters or at dropout 0."""
    for name, module in lm.named_modules():
        if name.endswith(f"lora_dropout.{ADAPTER}") and isinstance(module, torch.nn.Dropout):
            module.train()


@contextlib.contextmanager
def adapters_off(lm: torch.nn.Module) -> Iterator[None]:
    """The base model for the block: the KL reference."""
    from peft import PeftModel

    if not isinstance(lm, PeftModel):
        raise TypeError(f"adapters_off needs a PEFT model, got {type(lm).__name__}")
    with lm.disable_adapter():
        yield


def peft_name(name: str) -> str:
    """An adapter parameter's name under `PolicyModel` as PEFT saves it (no `lm.`
    prefix, no adapter name): `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`."""
    return name.removeprefix("lm.").replace(f".{ADAPTER}.", ".")


def is_adapter_name(name: str) -> bool:
    return ".lora_" in name


def adapter_tensors(policy: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's parameters, PEFT-named, in a fixed order (sharded: DTensor shards)."""
    for name, tensor in policy.state_dict().items():
        if is_adapter_name(name):
            yield peft_name(name), tensor


def adapter_config(settings: LoraSettings, base_model: str | Path) -> dict[str, Any]:
    """`adapter_config.json`'s content: PEFT's config of `settings`, naming the base."""
    config = settings.peft_config().to_dict()
    config["base_model_name_or_path"] = str(base_model)
    return json.loads(json.dumps(config, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # PEFT's enums (task type, peft type)
        return value.value
    raise TypeError(f"{type(value).__name__} in a LoRA config is not JSON")


def base_of(checkpoint: Path) -> Path:
    """The base model a LoRA checkpoint's adapter was trained on (its config names it)."""
    config = checkpoint / CONFIG_FILE
    if not config.is_file():
        raise FileNotFoundError(f"{checkpoint}: no {CONFIG_FILE} (not a LoRA checkpoint)")
    base = Path(json.loads(config.read_text())["base_model_name_or_path"])
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}: its base model {base} is not a model directory (no config.json)")
    return base


def merge(checkpoint: Path, out: Path) -> Path:
    """The base with the checkpoint's adapter merged in, written to `out` as an HF model
    directory (weights in the base's dtype, config, tokenizer files) that transformers
    and vLLM load as is."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = base_of(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    # transformers refuses to save some generation configs that it loads (sampling hints
    # without do_sample); the base's own file is copied over it below.
    merged.generation_config = GenerationConfig()
    merged.save_pretrained(out)
    copy_model_files(base, out)
    return out
