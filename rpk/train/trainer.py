"""`TorchTrainer`: the policy being trained, behind `rpk.loop.protocols.Trainer`.

One HF causal LM, one AdamW, GRPO's PPO-clip token loss. A step is `begin_step`, any
number of `accumulate` calls, then `finish_step`. `accumulate` packs its samples into
micro-batches by a token budget, runs forward and backward on each and lets the
gradients pile up as *sums* over response tokens; `finish_step` divides by the number
of response tokens the whole step saw and takes one optimizer step. The update is
therefore a token-level mean over the step, whatever the split or the order of the
samples, which is what lets the loop stream groups into the trainer as they finish.

Every method blocks (forward/backward/optimizer run on the calling thread); the asyncio
loop calls them through `asyncio.to_thread`. Nothing here is thread-safe: one caller.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rpk.loop.records import TrainSample
from rpk.train.losses import ppo_clip_token_loss, token_logprobs_and_entropy

STATE_FILE = "trainer_state.pt"

# What `save` copies from the source model directory next to the weights, so that the
# checkpoint is a complete model directory for transformers and vLLM.
_COPIED_FILES = (
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_COPIED_GLOBS = ("tokenizer*",)

# Sums kept over a step (and over one `accumulate` call), synced to the host once.
_STAT_KEYS = (
    "tokens",
    "clipped_tokens",
    "abs_logp_diff",
    "ratio_sum",
    "loss_sum",
    "entropy_sum",
)


def pack_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Greedily pack sequences (indices into `lengths`) into micro-batches whose padded
    size, rows x longest row, stays within `budget` tokens.

    Longest first, so each micro-batch's first member fixes its padded width and the
    rows that follow are close to it in length (little padding). A sequence longer than
    the budget on its own gets a micro-batch of its own rather than being dropped.
    """
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be > 0, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    width = 0
    for i in order:
        if batches and (len(batches[-1]) + 1) * width <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
            width = lengths[i]
    return batches


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    parsed = getattr(torch, dtype, None)
    if not isinstance(parsed, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return parsed


class TorchTrainer:
    """GRPO policy trainer on one device (implements `rpk.loop.protocols.Trainer`).

    All methods are blocking; call them from a worker thread in async code.

    Settings are keyword-only and explicit. `micro_batch_tokens` bounds rows x padded
    length of one forward pass (prompt tokens included: they cost memory too).
    `temperature` must be the sampler's: logits are divided by it so that the trainer's
    log-probs are those of the distribution the sampler drew from. `grad_clip=None`
    disables clipping (the norm is still reported). `torch_threads` calls
    `torch.set_num_threads`, which is process-wide: on a CPU box the trainer shares its
    cores with the rollout engine.

    With `dtype=torch.bfloat16` the parameters, gradients and optimizer state are all
    bf16 (no fp32 master copy); float32 is the default for that reason.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        micro_batch_tokens: int = 8192,
        temperature: float = 1.0,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        torch_threads: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be > 0, got {micro_batch_tokens}")
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        torch.manual_seed(seed)

        self._source_dir = Path(model_dir)
        self._device = torch.device(device)
        self._grad_clip = grad_clip
        self._clip_low = clip_low
        self._clip_high = clip_high
        self._micro_batch_tokens = micro_batch_tokens
        self._temperature = temperature

        model = AutoModelForCausalLM.from_pretrained(self._source_dir, dtype=_parse_dtype(dtype))
        # eval(): the sampler has no dropout, so neither may the trainer, or the PPO
        # ratio would compare two different distributions. Gradients flow regardless.
        self._model = model.to(self._device).eval()
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._opt_hparams = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self._optimizer = torch.optim.AdamW(self._params, **self._opt_hparams)
        self._version = 0

        self._in_step = False
        self._step_sums: torch.Tensor | None = None
        self._step_samples = 0
        self._step_micro_batches = 0

    @property
    def version(self) -> int:
        """Number of optimizer steps taken since the source model (survives `save`)."""
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The HF state_dict, detached, for weight sync to the rollout engine.

        These alias the live parameters (no copy): consume them before the next
        `finish_step`, or copy them."""
        return {name: t.detach() for name, t in self._model.state_dict().items()}

    # -- one step -------------------------------------------------------------------

    def begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("begin_step called while a step is open; finish it first")
        self._optimizer.zero_grad(set_to_none=True)
        self._step_sums = None
        self._step_samples = 0
        self._step_micro_batches = 0
        self._in_step = True

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        """Forward and backward over `samples`; gradients add up until `finish_step`.

        Returns this call's own metrics (token means over its response tokens)."""
        if not self._in_step:
            raise RuntimeError("accumulate called outside a step; call begin_step first")
        for s in samples:
            _check_sample(s)
        # An empty response has nothing to score; it still counts as a sample seen.
        scored = [s for s in samples if s.response_ids]
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in scored]
        call_sums: torch.Tensor | None = None
        micro_batches = 0
        for batch in pack_micro_batches(lengths, self._micro_batch_tokens):
            sums = self._micro_batch([scored[i] for i in batch])
            call_sums = sums if call_sums is None else call_sums + sums
            micro_batches += 1
        self._step_samples += len(samples)
        self._step_micro_batches += micro_batches
        if call_sums is not None:
            self._step_sums = call_sums if self._step_sums is None else self._step_sums + call_sums
        metrics = _means(call_sums)
        metrics.update(train_samples=float(len(samples)), micro_batches=float(micro_batches))
        return metrics

    def finish_step(self) -> Mapping[str, float]:
        """Normalise the summed gradient by the step's response-token count, clip it,
        take exactly one AdamW step and bump `version`.

        A step that saw no response tokens does not touch the optimizer: it returns
        metrics with `stepped=0.0` and `version` unchanged (the loop may legitimately
        end up with nothing to train on, e.g. when every group was filtered out).

        A non-finite gradient norm raises `FloatingPointError` without stepping; the
        step is closed and the gradients dropped, so the weights stay as they were and
        the trainer remains usable."""
        if not self._in_step:
            raise RuntimeError("finish_step called outside a step; call begin_step first")
        self._in_step = False
        sums, self._step_sums = self._step_sums, None
        metrics = _means(sums)
        metrics.update(
            train_samples=float(self._step_samples),
            micro_batches=float(self._step_micro_batches),
        )
        tokens = metrics["train_tokens"]
        if tokens == 0:
            self._optimizer.zero_grad(set_to_none=True)
            metrics.update(stepped=0.0, version=float(self._version))
            return metrics

        for p in self._params:
            if p.grad is not None:
                p.grad.div_(tokens)
        max_norm = math.inf if self._grad_clip is None else self._grad_clip
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        if not math.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite grad norm {grad_norm}; step skipped")
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._version += 1
        metrics.update(
            grad_norm=grad_norm,
            lr=float(self._optimizer.param_groups[0]["lr"]),
            stepped=1.0,
            version=float(self._version),
        )
        return metrics

    def _micro_batch(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        """Forward + backward of one right-padded micro-batch; returns its stat sums
        (in `_STAT_KEYS` order) as one detached tensor."""
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        # Right padding under causal attention needs no attention mask: a real token
        # only attends to earlier positions, which are all real. Without a mask SDPA
        # keeps its causal fast path. The pad id is arbitrary for the same reason.
        input_ids = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)

        # Logits at position t predict token t+1, so response token j of a row with a
        # P-token prompt is scored by position P-1+j. Only positions from the earliest
        # such one onwards are turned into logits (the prompt's lm_head work is wasted).
        first = min(len(s.prompt_ids) for s in samples) - 1
        row_idx: list[int] = []
        col_idx: list[int] = []
        old: list[float] = []
        adv: list[float] = []
        for row, s in enumerate(samples):
            start = len(s.prompt_ids) - 1 - first
            n = len(s.response_ids)
            row_idx.extend([row] * n)
            col_idx.extend(range(start, start + n))
            old.extend(s.old_logprobs)
            adv.extend([s.advantage] * n)

        input_ids = input_ids.to(self._device)
        rows_t = torch.tensor(row_idx, device=self._device)
        cols_t = torch.tensor(col_idx, device=self._device)
        # Index straight away so the padded [B, T, V] logits are freed before the
        # log_softmax allocates its own [tokens, V].
        logits = self._model(
            input_ids=input_ids, use_cache=False, logits_to_keep=width - first
        ).logits[rows_t, cols_t]
        targets = input_ids[:, first + 1 :][rows_t, cols_t]
        logp, entropy = token_logprobs_and_entropy(logits, targets, self._temperature)

        old_t = torch.tensor(old, dtype=torch.float64, device=self._device)
        adv_t = torch.tensor(adv, dtype=torch.float64, device=self._device)
        mask = torch.ones_like(logp, dtype=torch.bool)
        loss_sum, stats = ppo_clip_token_loss(
            logp, old_t, adv_t, mask, self._clip_low, self._clip_high
        )
        loss_sum.backward()
        stats["loss_sum"] = loss_sum.detach()
        stats["entropy_sum"] = entropy.sum().to(loss_sum.dtype)
        return torch.stack([stats[k].to(torch.float64) for k in _STAT_KEYS])

    # -- checkpoints ----------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write a checkpoint: an HF model directory (safetensors weights, config, the
        tokenizer files and generation_config copied from the source model directory)
        that transformers and vLLM load as is, plus `trainer_state.pt` (optimizer state,
        version, RNG state) for `load_state`.

        Written to a temporary sibling directory and renamed into place, so a crash
        never leaves a half-written checkpoint under `directory`. Replacing an existing
        checkpoint takes two renames; in between, the old one sits at `.<name>.old-*`."""
        if self._in_step:
            raise RuntimeError("cannot save in the middle of a step")
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        self._save_pretrained(tmp)
        for name in _copied_files(self._source_dir):
            shutil.copy2(self._source_dir / name, tmp / name)
        torch.save(self._state(), tmp / STATE_FILE)

        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
        return target

    def _save_pretrained(self, directory: Path) -> None:
        if not (self._source_dir / "generation_config.json").is_file():
            self._model.save_pretrained(directory)
            return
        # The source's generation_config.json is copied verbatim afterwards. HF validates
        # it strictly on save, though it loads it leniently, and real repos ship ones it
        # rejects (sampling flags without do_sample): save a neutral one in its place.
        loaded = self._model.generation_config
        self._model.generation_config = GenerationConfig.from_model_config(self._model.config)
        try:
            self._model.save_pretrained(directory)
        finally:
            self._model.generation_config = loaded

    def load_state(self, directory: str | Path) -> None:
        """Restore optimizer state, version and RNG state from a checkpoint written by
        `save`. Construct the trainer from that same directory first (that loads the
        weights). Hyperparameters stay those given to the constructor: the checkpoint
        carries state, not settings."""
        if self._in_step:
            raise RuntimeError("cannot load state in the middle of a step")
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
        self._optimizer.load_state_dict(state["optimizer"])
        for group in self._optimizer.param_groups:
            group.update(self._opt_hparams)
        self._version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        cuda_rng = state.get("cuda_rng")
        if cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_rng)

    def _state(self) -> dict[str, object]:
        cuda_rng = torch.cuda.get_rng_state_all() if self._device.type == "cuda" else None
        return {
            "optimizer": self._optimizer.state_dict(),
            "version": self._version,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": cuda_rng,
        }


def _check_sample(s: TrainSample) -> None:
    if len(s.old_logprobs) != len(s.response_ids):
        raise ValueError(
            f"{len(s.response_ids)} response tokens but {len(s.old_logprobs)} old log-probs"
        )
    if s.response_ids and not s.prompt_ids:
        # The first response token needs a position that predicts it.
        raise ValueError("a sample with response tokens needs a non-empty prompt")
    # A nan here would not even show up in the gradient (the log-ratio clamp has zero
    # gradient at nan); it would silently drop the token and poison the loss metric.
    if not math.isfinite(s.advantage) or not all(map(math.isfinite, s.old_logprobs)):
        raise ValueError("non-finite advantage or old log-prob in a train sample")


def _means(sums: torch.Tensor | None) -> dict[str, float]:
    """Token means of a stat-sum vector (one host sync); zeros when nothing was seen."""
    values = dict(zip(_STAT_KEYS, sums.tolist())) if sums is not None else {}
    tokens = values.get("tokens", 0.0)
    denom = tokens if tokens > 0 else 1.0
    return {
        "loss": values.get("loss_sum", 0.0) / denom,
        "clip_frac": values.get("clipped_tokens", 0.0) / denom,
        "logprob_mismatch": values.get("abs_logp_diff", 0.0) / denom,
        "ratio_mean": values.get("ratio_sum", 0.0) / denom,
        "entropy": values.get("entropy_sum", 0.0) / denom,
        "train_tokens": tokens,
    }


def _copied_files(source: Path) -> list[str]:
    names = {n for n in _COPIED_FILES if (source / n).is_file()}
    for pattern in _COPIED_GLOBS:
        names.update(p.name for p in source.glob(pattern) if p.is_file())
    return sorted(names)
