"""rpk's rollout engine: vLLM's `AsyncLLM`, one request per response, in-place weight sync.

`AsyncLLM` always runs its engine core in a child process; with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` the model worker runs inside that child too (two
processes, not three). The trainer lives in rpk's main process, which vLLM leaves alone:
its CPU worker replaces `torch.set_num_threads` with a no-op, but only in the process the
worker runs in, never in the main one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterable, AsyncIterator, Iterator, Sequence

# Imported before `_engine_env` sets OMP_NUM_THREADS=1: torch's OpenMP runtime reads the
# variable once, when it loads, so the main process (the trainer) keeps its own threads.
import torch
from safetensors.torch import save_file

from rpk.core.errors import UserError
from rpk.core.protocols import WeightBucket
from rpk.core.records import FinishReason, GenDelta, GenRequest
from rpk.engine.plugin import OWNER_ENV

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import RequestOutputCollector

_WORKER_EXTENSION = "rpk.engine.worker_ext.RpkWorkerExtension"

# Set for the engine only where the user has not set them.
_ENGINE_ENV_DEFAULTS = {
    # Model worker inside the engine-core process: start-up ~20 s instead of ~40 s on CPU.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # One OpenMP thread is the fastest decode on small CPU machines (2 threads was slower
    # than 1 by 7x on 2 cores, where the scheduler needs the other core).
    "OMP_NUM_THREADS": "1",
}
# The spawned engine core must inherit these (vLLM's CPU platform also puts torch's
# libgomp, and tcmalloc where bundled, in LD_PRELOAD for it), but rpk's own later child
# processes (reward sandboxes, data workers) must not: they are put back once it is up.
_SPAWN_ONLY_ENV = ("OMP_NUM_THREADS", "LD_PRELOAD", OWNER_ENV)

_FINISH_REASONS = frozenset(r.value for r in FinishReason)


class EngineStartError(UserError, RuntimeError):
    """The engine could not start: bad model directory, bad settings, or vLLM failed."""


class GenerationError(RuntimeError):
    """vLLM ended a request with an internal error ("error" finish reason)."""


@dataclass(frozen=True, slots=True)
class VLLMSettings:
    model: Path | str  # a local HF model directory (config, weights, tokenizer)
    dtype: str = "float32"  # faster than bfloat16 on the CPU machines measured
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # requests decoded at once: the engine's concurrency
    # Explicit on CPU, where vLLM otherwise sizes the cache from a memory node that can
    # report far less than is free; None lets vLLM size it from gpu_memory_utilization.
    kv_cache_memory_bytes: int | None = 256 * 2**20
    seed: int = 0
    enforce_eager: bool = True
    # None: off on CPU, where vLLM 0.32 crashes ("CPU Generator does not use offset") when
    # a request with its own seed has its prompt split over steps; vLLM's default on GPU.
    enable_chunked_prefill: bool | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1


class VLLMEngine:
    """The `rpk.core.protocols.Engine` over vLLM. Build it with `await VLLMEngine.launch(...)`."""

    def __init__(self, llm: AsyncLLM, settings: VLLMSettings) -> None:
        self._llm: AsyncLLM | None = llm
        self.settings = settings
        self._live: set[str] = set()  # request ids added and not yet ended
        self._queues: dict[str, RequestOutputCollector] = {}
        self.weight_version: int | None = None
        self.last_sync_s: float | None = None  # duration of the last weight sync

    @classmethod
    async def launch(cls, settings: VLLMSettings) -> VLLMEngine:
        """Start vLLM on `settings.model`. Blocks the event loop while vLLM loads the model
        (tens of seconds on CPU): nothing else should be running yet."""
        model_dir = Path(settings.model)
        if not (model_dir / "config.json").is_file():
            raise EngineStartError(
                f"vLLM cannot start: {model_dir} is not a model directory (no config.json)"
            )
        try:
            with _engine_env():
                # No local names the AsyncLLM: vLLM keeps an import-time traceback (a
                # failed optional import) whose frames chain back to this one, and a
                # local here would keep the engine alive until interpreter exit.
                engine = cls(_async_llm(model_dir, settings), settings)
        except Exception as e:
            raise EngineStartError(
                f"vLLM failed to start on {model_dir}: {type(e).__name__}: {e}"
            ) from e
        # vLLM's CPU start-up skips its warm-up forward pass (eager mode, explicit KV
        # size), so a model it cannot run (say a head size its CPU attention lacks)
        # would only kill the engine at the first real request.
        try:
            warm_up = (await engine.start([GenRequest("rpk-warm-up", (0,), max_tokens=1)]))
            async for _ in warm_up["rpk-warm-up"]:
                pass
        except Exception as e:
            await engine.shutdown()
            raise EngineStartError(
                f"vLLM started on {model_dir} but failed its first forward pass: "
                f"{type(e).__name__}: {e}"
            ) from e
        return engine

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_num_seqs

    def _running_llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("the vLLM engine is shut down")
        return self._llm

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Add `requests` and return a stream per request id.

        The engine's scheduler is paused while they are added, so they all start at the
        same scheduler step: which response finishes first then depends on the
        responses' lengths, not on how fast this process got them across, and a round
        reproduces. Each stream must be consumed to its end, closed, or its request
        aborted."""
        llm = self._running_llm()
        ids = [r.request_id for r in requests]
        taken = set(ids) & self._live
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"request ids already running or repeated: {sorted(taken) or ids}")
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            for r in requests:
                self._queues[r.request_id] = await llm.add_request(
                    r.request_id, _prompt(r), _sampling_params(r)
                )
                self._live.add(r.request_id)
        finally:
            await llm.resume_generation()
        return {rid: self._stream(llm, rid) for rid in ids}

    async def _stream(self, llm: AsyncLLM, rid: str) -> AsyncIterator[GenDelta]:
        queue = self._queues[rid]
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                delta = _to_delta(rid, out)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                # The consumer left early (cancelled, closed): the request must not run on.
                await asyncio.shield(self.abort(rid))
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._live.discard(rid)
        queue = self._queues.pop(rid, None)
        if queue is not None:
            queue.close()

    async def abort(self, request_id: str) -> None:
        """End a live request: a stream still consumed then ends with a delta finished
        with finish_reason "abort" carrying every token generated. A request that has
        already finished, an unknown id, or a dead engine (its requests ended with it)
        is ignored."""
        if request_id not in self._live or self._llm is None or self._llm.errored:
            return
        await self._llm.abort(request_id)

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        """Load HF-named weights (a `Qwen2ForCausalLM.state_dict()`, in buckets) into the
        engine in place, as version `version`.

        Refused while requests run: they would continue under other weights than they
        started with, and the prefix-cache reset (cached KV was computed with the old
        weights) only succeeds on an idle engine. Each bucket is written to a
        safetensors spool file as it arrives (so the sender holds one bucket at a time;
        the RPC itself would serialise tensors as msgpack lists), and the worker then
        reloads them all in one pass, reading the files lazily."""
        llm = self._running_llm()
        if running := llm.get_num_unfinished_requests():
            raise RuntimeError(
                f"update_weights with {running} request(s) running; abort them first"
            )
        started = time.perf_counter()
        paths: list[Path] = []
        try:
            async for bucket in buckets:
                nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
                paths.append(_spool_file(nbytes))
                await asyncio.to_thread(_save_weights, bucket, paths[-1])
            await llm.collective_rpc("rpk_reload_weights", args=([str(p) for p in paths],))
            if not await llm.reset_prefix_cache():
                raise RuntimeError(
                    "weights updated but the prefix cache could not be reset: a request "
                    "started during the update"
                )
        finally:
            for path in paths:
                path.unlink(missing_ok=True)
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - started

    async def shutdown(self) -> None:
        """Abort what is running (its streams end as aborted) and stop vLLM. Idempotent."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        if self._live:
            await llm.abort(list(self._live))
        llm.shutdown()

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()


def _prompt(request: GenRequest) -> TokensPrompt:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))


def _sampling_params(request: GenRequest) -> SamplingParams:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=1,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        logprobs=0,  # just the sampled token's log-prob
        # One output per request, when it ends (finished or aborted, with every token).
        # Each consumer then wakes exactly when its request ends, in the engine's order:
        # with per-token deltas a lagging consumer could see a later finish before an
        # earlier one, and which responses a round keeps would depend on load.
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _async_llm(model_dir: Path, settings: VLLMSettings) -> AsyncLLM:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            seed=settings.seed,
            enforce_eager=settings.enforce_eager,
            enable_chunked_prefill=(
                settings.enable_chunked_prefill
                if settings.enable_chunked_prefill is not None
                else (None if torch.cuda.is_available() else False)
            ),
            worker_extension_cls=_WORKER_EXTENSION,
            # The log-probs of the distribution actually sampled (after temperature and
            # top-p): the behaviour policy of the PPO ratio.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
    )


@contextlib.contextmanager
def _engine_env() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in _SPAWN_ONLY_ENV}
    for key, value in _ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ[OWNER_ENV] = str(os.getpid())  # rpk.engine.plugin: die with this process
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _to_delta(request_id: str, out: RequestOutput) -> GenDelta:
    completion = out.outputs[0]
    token_ids = tuple(completion.token_ids)
    logprobs = tuple(
        position[token].logprob
        for position, token in zip(completion.logprobs or (), token_ids, strict=True)
    )
    reason = completion.finish_reason if out.finished else None
    if reason is not None and reason not in _FINISH_REASONS:
        raise GenerationError(f"vLLM ended request {request_id!r} with {reason!r}")
    return GenDelta(
        request_id=request_id,
        token_ids=token_ids,
        logprobs=logprobs,
        text=completion.text,
        finished=out.finished,
        finish_reason=FinishReason(reason) if reason is not None else None,
    )


def _save_weights(bucket: WeightBucket, path: Path) -> None:
    """Write CPU copies, keeping the first name of tensors that share memory: safetensors
    refuses shared tensors, and tied weights are one tensor that vLLM loads under the
    embedding's name (first in a state_dict; `lm_head.weight` comes last)."""
    seen: set[tuple[torch.device, int, tuple[int, ...]]] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in bucket:
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().to("cpu").contiguous()
    save_file(unique, str(path))


def _spool_file(nbytes: int) -> Path:
    """A fresh file in /dev/shm (RAM) when it has room, else in the temp dir: container
    /dev/shm is often only 64 MiB."""
    shm = Path("/dev/shm")
    room = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * nbytes
    fd, name = tempfile.mkstemp(
        prefix="rpk-weights-", suffix=".safetensors", dir=shm if room else None
    )
    os.close(fd)
    return Path(name)
