"""`TorchTrainer`: the policy being trained, behind `rpk.core.protocols.Trainer`.

One HF causal LM, one AdamW and one loss of the GRPO family, chosen by name from
`rpk.train.losses.LOSSES`. A step is `begin_step`, any number of `accumulate` calls, then
`finish_step`. `accumulate` packs its samples into micro-batches by a token budget, runs
forward and backward on each and lets the gradients pile up as the loss's unnormalised
*sums*; `finish_step` divides them by the loss's normaliser counted over the whole step
(response tokens, sequences, or sequences x max_tokens) and takes one optimizer step.
The update therefore does not depend on the split or the order of the samples, which is
what lets the loop stream groups into the trainer as they finish.

Log-probs come from the decoder's final hidden states and the LM head weight through the
fused, chunked `rpk.kernels.logprob.token_logprobs_entropy`: the [tokens x vocab]
logits are never materialised.

Every method blocks (forward/backward/optimizer run on the calling thread); the asyncio
loop calls them from one dedicated thread. Nothing here is thread-safe: one caller.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rpk.config import TrainConfig
from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample
from rpk.kernels.logprob import token_logprobs_entropy
from rpk.train.weights import bucketed
from rpk.train.losses import (
    STAT_KEYS,
    LossSettings,
    Normaliser,
    PolicyBatch,
    loss_spec,
    token_logprobs_and_entropy,
)

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


@dataclass(slots=True)
class _Tally:
    """What one step (or one `accumulate` call) has seen. The counts are known on the
    host from the samples; the loss stats stay a device tensor until `finish_step`."""

    samples: int = 0
    sequences: int = 0  # samples that entered the loss
    tokens: int = 0  # their response tokens
    micro_batches: int = 0
    overlong_filtered: int = 0
    sums: torch.Tensor | None = None  # STAT_KEYS order, float64

    def add(self, other: _Tally) -> None:
        self.samples += other.samples
        self.sequences += other.sequences
        self.tokens += other.tokens
        self.micro_batches += other.micro_batches
        self.overlong_filtered += other.overlong_filtered
        if other.sums is not None:
            self.sums = other.sums if self.sums is None else self.sums + other.sums

    def counts(self) -> dict[str, float]:
        return {
            "train_samples": float(self.samples),
            "train_sequences": float(self.sequences),
            "train_tokens": float(self.tokens),
            "micro_batches": float(self.micro_batches),
            "overlong_filtered": float(self.overlong_filtered),
        }


class TorchTrainer:
    """GRPO-family policy trainer on one device (implements `rpk.core.protocols.Trainer`).

    All methods are blocking; call them from a worker thread in async code.

    Settings come from `TrainConfig` (`rpk.config`); `loss` names an entry of
    `LOSSES`, and `clip_low`, `clip_high` and `overlong_filter` left at None take that
    loss's defaults (DAPO's clip-higher 0.2/0.28, GSPO's 3e-4/4e-4, ...). What the
    trainer needs from the sampler is passed beside it: `max_response_tokens` (the
    length budget, Dr. GRPO's constant normaliser) and `temperature` (log-probs are taken
    under softmax(logits / temperature), the distribution the sampler drew from).
    `kl_coef > 0` adds a k3 KL penalty to a frozen reference model, loaded from
    `reference_dir` (default: `model_dir`, i.e. the initial weights) at the first step
    that needs it; `entropy_coef > 0` adds an entropy bonus. `micro_batch_tokens` bounds
    rows x padded length of one forward pass (prompt tokens included: they cost memory
    too). `grad_clip=0` disables clipping (the norm is still reported).

    `torch_threads` sizes torch's CPU intra-op pool for the trainer. The count torch
    stores is process-wide, but OpenMP's is per thread and a thread reads the stored one
    only on its first parallel op: a thread that ran torch code earlier keeps its old
    count. So it is applied at construction and again by `begin_step`, on whichever
    thread runs the step; the rollout engine's CPU threads live in its own process.

    With `dtype=torch.bfloat16` the parameters, gradients and optimizer state are all
    bf16 (no fp32 master copy); float32 is the default for that reason. A float64 model
    (the exactness tests) takes the plain log_softmax path, since the fused kernel
    computes in float32.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainConfig = TrainConfig(),
        *,
        max_response_tokens: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        reference_dir: str | Path | None = None,
    ) -> None:
        spec = loss_spec(cfg.loss)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if spec.normaliser is Normaliser.SEQUENCE_BUDGET and not (max_response_tokens or 0) > 0:
            raise ValueError(
                f"loss {cfg.loss!r} normalises by max_response_tokens, which must be > 0, "
                f"got {max_response_tokens!r}"
            )
        self._settings = LossSettings(
            clip_low=spec.clip_low if cfg.clip_low is None else cfg.clip_low,
            clip_high=spec.clip_high if cfg.clip_high is None else cfg.clip_high,
            kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef,
        )
        self._torch_threads = cfg.torch_threads or None
        self._apply_threads()
        torch.manual_seed(seed)

        self._spec = spec
        self._overlong_filter = (
            spec.overlong_filter if cfg.overlong_filter is None else cfg.overlong_filter
        )
        self._max_response_tokens = max_response_tokens or 0
        self._source_dir = Path(model_dir)
        self._reference_dir = Path(reference_dir) if reference_dir is not None else self._source_dir
        self._reference: torch.nn.Module | None = None
        self._device = torch.device(device)
        self._dtype = _parse_dtype(dtype)
        self._grad_clip = cfg.grad_clip
        self._micro_batch_tokens = cfg.micro_batch_tokens
        self._temperature = temperature

        model = AutoModelForCausalLM.from_pretrained(self._source_dir, dtype=self._dtype)
        _check_lm_head(model)
        # eval(): the sampler has no dropout, so neither may the trainer, or the PPO
        # ratio would compare two different distributions. Gradients flow regardless.
        self._model = model.to(self._device).eval()
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._opt_hparams = {
            "lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "weight_decay": cfg.weight_decay,
        }
        self._optimizer = torch.optim.AdamW(self._params, **self._opt_hparams)
        self._version = 0

        self._in_step = False
        self._tally = _Tally()

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

    @property
    def loss_settings(self) -> LossSettings:
        """The clip range and coefficients in force, loss defaults resolved."""
        return self._settings

    @property
    def overlong_filter(self) -> bool:
        return self._overlong_filter

    def weight_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        """The HF state_dict, detached, in buckets (`rpk.train.weights.bucketed`), for
        the rollout engine. They alias the live parameters (no copy): consume them
        before the next step."""
        return bucketed(self._model.state_dict().items(), max_bytes)

    # -- one step -------------------------------------------------------------------

    def begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("begin_step called while a step is open; finish it first")
        self._apply_threads()
        self._optimizer.zero_grad(set_to_none=True)
        self._tally = _Tally()
        self._in_step = True

    def abandon_step(self) -> None:
        """Drop the open step's gradients without an update (its round failed or was
        interrupted); a no-op outside a step."""
        if self._in_step:
            self._optimizer.zero_grad(set_to_none=True)
            self._tally = _Tally()
            self._in_step = False

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        """Forward and backward over `samples`; gradients add up until `finish_step`.

        Returns this call's counts (samples, sequences, tokens, micro-batches, overlong
        filtered), all known on the host: the loss stats are synced once, by
        `finish_step`."""
        if not self._in_step:
            raise RuntimeError("accumulate called outside a step; call begin_step first")
        for s in samples:
            _check_sample(s)
        call = _Tally(samples=len(samples))
        # An empty response has nothing to score; it still counts as a sample seen.
        scored: list[TrainSample] = []
        for s in samples:
            if self._overlong_filter and s.truncated:
                call.overlong_filtered += 1
            elif s.response_ids:
                scored.append(s)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in scored]
        for batch in pack_micro_batches(lengths, self._micro_batch_tokens):
            call.add(_Tally(micro_batches=1, sums=self._micro_batch([scored[i] for i in batch])))
        call.sequences = len(scored)
        call.tokens = sum(len(s.response_ids) for s in scored)
        self._tally.add(call)
        return call.counts()

    def finish_step(self) -> Mapping[str, float]:
        """Divide the summed gradient by the loss's normaliser over the whole step, clip
        it, take exactly one AdamW step and bump `version`.

        A step with nothing to normalise by (no loss tokens) does not touch the
        optimizer: it returns metrics with `stepped=0.0` and `version` unchanged (the
        loop may legitimately see a step whose samples are all empty or filtered).

        A non-finite gradient norm raises FloatingPointError without stepping; the
        gradients are dropped and the trainer remains usable."""
        if not self._in_step:
            raise RuntimeError("finish_step called outside a step; call begin_step first")
        self._in_step = False
        tally, self._tally = self._tally, _Tally()
        divisor = self._spec.normaliser.divisor(
            tally.tokens, tally.sequences, self._max_response_tokens
        )
        metrics = tally.counts()
        metrics["torch_threads"] = float(torch.get_num_threads())
        if divisor == 0 or tally.sums is None:
            self._optimizer.zero_grad(set_to_none=True)
            metrics.update(_stat_metrics(None, tally.tokens, 0, self._settings.kl_coef > 0))
            metrics.update(stepped=0.0, version=float(self._version))
            return metrics

        for p in self._params:
            if p.grad is not None:
                p.grad.div_(divisor)
        max_norm = self._grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        # The step's one device -> host sync: loss stats and grad norm together.
        values = torch.cat([tally.sums, grad_norm.reshape(1).to(tally.sums)]).tolist()
        norm = values[-1]
        if not math.isfinite(norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite grad norm {norm}; step skipped")
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._version += 1
        sums = dict(zip(STAT_KEYS, values))
        metrics.update(_stat_metrics(sums, tally.tokens, divisor, self._settings.kl_coef > 0))
        metrics.update(
            grad_norm=norm,
            lr=float(self._optimizer.param_groups[0]["lr"]),
            stepped=1.0,
            version=float(self._version),
        )
        return metrics

    def _micro_batch(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        """Forward + backward of one right-padded micro-batch; returns its stat sums
        (in `STAT_KEYS` order) as one detached float64 tensor, left on the device."""
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        # Right padding under causal attention needs no attention mask: a real token
        # only attends to earlier positions, which are all real. Without a mask SDPA
        # keeps its causal fast path. The pad id is arbitrary for the same reason.
        input_ids = torch.zeros((len(samples), width), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        pos: list[int] = []
        old: list[float] = []
        for row, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            # Position t predicts token t+1: response token j of a row with a P-token
            # prompt is scored at position P-1+j.
            n, first = len(s.response_ids), len(s.prompt_ids) - 1
            rows.extend([row] * n)
            cols.extend(range(first, first + n))
            pos.extend(range(n))
            old.extend(s.old_logprobs)

        dev = self._device
        input_ids = self._h2d(input_ids)
        rows_t = self._h2d(torch.tensor(rows))
        cols_t = self._h2d(torch.tensor(cols))
        targets = input_ids[rows_t, cols_t + 1]
        logp, entropy = self._token_logprobs(self._model, input_ids, rows_t, cols_t, targets)
        ref_logp = None
        if self._settings.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _ = self._token_logprobs(
                    self._reference_model(), input_ids, rows_t, cols_t, targets
                )

        # The losses work on [B, L] (per-sequence reductions); scatter the flat tokens
        # into it. index_put is out of place here, so gradients flow back through it.
        lengths = self._h2d(torch.tensor([len(s.response_ids) for s in samples]))
        shape = (len(samples), max(len(s.response_ids) for s in samples))
        where = (rows_t, self._h2d(torch.tensor(pos)))

        def pad(flat: torch.Tensor) -> torch.Tensor:
            return flat.new_zeros(shape).index_put(where, flat)

        batch = PolicyBatch(
            logp=pad(logp),
            old_logp=pad(self._h2d(torch.tensor(old, dtype=torch.float64))),
            advantages=self._h2d(torch.tensor([s.advantage for s in samples], dtype=torch.float64)),
            mask=torch.arange(shape[1], device=dev) < lengths.unsqueeze(1),
            entropy=pad(entropy),
            ref_logp=pad(ref_logp) if ref_logp is not None else None,
        )
        loss_sum, stats = self._spec.fn(batch, self._settings)
        loss_sum.backward()
        return torch.stack([stats[k].to(torch.float64) for k in STAT_KEYS])

    def _token_logprobs(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of each target from the decoder's final hidden states at
        (rows, cols) and the LM head weight, without the [B, T, V] logits."""
        out = model.get_decoder()(input_ids=input_ids, use_cache=False)
        hidden = out.last_hidden_state[rows, cols]
        weight = model.get_output_embeddings().weight
        if hidden.dtype == torch.float64:
            return token_logprobs_and_entropy(
                hidden @ weight.T, targets, self._temperature,
                entropy_grad=self._settings.entropy_coef > 0,
            )
        return token_logprobs_entropy(hidden, weight, targets, self._temperature)

    def _reference_model(self) -> torch.nn.Module:
        if self._reference is None:
            ref = AutoModelForCausalLM.from_pretrained(self._reference_dir, dtype=self._dtype)
            self._reference = ref.to(self._device).eval().requires_grad_(False)
        return self._reference

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        # From pageable memory a host-to-device copy waits for the stream to drain;
        # pinned and non-blocking, it queues behind the previous micro-batch's work.
        if self._device.type != "cuda":
            return t
        return t.pin_memory().to(self._device, non_blocking=True)

    def _apply_threads(self) -> None:
        if self._torch_threads and torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)

    # -- checkpoints ----------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write an HF model directory (safetensors weights, config, the tokenizer files
        and generation_config copied from the source model directory) that transformers
        and vLLM load as is, plus `trainer_state.pt` (optimizer state, version, RNG
        state) for `load`. `directory` should be new or empty: making the write atomic
        (a temporary name, then a rename) is the caller's job (`rpk.checkpoint`)."""
        if self._in_step:
            raise RuntimeError("cannot save in the middle of a step")
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        self._save_pretrained(target)
        for name in _copied_files(self._source_dir):
            shutil.copy2(self._source_dir / name, target / name)
        torch.save(self._state(), target / STATE_FILE)

    def _save_pretrained(self, directory: Path) -> None:
        # The config must name the dtype the weights are saved in: a source config that
        # says bfloat16 over float32 weights makes vLLM warn on every tensor it loads.
        self._model.config.dtype = self._dtype
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

    def load(self, directory: str | Path) -> None:
        """Restore optimizer state, version and RNG state from a checkpoint written by
        `save`. Construct the trainer from that same directory first (that loads the
        weights). Hyperparameters stay those given to the constructor: the checkpoint
        carries state, not settings
        (the KL reference's directory is state: it stays the run's initial model)."""
        if self._in_step:
            raise RuntimeError("cannot load state in the middle of a step")
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
        self._optimizer.load_state_dict(state["optimizer"])
        for group in self._optimizer.param_groups:
            group.update(self._opt_hparams)
        self._version = int(state["version"])
        # The KL reference is the run's initial model, not the checkpoint this trainer
        # was built from.
        reference = state.get("reference_dir")
        if reference is not None and Path(reference) != self._reference_dir:
            self._reference_dir, self._reference = Path(reference), None
        torch.set_rng_state(state["torch_rng"])
        cuda_rng = state.get("cuda_rng")
        if cuda_rng is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_rng)

    def _state(self) -> dict[str, object]:
        cuda_rng = torch.cuda.get_rng_state_all() if self._device.type == "cuda" else None
        return {
            "optimizer": self._optimizer.state_dict(),
            "version": self._version,
            "reference_dir": str(self._reference_dir),
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


def _stat_metrics(
    sums: Mapping[str, float] | None, tokens: int, divisor: int, kl_on: bool
) -> dict[str, float]:
    """The step's loss (over the loss's own normaliser) and token means of the rest;
    zeros when nothing was seen."""
    values = dict(sums) if sums is not None else dict.fromkeys(STAT_KEYS, 0.0)
    per_token = 1.0 / tokens if tokens else 0.0
    low, high = values["clipped_low"] * per_token, values["clipped_high"] * per_token
    metrics = {
        "loss": values["loss_sum"] / divisor if divisor else 0.0,
        "clip_frac": low + high,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "logprob_mismatch": values["abs_logp_diff"] * per_token,
        "ratio_mean": values["ratio_sum"] * per_token,
        "entropy": values["entropy_sum"] * per_token,
    }
    if kl_on:
        metrics["kl"] = values["kl_sum"] * per_token
    return metrics


def _check_lm_head(model: torch.nn.Module) -> None:
    # The fused log-prob takes hidden @ weight.T as the logits: a head that adds a bias
    # would be silently wrong.
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(f"the trainer needs a bias-free linear LM head, got {head!r}")


def _copied_files(source: Path) -> list[str]:
    names = {n for n in _COPIED_FILES if (source / n).is_file()}
    for pattern in _COPIED_GLOBS:
        names.update(p.name for p in source.glob(pattern) if p.is_file())
    return sorted(names)
