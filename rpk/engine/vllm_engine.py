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
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

# Imported before `_engine_env` sets OMP_NUM_THREADS=1: torch's OpenMP runtime reads the
# variable once, when it loads, so the main process (the trainer) keeps its own threads.
import torch

from rpk.core.drafts import DraftSource, PromptDrafts, SourceCounts, SpecMethod, SpecStats
from rpk.core.errors import UserError
from rpk.core.modes import RestLevel, Runner
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.engine.plugin import OWNER_ENV
from rpk.engine.vllm_settings import VLLMSettings, engine_kwargs
from rpk.engine.vllm_stats import ReplicaCounters, stat_logger_factory
from rpk.sync.adapter import AdapterVersion

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import RequestOutputCollector

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
# Aborted requests' tokens kept between two rounds at most (a round aborts far fewer).
_MAX_CUT = 1 << 16


class EngineStartError(UserError, RuntimeError):
    """The engine could not start: bad model directory, bad settings, or vLLM failed."""


class GenerationError(RuntimeError):
    """vLLM ended a request with an internal error ("error" finish reason)."""


class VLLMEngine:
    """The `rpk.core.protocols.Engine` over vLLM, and one replica of a rollout fleet
    (`rpk.engine.fleet`). Build it with `await VLLMEngine.launch(...)`."""

    def __init__(
        self, llm: AsyncLLM, settings: VLLMSettings, counters: ReplicaCounters, version: int,
        name: str = "replica",
    ) -> None:
        self._llm: AsyncLLM | None = llm
        self.settings = settings
        self.name = name  # in errors about this replica
        self._counters = counters
        self._live: set[str] = set()  # request ids added and not yet ended
        self._queues: dict[str, RequestOutputCollector] = {}
        self.weight_version: int | None = version  # None: dropped by a level-2 sleep
        self.adapter: AdapterVersion | None = None  # a LoRA run's: what every request carries
        self.base_dropped = False  # a level-2 sleep dropped the weights vLLM loaded at start
        self.last_sync_s: float | None = None  # duration of the last weight load
        self._cut: dict[str, tuple[int, ...]] = {}  # aborted requests' tokens (`_keep_cut`)
        # How vLLM's CPU expand kernel was corrected (`spec.install_cpu_kernels`): "registry",
        # "rebound" (rpk rebound it itself), "" where none was needed or nothing speculates.
        self.cpu_kernel_fix = ""
        # Keep them: rpk's proposer drafts from them (here, or on this replica's twin).
        self.keep_cut = settings.speculative is not None and settings.speculative.method is SpecMethod.RPK

    @classmethod
    async def launch(
        cls, settings: VLLMSettings, *, env: Mapping[str, str | None] | None = None, version: int = 0,
        name: str = "replica", verify: bool = False, in_thread: bool = False,
    ) -> VLLMEngine:
        """Start vLLM on `settings.model`, serving it as weight version `version`, with
        `env` (None: unset) in force while its processes start (the devices it runs on:
        `rpk.engine.placement.device_env`). Blocks the event loop while vLLM loads the
        model (tens of seconds on CPU): nothing else should be running yet, unless
        `in_thread` (an engine started again while the run goes on: the environment
        is set process-wide meanwhile, which child processes started then inherit).
        `verify`: its workers record digests of the weights they receive (`rpk.sync.verify`)."""
        model_dir = Path(settings.model)
        if not (model_dir / "config.json").is_file():
            raise EngineStartError(
                f"vLLM cannot start: {model_dir} is not a model directory (no config.json)"
            )
        counters = ReplicaCounters()
        try:
            if in_thread:
                def start() -> AsyncLLM:
                    with _engine_env(env or {}):
                        return _async_llm(model_dir, settings, counters)

                engine = cls(await start_in_thread(start), settings, counters, version, name)
            else:
                with _engine_env(env or {}):
                    # No local names the AsyncLLM: vLLM keeps an import-time traceback (a
                    # failed optional import) whose frames chain back to this one, and a
                    # local here would keep the engine alive until interpreter exit.
                    engine = cls(
                        _async_llm(model_dir, settings, counters), settings, counters, version, name
                    )
        except Exception as e:
            raise EngineStartError(
                f"vLLM failed to start on {model_dir}: {type(e).__name__}: {e}"
            ) from e
        # vLLM's CPU start-up skips its warm-up forward pass (eager mode, explicit KV
        # size), so a model it cannot run (say a head size its CPU attention lacks)
        # would only kill the engine at the first real request. The first request of a
        # TP>1 replica also takes seconds (its workers' first collectives).
        try:
            if settings.speculative is not None:
                # Before any request: vLLM 0.32's CPU fallback of a kernel its rejection
                # sampler needs writes nothing, so every sampled step that verifies
                # drafts would divide its logits by uninitialised temperatures.
                engine.cpu_kernel_fix = (await engine.llm.collective_rpc("rpk_spec_kernels"))[0]
            await engine._warm_up()
        except BaseException as e:
            await engine.shutdown()  # also when cancelled: a start abandoned leaves no engine
            if not isinstance(e, Exception):
                raise
            raise EngineStartError(
                f"vLLM started on {model_dir} but failed its first forward pass: "
                f"{type(e).__name__}: {e}"
            ) from e
        counters.take()  # the warm-up is nobody's round
        if verify:
            await engine.llm.collective_rpc("rpk_record_digests", args=(True,))
        return engine

    async def _warm_up(self) -> None:
        if self.settings.runner is Runner.POOLING:
            from vllm.inputs import TokensPrompt
            from vllm.pooling_params import PoolingParams

            async for _ in self.llm.encode(TokensPrompt(prompt_token_ids=[0]),
                                           PoolingParams(task="classify"), "rpk-warm-up"):
                pass
            return
        warm_up = await self.start([GenRequest("rpk-warm-up", (0,), max_tokens=1)])
        async for _ in warm_up["rpk-warm-up"]:
            pass

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_num_seqs

    @property
    def llm(self) -> AsyncLLM:
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
        async with self.paused():
            return await self.add(requests)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """The scheduler paused (running requests kept) for the block: what is added
        inside starts at one scheduler step."""
        llm = self.llm
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            yield
        finally:
            await llm.resume_generation()

    async def add(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        """Add `requests` (inside `paused` to start them together); a stream each."""
        llm = self.llm
        ids = [r.request_id for r in requests]
        taken = set(ids) & self._live
        if taken or len(set(ids)) != len(ids):
            raise ValueError(f"request ids already running or repeated: {sorted(taken) or ids}")
        for r in requests:
            self._queues[r.request_id] = await llm.add_request(
                r.request_id, _prompt(r), _sampling_params(r), lora_request=self._lora_request()
            )
            self._live.add(r.request_id)
        return {rid: self._stream(llm, rid) for rid in ids}

    def take_stats(self) -> ReplicaStats:
        """Preemptions and the KV-cache peak since the last call (vLLM's stat logger)."""
        return self._counters.take()

    @property
    def speculates(self) -> bool:
        return self.settings.speculative is not None

    @property
    def _rpk_drafts(self) -> bool:
        spec = self.settings.speculative
        return spec is not None and spec.method is SpecMethod.RPK

    async def set_drafts(self, schedule: Sequence[tuple[int, int, int]], sources: Sequence[DraftSource],
                         prompts: Sequence[PromptDrafts]) -> None:
        """A round's draft-length schedule, the sources its drafts may come from and its
        prompts' draft texts, into rpk's proposer in every worker (nothing without it)."""
        if self._rpk_drafts:
            await self.llm.collective_rpc(
                "rpk_spec_round", args=([list(b) for b in schedule], [int(s) for s in sources],
                                        [p.to_wire() for p in prompts]))

    async def add_drafts(self, prompts: Sequence[PromptDrafts]) -> None:
        """More draft texts mid-round: siblings that finished."""
        if self._rpk_drafts and prompts:
            await self.llm.collective_rpc("rpk_spec_add", args=([p.to_wire() for p in prompts],))

    async def take_spec_stats(self) -> SpecStats:
        """Speculative decoding since the last call: vLLM's counters, and rpk's
        proposer's by draft source."""
        stats = self._counters.take_spec()
        cut, self._cut = self._cut, {}
        if not self._rpk_drafts or self._llm is None:
            return dataclasses.replace(stats, cut=cut)
        # Every worker of a TP group drafts alike; the first one's counts are the replica's.
        got = (await self.llm.collective_rpc("rpk_spec_take"))[0]
        by_source = {DraftSource(int(s)): SourceCounts(*(int(x) for x in c)) for s, c in got.items()}
        return dataclasses.replace(stats, by_source=by_source, cut=cut)

    async def sleep(self, level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
        """vLLM's sleep (on GPU; vLLM's CPU worker keeps everything and only stops
        scheduling): level 1 moves the weights to host memory and drops the KV cache;
        level 2 drops both, so the weights must be loaded again after `wake` and the
        version served is unknown until then."""
        self._check_idle("sleep")
        await self.llm.sleep(level=int(level))
        if level.drops_weights:
            self.weight_version = None
            self.base_dropped = True

    async def wake(self, tags: Sequence[str] | None = None) -> None:
        """Wake all of it, or only `tags` ("weights", then "kv_cache" once the weights
        are synced: the sync never competes with the KV cache for memory)."""
        await self.llm.wake_up(tags=list(tags) if tags is not None else None)

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
                self._keep_cut(rid, queue)
            self._forget(rid)

    def _keep_cut(self, rid: str, queue: RequestOutputCollector) -> None:
        """With rpk's proposer: the tokens an aborted request had, which vLLM's abort
        hands its queue at once (the whole output, one output per request), kept until
        `take_spec_stats` as a draft of its prompt's later rounds."""
        if not self.keep_cut or len(self._cut) >= _MAX_CUT:
            return
        try:
            out = queue.get_nowait()
        except Exception:  # noqa: BLE001 - the request failed: no tokens to keep
            return
        if out is not None and out.outputs and out.outputs[0].token_ids:
            self._cut[rid] = tuple(out.outputs[0].token_ids)

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

    def _check_idle(self, what: str) -> None:
        if running := self.llm.get_num_unfinished_requests():
            raise RuntimeError(f"{what} with {running} request(s) running; abort them first")

    async def load_weight_files(self, paths: Sequence[Path], version: int) -> None:
        """Every worker reloads the weights in `paths` (safetensors, HF names, one file a
        bucket: `rpk.sync.spool`) in place, in one pass, reading the files lazily.

        Refused while requests run: they would continue under other weights than they
        started with, and the prefix-cache reset (cached KV was computed with the old
        weights) only succeeds on an idle engine."""
        self._check_idle("update_weights")
        started = time.perf_counter()
        await self.llm.collective_rpc("rpk_reload_weights", args=([str(p) for p in paths],))
        await self.weights_loaded(version, started)

    async def weights_loaded(self, version: int, started: float) -> None:
        """After new weights are in the workers (whichever way they came): stale KV
        dropped, the version recorded."""
        if not await self.llm.reset_prefix_cache():
            raise RuntimeError(
                "weights updated but the prefix cache could not be reset: a request "
                "started during the update"
            )
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - started

    async def load_adapter(self, adapter: AdapterVersion, version: int) -> None:
        """Install `adapter` (a PEFT directory, `rpk.sync.adapter`) as version
        `version` and retire the one before it: requests added from now on carry it.
        Refused while requests run, as `load_weight_files` is."""
        self._check_idle("load_adapter")
        started = time.perf_counter()
        llm = self.llm
        # Each worker sees the files first: a verified run records what it will load.
        await llm.collective_rpc("rpk_adapter_files", args=(adapter.path,))
        if not await llm.add_lora(_lora_request(adapter)):
            raise RuntimeError(
                f"replica {self.name}: vLLM did not add LoRA adapter {adapter.name} from {adapter.path}"
            )
        old, self.adapter = self.adapter, adapter
        if old is not None and old.lora_id != adapter.lora_id:
            await llm.remove_lora(old.lora_id)
        self.weight_version = version
        self.last_sync_s = time.perf_counter() - started

    def _lora_request(self) -> LoRARequest | None:
        return _lora_request(self.adapter) if self.adapter is not None else None

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


def _lora_request(adapter: AdapterVersion) -> LoRARequest:
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, adapter.path)


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
        ignore_eos=request.ignore_eos,
        logprobs=0,  # just the sampled token's log-prob
        # Without `progress`, one output per request when it ends: each consumer then
        # wakes exactly when its request ends, in the engine's order (with per-token
        # deltas a lagging consumer could see a later finish before an earlier one, and
        # which responses a round keeps would depend on load). Rounds that keep cut-off
        # tokens or cap lengths need the deltas, and reproduce less exactly.
        output_kind=RequestOutputKind.DELTA if request.progress else RequestOutputKind.FINAL_ONLY,
    )


