"""A vLLM replica's settings: the records rpk starts one with (`VLLMSettings` and its
nested choices), their JSON form for a remote engine host, and their translation into
vLLM's `AsyncEngineArgs` keywords. Pure data and arithmetic: no vLLM import, so a dry run
and the config checks use it without loading vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rpk.core.drafts import SpecMethod
from rpk.core.modes import Runner
from rpk.sync.backends import BACKENDS, Backend

_WORKER_EXTENSION = "rpk.sync.worker.ext.RpkWorkerExtension"
# rpk's speculative-decoding proposer, which vLLM imports in its worker (`custom_class`).
DRAFT_PROPOSER = "rpk.sync.worker.spec.DraftProposer"


@dataclass(frozen=True, slots=True)
class PrefetchOffload:
    """vLLM's prefetch weight offload (`offload_backend="prefetch"`): of every
    `group_size` decoder layers the last `num_in_group` live in pinned host memory and are
    copied in `prefetch_step` layers ahead of the compute (a colocated judge's layers)."""

    group_size: int
    num_in_group: int
    prefetch_step: int = 1


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """Speculative decoding in a replica. `max_k` is vLLM's `num_speculative_tokens`,
    fixed at start (the longest draft); `schedule` its
    `num_speculative_tokens_per_batch_size` at start, `(lo, hi, k)` ranges from batch
    size 1 (() : `max_k` at every size). rpk's proposer takes a new schedule every round
    (`VLLMEngine.set_drafts`); vLLM's ngram keeps this one. `ngram`: its prompt-lookup
    n-gram sizes (min, max)."""

    method: SpecMethod
    max_k: int = 8
    schedule: tuple[tuple[int, int, int], ...] = ()
    ngram: tuple[int, int] = (2, 4)
    # A plain replica beside each speculating one (`rpk.engine.vllm_fleet`): rounds run
    # on it, free of speculation's cost per step, and hand their tail to the twin.
    twin: bool = False

    def config(self, max_num_seqs: int) -> dict[str, object]:
        """vLLM's `speculative_config`."""
        schedule = [list(b) for b in self.schedule] or [[1, max_num_seqs, self.max_k]]
        out: dict[str, object] = {
            "method": self.method.value, "num_speculative_tokens": self.max_k,
            "num_speculative_tokens_per_batch_size": schedule,
        }
        if self.method is SpecMethod.RPK:
            out["model"] = DRAFT_PROPOSER
        else:
            out.update(prompt_lookup_min=self.ngram[0], prompt_lookup_max=self.ngram[1])
        return out


@dataclass(frozen=True, slots=True)
class VLLMSettings:
    model: Path | str  # a local HF model directory (config, weights, tokenizer)
    dtype: str = "float32"  # faster than bfloat16 on the CPU machines measured
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # requests decoded at once: the engine's concurrency
    # Tokens one scheduler step may hold (prefill chunks and decodes); None: vLLM's
    # default, 2048 for `AsyncLLM` (`UsageContext.ENGINE_CONTEXT`), which vLLM refuses
    # below max_num_seqs (`vllm/config/scheduler.py`). Set, it is a floor: `engine_kwargs`
    # raises it to max_num_seqs.
    max_num_batched_tokens: int | None = None
    # Explicit on CPU, where vLLM otherwise sizes the cache from a memory node that can
    # report far less than is free; None lets vLLM size it from gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = 256 * 2**20
    seed: int = 0
    enforce_eager: bool = True
    # None: off on CPU, where vLLM 0.32 crashes ("CPU Generator does not use offset") when
    # a request with its own seed has its prompt split over steps; vLLM's default on GPU.
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1  # > 1: one worker process per rank (vLLM's mp executor)
    # The weight path it is started for (`rpk.sync.backends.for_replica`): its vLLM
    # weight-transfer engine is the backend's (`BackendSpec.engine`), which
    # `rpk.sync.transport` drives; none for the spool's files and a LoRA run's adapters.
    backend: Backend = Backend.SPOOL
    # The GPUs it runs on, numbered as the trainer's rank 0 sees them: the `ipc` lane
    # hands a handle for each (vLLM's IPC engine looks up its worker's own GPU).
    devices: tuple[int, ...] = ()
    # vLLM's cumem allocator: without it `sleep` frees nothing on a GPU (colocation needs it).
    enable_sleep_mode: bool = False
    # > 0: a LoRA run's replica (`rpk.sync.adapter`): vLLM's LoRA on, adapters up to this
    # rank (one of vLLM's choices), one adapter a batch and room for the next one beside it.
    max_lora_rank: int = 0
    prefetch_offload: PrefetchOffload | None = None
    # POOLING: a discriminative reward model (`rpk.judge.vllm.VLLMRewardModel`), asked
    # through `AsyncLLM.encode`; nothing is sampled.
    runner: Runner = Runner.GENERATE
    speculative: SpecSettings | None = None  # None: no speculative decoding


def settings_from_json(model: Path | str, fields: Mapping[str, object]) -> VLLMSettings:
    """`VLLMSettings` from `dataclasses.asdict` of one (less `model`) sent as JSON: the
    engine host's (`rpk.cluster.host`), its nested records rebuilt."""
    f = dict(fields)
    if isinstance(off := f.get("prefetch_offload"), Mapping):
        f["prefetch_offload"] = PrefetchOffload(**off)
    if isinstance(spec := f.get("speculative"), Mapping):
        f["speculative"] = SpecSettings(
            SpecMethod(spec["method"]), int(spec["max_k"]),  # type: ignore[call-overload]
            tuple(tuple(int(x) for x in b) for b in spec["schedule"]),  # type: ignore[attr-defined,misc]
            tuple(int(x) for x in spec["ngram"]),  # type: ignore[attr-defined,arg-type]
            bool(spec.get("twin", False)),
        )
    if isinstance(backend := f.get("backend"), str):
        f["backend"] = Backend(backend)
    if isinstance(runner := f.get("runner"), str):
        f["runner"] = Runner(runner)
    for name in ("devices",):
        if isinstance(f.get(name), list):
            f[name] = tuple(f[name])  # type: ignore[arg-type]
    return VLLMSettings(model=model, **f)  # type: ignore[arg-type]


def engine_kwargs(settings: VLLMSettings, cuda: bool) -> dict[str, object]:
    """The keyword arguments of `vllm.AsyncEngineArgs` for `settings` (what a dry run
    prints and what `launch` passes). On CUDA the KV cache is sized by
    `gpu_memory_utilization` alone: an explicit `kv_cache_memory_bytes` would override it."""
    kwargs: dict[str, object] = dict(
        model=str(settings.model),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=batched_tokens(settings),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        distributed_executor_backend="mp" if settings.tensor_parallel_size > 1 else None,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        enable_chunked_prefill=(
            settings.enable_chunked_prefill
            if settings.enable_chunked_prefill is not None
            else (None if cuda else False)
        ),
        enable_sleep_mode=settings.enable_sleep_mode,
        worker_extension_cls=_WORKER_EXTENSION,
        # The log-probs of the distribution actually sampled (after temperature and
        # top-p): the behaviour policy of the PPO ratio.
        logprobs_mode="processed_logprobs",
        # vLLM's own loggers off; rpk's counts preemptions and KV use per replica.
        disable_log_stats=True,
    )
    if (engine := BACKENDS[settings.backend].engine) is not None:
        kwargs["weight_transfer_config"] = {"backend": engine}
    if settings.max_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=settings.max_lora_rank, max_loras=1, max_cpu_loras=2)
    if (off := settings.prefetch_offload) is not None:
        kwargs.update(offload_backend="prefetch", offload_group_size=off.group_size,
                      offload_num_in_group=off.num_in_group, offload_prefetch_step=off.prefetch_step)
    if (spec := settings.speculative) is not None:
        kwargs["speculative_config"] = spec.config(settings.max_num_seqs)
        # Each finished request's accepted drafts: its tokens less them are the steps
        # it took, which the measured cost curve counts (`rpk.sched.provision.CostCurve`).
        kwargs["per_request_spec_decode_metrics"] = "summary"
    if not cuda:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    if settings.runner is Runner.POOLING:
        kwargs["runner"] = Runner.POOLING.value
        del kwargs["logprobs_mode"]  # nothing is sampled
    return kwargs


def batched_tokens(settings: VLLMSettings) -> int | None:
    """The engine's `max_num_batched_tokens`: the settings' floor, raised to
    max_num_seqs (vLLM refuses fewer: every running sequence decodes a token a step)."""
    if settings.max_num_batched_tokens is None:
        return None
    return max(settings.max_num_batched_tokens, settings.max_num_seqs)
