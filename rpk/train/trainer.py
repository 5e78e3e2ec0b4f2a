"""`TorchTrainer`: the policy being trained, behind `rpk.core.protocols.Trainer`.

One HF causal LM (inside `rpk.train.head.PolicyModel`, which also computes the fused
log-prob head), one AdamW and one loss of the GRPO family, chosen by name from
`rpk.train.losses.LOSSES`. A step is `begin_step`, any number of `accumulate` calls, then
`finish_step`. `accumulate` packs its samples into micro-batches by a token budget, runs
forward and backward on each and lets the gradients pile up as the loss's unnormalised
*sums*; `finish_step` divides them by the loss's normaliser counted over the whole step
(response tokens, sequences, or sequences x max_tokens) and takes one optimizer step.
The update therefore does not depend on the split or the order of the samples, which is
what lets the loop stream groups into the trainer as they finish.

Sharded (`sharding` given: one trainer per data-parallel rank, FSDP2 via
`rpk.train.fsdp`), the same object is one rank's part: a driver gives every rank its
micro-batches (`run_micro_batches`, the same number on every rank), counts and stats are
summed over the ranks in `finish_step`, gradients are reduced once, at the step's end,
and weights leave gathered from the shards.

Every method blocks (forward/backward/optimizer run on the calling thread); the asyncio
loop calls them from one dedicated thread. Nothing here is thread-safe: one caller.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rpk.core.modes import Offload
from rpk.core.protocols import WeightBucket
from rpk.core.records import TrainSample
from rpk.gpu.launch import Sharding
from rpk.gpu.streams import wait_for_stream_blocking
from rpk.sync.m2n_plan import Mesh, ParamLayout
from rpk.sync.m2n_send import ShardBucket
from rpk.train import fsdp, load, lora, offload, state
from rpk.train.head import PolicyModel, hf_name
from rpk.train.losses import STAT_KEYS, LossSettings, Normaliser, PolicyBatch, loss_spec
from rpk.train.packing import pack_micro_batches
from rpk.train.tally import Tally, check_sample, stat_metrics
from rpk.train.weight_mode import weight_mode
from rpk.train.weights import bucketed, local_shard, shard_layouts

# A zero-weighted pass: what a rank with no micro-batch left runs so that every rank
# makes the same FSDP collectives (and the pass that flushes deferred gradients).
_EMPTY_PASS = TrainSample(prompt_ids=(0,), response_ids=(0,), old_logprobs=(0.0,), advantage=0.0)


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    parsed = getattr(torch, dtype, None)
    if not isinstance(parsed, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return parsed


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    """The optimizer, the loss and how a step runs: the config's `train` section
    (`rpk.config.TrainConfig`, which says what each field means), as `rpk.assembly.settings` copies it
    for the trainer; the defaults are that section's."""

    lr: float = 5e-5
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: str = "grpo"
    clip_low: float | None = None
    clip_high: float | None = None
    overlong_filter: bool | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    micro_batch_tokens: int = 8192
    torch_threads: int = 0
    activation_checkpointing: bool | None = None
    defer_reduction: bool | None = None