def _async_llm(model_dir: Path, settings: VLLMSettings, counters: ReplicaCounters) -> AsyncLLM:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(dataclasses.replace(settings, model=str(model_dir)), torch.cuda.is_available())
    return AsyncLLM.from_engine_args(
        AsyncEngineArgs(**kwargs),  # type: ignore[arg-type]
        stat_loggers=[stat_logger_factory(counters)],
    )


async def start_in_thread(start: Callable[[], AsyncLLM]) -> AsyncLLM:
    """`start()` (an `AsyncLLM` made under `_engine_env`) in a worker thread: vLLM's
    client binds its sockets to the event loop on first use, not when it is made. A
    caller cancelled meanwhile does not leave the engine running: its start is waited
    for and the engine shut down."""
    starting = asyncio.ensure_future(asyncio.to_thread(start))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            (await starting).shutdown()
        raise


@contextlib.contextmanager
def _engine_env(placement: Mapping[str, str | None]) -> Iterator[None]:
    """The engine's environment while it starts: rpk's defaults, its owner, and where it
    runs (`placement`; None unsets). All of it is put back afterwards."""
    if "CUDA_VISIBLE_DEVICES" in placement and torch.cuda.is_available():
        # rpk's own process keeps the devices it sees: CUDA reads the variable once,
        # when it initialises, which must happen before it changes here.
        torch.cuda.init()
    saved = {key: os.environ.get(key) for key in (*_SPAWN_ONLY_ENV, *placement)}
    for key, value in _ENGINE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ[OWNER_ENV] = str(os.getpid())  # rpk.engine.plugin: die with this process
    for key, value in placement.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
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
    spec = getattr(completion, "spec_decode_metrics", None)
    return GenDelta(
        request_id=request_id,
        token_ids=token_ids,
        logprobs=logprobs,
        text=completion.text,
        finished=out.finished,
        finish_reason=FinishReason(reason) if reason is not None else None,
        accepted=sum(j * c for j, c in enumerate(spec.histogram)) if spec is not None else 0,
    )
