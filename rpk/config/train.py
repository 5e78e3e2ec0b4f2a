"""The config's `train` section: the optimizer, the loss, the trainer's device and
memory, and how training streams beside the rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rpk.cli_config import bad
from rpk.config.fields import non_negative, opt, positive


@dataclass(frozen=True, slots=True)
class TrainConfig:
    lr: float = opt(
        5e-5,
        "AdamW learning rate (2e-4 unlearned the tiny model's solved additions: "
        "docs/benchmarks.md, 'Learning rate')",
    )
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm; 0 = no clipping (the norm is still reported)")
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo"] = opt(
        "grpo", "policy loss (rpk/train/losses.py: LOSSES); it also picks the advantage"
    )
    clip_low: float | None = opt(
        None, "PPO clip: ratio floor is 1 - clip_low; unset = the loss's (0.2, gspo 3e-4)"
    )
    clip_high: float | None = opt(
        None,
        "PPO clip: ratio ceiling is 1 + clip_high; unset = the loss's (0.2, dapo 0.28, gspo 4e-4)",
    )
    overlong_filter: bool | None = opt(
        None, "leave truncated responses out of the loss; unset = on for dapo only"
    )
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial model; 0 loads no reference model")
    entropy_coef: float = opt(0.0, "entropy bonus (subtracted from the loss per token)")
    micro_batch_tokens: int = opt(8192, "token budget of one micro-batch (grad accumulation)")
    torch_threads: int = opt(
        0,
        "trainer intra-op CPU threads, set on the trainer's thread at each step (torch's "
        "count is process-wide, OpenMP's per thread); 0 = torch's default (all cores)",
    )
    device: str = opt("auto", "trainer device: auto, cpu or cuda")
    activation_checkpointing: bool | None = opt(
        None,
        "recompute each decoder layer in backward, keeping only its input: a sequence's "
        "activations are one layer's, not all layers' (unset: on with CUDA, off on CPU)",
    )
    defer_reduction: bool | None = opt(
        None,
        "sharded: keep the gradients unsharded and reduce them once at the step's end "
        "(float32, the whole model on every rank); false reduce-scatters after every "
        "micro-batch. Unset: defer where the memory plan fits it (always on CPU)",
    )
    offload: str = opt(
        "auto",
        "trainer state moved to host memory while vLLM generates (GPU): none, optimizer "
        "(AdamW's moments), all (and the parameter shards), or auto (the memory plan's)",
    )
    stream_mode: str = opt(
        "thread",
        "when the trainer works on completed groups: none (after the round), thread (on a "
        "trainer thread while the tail generates), borrow (the paper's stream trainer: half "
        "the rollout replicas hand their requests to the others and the trainer runs on "
        "their devices; needs >= 2 replicas, else thread)",
    )
    stream_start_frac: float = opt(
        0.0,
        "thread streaming starts once this fraction of the round's groups is complete (the "
        "paper uses 0.2-0.5; from the first group hid the most on the CPU measured)",
    )
    borrow_min_frac: float = opt(
        0.2, "borrow: lend once this fraction of the round's responses is done and still arriving"
    )
    borrow_max_frac: float = opt(
        0.5, "borrow: lend at the latest once this fraction of the round's responses is done"
    )
    borrow_check_s: float = opt(
        1.0,
        "borrow: seconds between the trigger's checks (responses still arriving: >= 5% of the "
        "round more than at the last check); keep it well under a round",
    )
    stream_chunk_tokens: int = opt(
        1024,
        "streaming hands the trainer a chunk once this many tokens wait: smaller chunks "
        "leave less to train after the round ends",
    )

    def __post_init__(self) -> None:
        positive(self, "lr", "micro_batch_tokens", "stream_chunk_tokens")
        non_negative(
            self, "weight_decay", "torch_threads", "kl_coef", "entropy_coef", "grad_clip"
        )
        if not 0 <= self.stream_start_frac <= 1:
            raise bad("stream_start_frac", f"must be in [0, 1], got {self.stream_start_frac!r}")
        if self.stream_mode not in ("none", "thread", "borrow"):
            raise bad("stream_mode", f"must be none, thread or borrow, got {self.stream_mode!r}")
        non_negative(self, "borrow_check_s")
        if not 0 < self.borrow_min_frac <= self.borrow_max_frac <= 1:
            raise bad(
                "borrow_min_frac",
                f"and borrow_max_frac need 0 < min <= max <= 1, got {self.borrow_min_frac!r} "
                f"and {self.borrow_max_frac!r}",
            )
        for name in ("clip_low", "clip_high"):
            if getattr(self, name) is not None:
                non_negative(self, name)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", f"must be auto, cpu or cuda, got {self.device!r}")
        if self.offload not in ("auto", "none", "optimizer", "all"):
            raise bad("offload", f"must be auto, none, optimizer or all, got {self.offload!r}")
        for name in ("activation_checkpointing", "defer_reduction"):
            if getattr(self, name) not in (None, True, False):
                raise bad(name, f"must be true, false or unset, got {getattr(self, name)!r}")