class TorchTrainer:
    """GRPO-family policy trainer (implements `rpk.core.protocols.Trainer`).

    All methods are blocking; call them from a worker thread in async code.

    `settings` (`TrainerSettings`) says how it trains; `loss` names an entry of
    `LOSSES`, and `clip_low`, `clip_high` and `overlong_filter` left at None take that
    loss's defaults (DAPO's clip-higher 0.2/0.28, GSPO's 3e-4/4e-4, ...). What the
    trainer needs from the sampler is passed beside it: `max_response_tokens` (the
    length budget, Dr. GRPO's constant normaliser) and `temperature` (log-probs are taken
    under softmax(logits / temperature), the distribution the sampler drew from).
    `kl_coef > 0` adds a k3 KL penalty to a frozen reference model, loaded from
    `reference_dir` (default: `model_dir`, i.e. the initial weights) at the first step
    that needs it (with LoRA `adapters` the reference is the base, adapters off);
    `entropy_coef > 0` adds an entropy bonus. `micro_batch_tokens` bounds rows x padded
    length of one forward pass (prompt tokens included: they cost memory too).
    `grad_clip=0` disables clipping (the norm is still reported).

    `torch_threads` sizes torch's CPU intra-op pool for the trainer. The count torch
    stores is process-wide, but OpenMP's is per thread and a thread reads the stored one
    only on its first parallel op: a thread that ran torch code earlier keeps its old
    count. So it is applied at construction and again by `begin_step`, on whichever
    thread runs the step; the rollout engine's CPU threads live in its own process.

    With `dtype=torch.bfloat16` the parameters, gradients and optimizer state are all
    bf16 (no fp32 master copy); float32 is the default for that reason (sharded on GPU,
    parameters stay float32 and FSDP computes in bf16). A float64 model (the exactness
    tests) takes the plain log_softmax path, since the fused kernel computes in float32.
    """

    def __init__(
        self,
        model_dir: str | Path,
        settings: TrainerSettings = TrainerSettings(),
        *,
        max_response_tokens: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        reference_dir: str | Path | None = None,
        sharding: Sharding | None = None,
        defer_reduction: bool = True,
        adapters: lora.LoraSettings | None = None,
    ) -> None:
        spec = loss_spec(settings.loss)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if spec.normaliser is Normaliser.SEQUENCE_BUDGET and not (max_response_tokens or 0) > 0:
            raise ValueError(
                f"loss {settings.loss!r} normalises by max_response_tokens, which must be > 0, "
                f"got {max_response_tokens!r}"
            )
        self._settings = LossSettings(
            clip_low=spec.clip_low if settings.clip_low is None else settings.clip_low,
            clip_high=spec.clip_high if settings.clip_high is None else settings.clip_high,
            kl_coef=settings.kl_coef,
            entropy_coef=settings.entropy_coef,
        )
        self._torch_threads = settings.torch_threads or None
        self._apply_threads()
        torch.manual_seed(seed)

        self._spec = spec
        self._overlong_filter = (
            spec.overlong_filter if settings.overlong_filter is None else settings.overlong_filter
        )
        self._max_response_tokens = max_response_tokens or 0
        self._source_dir = Path(model_dir)
        self._reference_dir = Path(reference_dir) if reference_dir is not None else self._source_dir
        self._reference: PolicyModel | None = None
        self._device = torch.device(device)
        self._dtype = _parse_dtype(dtype)
        self._grad_clip = settings.grad_clip
        self._micro_batch_tokens = settings.micro_batch_tokens
        self._temperature = temperature
        # A Sharding comes from `rpk.gpu.launch.join`, i.e. a rank of a process group;
        # a group of one is still sharded, so that its collectives run as a world's do.
        self._sharding = sharding

        recompute = settings.activation_checkpointing
        self._policy = load.load_policy_model(
            self._source_dir, self._dtype, self._device, self._sharding, temperature=temperature,
            entropy_grad=settings.entropy_coef > 0,
            recompute=recompute if recompute is not None else self._device.type == "cuda",
            adapters=adapters,
        )
        self._mode = weight_mode(adapters)  # every weight, or LoRA's adapters alone
        self._defer_reduction = settings.defer_reduction if settings.defer_reduction is not None else defer_reduction
        self._params = [p for p in self._policy.parameters() if p.requires_grad]
        self._opt_hparams = {
            "lr": settings.lr, "betas": (settings.beta1, settings.beta2), "weight_decay": settings.weight_decay,
        }
        self._optimizer = torch.optim.AdamW(self._params, **self._opt_hparams)
        self._offload = offload.StateOffload(self._policy, self._optimizer, self._device)
        self._version = 0

        self._in_step = False
        self._tally = Tally()

    @property
    def version(self) -> int:
        """Number of optimizer steps taken since the source model (survives `save`)."""
        return self._version

    @property
    def model(self) -> torch.nn.Module:
        """The HF model (its parameters are shards when the trainer is sharded)."""
        return self._policy.lm

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def loss_settings(self) -> LossSettings:
        """The clip range and coefficients in force, loss defaults resolved. No part of
        the run reads it (the trainer uses its own copy): it is how a caller checks what
        `TrainerSettings`' unset fields resolved to."""
        return self._settings

    @property
    def overlong_filter(self) -> bool:
        return self._overlong_filter

    @property
    def micro_batch_tokens(self) -> int:
        return self._micro_batch_tokens

    def weight_buckets(self, max_bytes: int) -> Iterator[WeightBucket]:
        """The HF state_dict in buckets (`rpk.train.weights.bucketed`), for the rollout
        engine. Unsharded they alias the live parameters (no copy): consume them before
        the next step. Sharded, each tensor is gathered whole as its bucket fills, on
        every rank (all must iterate to the end), and no rank starts a bucket's gathers
        before rank 0 has sent the one before: queued early, a follower's gathers would
        spin on its GPU beside the vLLM worker receiving that bucket (two contexts
        time-slice a GPU without MPS)."""
        self._offload.restore()
        paced = functools.partial(fsdp.settled, self._sharding)
        return _settled(bucketed(self._mode.named_weights(self._policy), max_bytes, fsdp.full, paced), self._device)

    def weight_shards(self, max_bytes: int) -> Iterator[ShardBucket]:
        """`weight_buckets` without the gathers, for `nccl_m2n`: each tensor is this
        rank's own shard, as `shard_layout` describes it; no rank waits on another."""
        self._offload.restore()
        named = ((hf_name(n), t) for n, t in self._policy.state_dict().items())
        return (ShardBucket(b) for b in _settled(bucketed(named, max_bytes, local_shard), self._device))

    def shard_layout(self) -> tuple[Mesh, list[ParamLayout]]:
        """The mesh and per-tensor layouts of `weight_shards` (`rpk.train.weights`)."""
        return shard_layouts((hf_name(n), t) for n, t in self._policy.state_dict().items())

    def offload(self, what: Offload) -> None:
        """Between the weight sync and the next micro-batch (vLLM generates): drop the
        gradients and move the AdamW moments (`optimizer`) or them and the parameter
        shards (`all`) to host memory; `none` only drops the gradients. The first
        micro-batch, `finish_step`, `save` or `weight_buckets` brings them back.
        Every rank runs it; it returns once every rank's memory is free (vLLM's KV
        cache wakes into it next on each GPU)."""
        self._offload.offload(what)
        fsdp.settled(self._sharding)

    def restore(self) -> None:
        self._offload.restore()

    @property
    def offloaded(self) -> Offload:
        return self._offload.where

    # -- one step -------------------------------------------------------------------

    def begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("begin_step called while a step is open; finish it first")
        self._apply_threads()
        if self._settings.kl_coef > 0:
            # Built here, where every rank is (sharded, building it is a collective), not
            # at the first pass: under borrowing only some ranks make passes.
            self._reference_policy()
        self._optimizer.zero_grad(set_to_none=True)
        self._tally = Tally()
        self._in_step = True

    def abandon_step(self) -> None:
        """Drop the open step's gradients without an update (its round failed or was
        interrupted); a no-op outside a step. Sharded, every rank must call it."""
        if self._in_step:
            self._offload.restore()
            self._flush()
            self._optimizer.zero_grad(set_to_none=True)
            self._tally = Tally()
            self._in_step = False

    def compute_on(self, ranks: Sequence[int] | None) -> None:
        """Every chunk is computed here: only `rpk.train.dist.DistTrainer`, which drives
        the ranks, narrows them. Asked for other ranks, this trainer says so."""
        here = (self._sharding.rank if self._sharding is not None else 0,)
        if ranks is not None and tuple(ranks) != here:
            raise ValueError(f"compute_on: ranks {list(ranks)}, but this trainer computes on rank {here[0]} alone")

    def select(self, samples: Sequence[TrainSample]) -> tuple[list[TrainSample], Tally]:
        """The samples that enter the loss, and the counts of the call: an empty
        response has nothing to score, a truncated one is left out under the overlong
        filter; both still count as samples seen."""
        for s in samples:
            check_sample(s)
        call = Tally(samples=len(samples))
        scored: list[TrainSample] = []
        for s in samples:
            if self._overlong_filter and s.truncated:
                call.overlong_filtered += 1
            elif s.trained_positions():  # an all-observation response has no loss
                scored.append(s)
        return scored, call

    def accumulate(self, samples: Sequence[TrainSample]) -> Mapping[str, float]:
        """Forward and backward over `samples`; gradients add up until `finish_step`.

        Returns this call's counts (samples, sequences, tokens, micro-batches, overlong
        filtered), all known on the host: the loss stats are synced once, by
        `finish_step`. Unsharded only: sharded ranks take `run_micro_batches`."""
        scored, call = self.select(samples)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in scored]
        batches = [[scored[i] for i in b] for b in pack_micro_batches(lengths, self._micro_batch_tokens)]
        call.add(self._run(batches))
        self._tally.add(call)
        return call.counts()

    def run_micro_batches(
        self, batches: Sequence[Sequence[TrainSample]], seen: Tally | None = None
    ) -> Mapping[str, float]:
        """One rank's share of a chunk, as micro-batches already packed (an empty one is
        a zero-weighted pass). `seen`: the chunk's counts of samples and filtered ones,
        on the rank that selected it."""
        call = seen or Tally()
        for s in (s for b in batches for s in b):
            check_sample(s)
        call.add(self._run(batches))
        self._tally.add(call)
        return call.counts()

    def _run(self, batches: Sequence[Sequence[TrainSample]]) -> Tally:
        if not self._in_step:
            raise RuntimeError("accumulate called outside a step; call begin_step first")
        done = Tally()
        self._offload.restore()
        for batch in batches:
            if self._defer_reduction:
                fsdp.defer_reduction(self._policy)
            if not batch:
                (self._pass([_EMPTY_PASS])[0] * 0.0).backward()
                continue
            loss_sum, sums = self._pass(batch)
            loss_sum.backward()
            done.add(Tally(
                micro_batches=1, sequences=len(batch),
                tokens=sum(sum(s.loss_mask) if s.loss_mask else len(s.response_ids) for s in batch),
                sums=sums,
            ))
        return done

    def finish_step(self) -> Mapping[str, float]:
        """Divide the summed gradient by the loss's normaliser over the whole step (all
        ranks), clip it, take exactly one AdamW step and bump `version`.

        A step with nothing to normalise by (no loss tokens) does not touch the
        optimizer: it returns metrics with `stepped=0.0` and `version` unchanged (the
        loop may legitimately see a step whose samples are all empty or filtered).

        A non-finite gradient norm raises FloatingPointError without stepping; the
        gradients are dropped and the trainer remains usable.

        Every way out empties the caching allocator: the training peak stays reserved
        there otherwise, and vLLM's weights wake (another process) into what is left."""
        if not self._in_step:
            raise RuntimeError("finish_step called outside a step; call begin_step first")
        self._in_step = False
        try:
            return self._finish()
        finally:
            offload.release_cache(self._device)

    def _finish(self) -> Mapping[str, float]:
        self._offload.restore()
        self._flush()
        tally, self._tally = self._tally, Tally()
        # One sum over the ranks of every count and stat: the normaliser must be the
        # whole step's, and every rank must take the same decision below.
        local = torch.tensor(
            [tally.samples, tally.sequences, tally.tokens, tally.micro_batches,
             tally.overlong_filtered], dtype=torch.float64,
        )
        sums = tally.sums.cpu() if tally.sums is not None else torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        total = fsdp.all_sum(torch.cat([local, sums]), self._sharding).tolist()
        whole = Tally(*map(int, total[:5]))
        stat_sums = dict(zip(STAT_KEYS, total[5:]))
        divisor = self._spec.normaliser.divisor(
            whole.tokens, whole.sequences, self._max_response_tokens
        )
        metrics = whole.counts()
        metrics["torch_threads"] = float(torch.get_num_threads())
        if divisor == 0:
            self._optimizer.zero_grad(set_to_none=True)
            metrics.update(stat_metrics(None, whole.tokens, 0, self._settings.kl_coef > 0))
            metrics.update(stepped=0.0, version=float(self._version))
            return metrics

        for p in self._params:
            if p.grad is not None:
                p.grad.div_(divisor)
        max_norm = self._grad_clip or math.inf
        norm = float(fsdp.full(torch.nn.utils.clip_grad_norm_(self._params, max_norm)))
        if not math.isfinite(norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite grad norm {norm}; step skipped")
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._version += 1
        metrics.update(stat_metrics(stat_sums, whole.tokens, divisor, self._settings.kl_coef > 0))
        metrics.update(
            grad_norm=norm,
            lr=float(self._optimizer.param_groups[0]["lr"]),
            stepped=1.0,
            version=float(self._version),
        )
        return metrics

    def _flush(self) -> None:
        """Sharded: reduce the gradients the step's passes kept local (every rank)."""
        if self._sharding is not None:
            fsdp.flush(self._policy, self._pass([_EMPTY_PASS])[0] * 0.0)

    def _pass(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of one right-padded micro-batch; returns the loss sum (to backward)
        and its stat sums (in `STAT_KEYS` order) as one detached float64 tensor, left
        on the device."""
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        # Right padding under causal attention needs no attention mask: a real token
        # only attends to earlier positions, which are all real. Without a mask SDPA
        # keeps its causal fast path. The pad id is arbitrary for the same reason.
        input_ids = torch.zeros((len(samples), width), dtype=torch.long)
        rows: list[int] = []
        cols: list[int] = []
        pos: list[int] = []
        old: list[float] = []
        trained: list[int] = []
        for row, s in enumerate(samples):
            seq = s.prompt_ids + s.response_ids
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            # Position t predicts token t+1: response token j of a row with a P-token
            # prompt is scored at position P-1+j. Only the trained tokens are scored
            # (observations are context, not the model's): packed to the left of the
            # row's [B, L] slots, so the losses' length mask is the loss mask.
            keep, first = s.trained_positions(), len(s.prompt_ids) - 1
            rows.extend([row] * len(keep))
            cols.extend(first + j for j in keep)
            pos.extend(range(len(keep)))
            old.extend(s.old_logprobs[j] for j in keep)
            trained.append(len(keep))
        vocab = self.model.config.vocab_size
        if max(max(s.prompt_ids + s.response_ids) for s in samples) >= vocab:
            # Checked here, on the host, so that the kernel never has to read ids back.
            raise ValueError(f"a token id is outside the vocabulary of {vocab}")

        dev = self._device
        input_ids = self._h2d(input_ids)
        rows_t = self._h2d(torch.tensor(rows))
        cols_t = self._h2d(torch.tensor(cols))
        targets = input_ids[rows_t, cols_t + 1]
        ref_logp = None
        if self._settings.kl_coef > 0:
            self._mode.before_reference(
                self._sharding is not None, lambda: self._policy(input_ids[:1], rows_t[:1], cols_t[:1], targets[:1]))
            # Before the policy's forward: switching adapters off toggles their
            # requires_grad, which must not happen under a graph being built.
            with torch.no_grad(), self._reference_context():
                ref_logp, _ = self._reference_policy()(input_ids, rows_t, cols_t, targets)
        logp, entropy = self._policy(input_ids, rows_t, cols_t, targets)

        # The losses work on [B, L] (per-sequence reductions); scatter the flat tokens
        # into it. index_put is out of place here, so gradients flow back through it.
        lengths = self._h2d(torch.tensor(trained))
        shape = (len(samples), max(trained))
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
        return loss_sum, torch.stack([stats[k].detach().to(torch.float64) for k in STAT_KEYS])

    def _reference_context(self) -> contextlib.AbstractContextManager[None]:
        return self._mode.reference_context(self._policy)

    def _reference_policy(self) -> PolicyModel:
        """The frozen KL reference, built like the policy: sharded the same way (rank 0
        alone reads it; with the policy's bf16 compute on GPU, so that the KL of the
        initial model to itself is zero), whole when the trainer is. With LoRA it is
        the policy itself, used under `_reference_context` (adapters off)."""
        if self._reference is None:
            self._reference = self._mode.reference(self._policy, self._load_reference)
        return self._reference

    def _load_reference(self) -> PolicyModel:
        return load.load_policy_model(
            self._reference_dir, self._dtype, self._device, self._sharding,
            temperature=self._temperature, entropy_grad=False, recompute=False, trainable=False,
        )

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        # From pageable memory a host-to-device copy waits for the stream to drain;
        # pinned and non-blocking, it queues behind the previous micro-batch's work.
        if self._device.type != "cuda":
            return t
        return t.pin_memory().to(self._device, non_blocking=True)

    def _apply_threads(self) -> None:
        if self._torch_threads and torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)

    def close(self) -> None:
        """Nothing to release: the model goes with the object."""

    # -- checkpoints ----------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write an HF model directory (weights, config, the tokenizer files) that
        transformers and vLLM load as is, plus the trainer state (`rpk.train.state`).
        `directory` should be new or empty: making the write atomic (a temporary name,
        then a rename) is the caller's job (`rpk.checkpoint`). Sharded, every rank
        calls it with the same directory."""
        if self._in_step:
            raise RuntimeError("cannot save in the middle of a step")
        meta = {"version": self._version, "reference_dir": str(self._reference_dir)}
        self._offload.restore()
        self._mode.save(Path(directory), self._policy, self._optimizer, self._sharding, meta, self._source_dir,
                        self.weight_buckets)

    def load(self, directory: str | Path) -> None:
        """Restore optimizer state, weights, version and RNG state from a checkpoint
        written by `save` (on any number of ranks). Hyperparameters stay those given to
        the constructor: the checkpoint carries state, not settings (the KL reference's
        directory is state: it stays the run's initial model)."""
        if self._in_step:
            raise RuntimeError("cannot load state in the middle of a step")
        self._offload.restore()
        meta = state.load_state(
            Path(directory), self._policy, self._optimizer, self._sharding, frozen=self._mode.state_holds_frozen
        )
        for group in self._optimizer.param_groups:
            group.update(self._opt_hparams)
        self._version = int(meta["version"])
        reference = Path(meta["reference_dir"])
        if reference != self._reference_dir:
            self._reference_dir, self._reference = reference, None


def _settled(buckets: Iterator[WeightBucket], device: torch.device) -> Iterator[WeightBucket]:
    """Each bucket once the trainer's stream has done everything queued before it was
    handed out: the optimizer step, and the bucket's own `full_tensor()` gathers. The
    engine reads the tensors on another thread and CUDA stream (host copies, IPC
    handles, a NCCL broadcast), so it must wait for what was recorded after the last
    gather, not for what came before the first."""
    for bucket in buckets:
        wait_for_stream_blocking(device)
        yield bucket
