"""The trainer tests' kit: a tiny random Qwen2 written to disk (the session's `model_dir`
and `tied_model_dir` in tests/conftest.py), a `TorchTrainer` with test defaults, random
samples of mixed lengths, and one whole step."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from rpk.core.records import TrainSample
from rpk.train.trainer import TorchTrainer, TrainerSettings

VOCAB = 64
MAX_TOKENS = 12  # the sampler budget Dr. GRPO normalises by


def tiny_qwen2(path: Path, seed: int, tied: bool = False, hints: bool = True) -> Path:
    """A random 2-layer Qwen2 over `VOCAB` word-level tokens t0..t63, saved to `path`;
    `tied`: one embedding and LM head; `hints`: a generation config HF cannot save."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    if hints:
        # Sampling hints without do_sample: HF loads this but refuses to *save* it, as
        # real model repos often have; save() must still work.
        (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))
    return path


def make_samples(n: int, seed: int) -> list[TrainSample]:
    """Random prompts/responses of mixed lengths, some truncated; old log-probs
    scattered around the random model's (~ln 1/64) so that some ratios fall outside
    the clip range."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        p, r = rng.randint(1, 12), rng.randint(0, 10) if rng.random() < 0.1 else rng.randint(1, 10)
        samples.append(
            TrainSample(
                prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(p)),
                response_ids=tuple(rng.randrange(VOCAB) for _ in range(r)),
                old_logprobs=tuple(-4.16 + rng.uniform(-0.6, 0.6) for _ in range(r)),
                advantage=rng.choice([-1.5, -0.3, 0.0, 0.4, 1.2]),
                truncated=rng.random() < 0.25,
            )
        )
    return samples


_TRAINER_ARGS = ("max_response_tokens", "temperature", "seed", "device", "dtype", "reference_dir")


def trainer(model_dir: Path, **overrides: object) -> TorchTrainer:
    """A trainer with test defaults; `overrides` are TrainerSettings fields or the trainer's
    own keyword arguments."""
    settings_: dict[str, object] = dict(
        lr=1e-3, clip_low=0.2, clip_high=0.28, micro_batch_tokens=10_000, torch_threads=1,
        temperature=0.7, seed=0, max_response_tokens=MAX_TOKENS,
    )
    settings_.update(overrides)
    kwargs = {k: settings_.pop(k) for k in _TRAINER_ARGS if k in settings_}
    return TorchTrainer(model_dir, TrainerSettings(**settings_), **kwargs)  # type: ignore[arg-type]


def grads(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def stepped_gradient(
    t: TorchTrainer, calls: Sequence[Sequence[TrainSample]]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One whole step; returns the gradient the optimizer stepped with (normalised by
    finish_step) and the step's metrics."""
    seen: dict[str, torch.Tensor] = {}

    def capture(*_: object) -> None:
        seen.update(grads(t))

    handle = t.optimizer.register_step_pre_hook(capture)
    t.begin_step()
    for c in calls:
        t.accumulate(c)
    metrics = dict(t.finish_step())
    handle.remove()
    assert metrics["stepped"] == 1.0 and seen
    return seen, metrics


def step(t: TorchTrainer, samples: Sequence[TrainSample]) -> dict[str, float]:
    """One training step on `samples`: its metrics."""
    t.begin_step()
    t.accumulate(samples)
    return dict(t.finish_step())


def saved_after_a_step(t: TorchTrainer, samples: Sequence[TrainSample], tmp_path: Path) -> Path:
    """`t` trained one step on `samples`, then saved: the checkpoint's directory."""
    step(t, samples)
    ckpt = tmp_path / "step-1"
    t.save(ckpt)
    return ckpt
