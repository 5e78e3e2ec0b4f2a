"""The judge's engine: a vLLM replica started, supervised and stopped by rpk like the
rollout replicas (`rpk.engine.vllm_engine.VLLMEngine`: its processes die with rpk's),
asked one request per response, so that vLLM's continuous batching batches the
responses that finish together.

A logprob verdict is one decode step: `SamplingParams(max_tokens=1,
logprob_token_ids=[yes, no])` returns exactly those two tokens' log-probs (vLLM 0.32,
`vllm/sampling_params.py`), whatever token is sampled. A graded verdict decodes up to
`reward.judge.max_tokens` tokens greedily.

On CUDA the judge lives on the rollout GPUs (`JudgeDevice`: its share of each GPU, and
the layers it streams from pinned host memory with vLLM's prefetch offload). While the
trainer trains, the rollout replicas sleep (`rpk.engine.fleet.Fleet.rest`) so that the
trainer has their GPUs; the judge sleeps with them, at the same level (`FleetAndJudge`),
and wakes the next time it is asked for a verdict (`EngineRest`), after the fleet's KV
cache is back: its share was planned beside it. vLLM's CPU worker has no sleep mode: a
judge started without it keeps its memory, and resting says so once.

The judge's engines over the rollout GPUs of every engine node, and the pool the scorer
asks them through, are `rpk.judge.pool`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Protocol, Sequence

from rpk import hub
from rpk.core.protocols import Resting
from rpk.engine.vllm_engine import (
    EngineStartError,
    PrefetchOffload,
    VLLMEngine,
    VLLMSettings,
    _engine_env,
    engine_kwargs,
    start_in_thread,
)
from rpk.reward.functions import RewardError
from rpk.reward.judge import JudgeDied, JudgeEngine, JudgeScorer, JudgeSettings, Reading


@dataclass(frozen=True, slots=True)
class JudgeDevice:
    """The judge's vLLM beside the rollout on CUDA, as the memory plan sizes it: its
    share of each GPU's memory (vLLM's `gpu_memory_utilization`, a fraction of the
    total per engine), its decoder's `layers`, how many of them stream from pinned host
    memory, how many layers ahead each is copied, the requests and input length its
    KV cache was sized for (None: `reward.judge`'s cap and length, as on CPU), and the
    tokens a scheduler step holds, which the plan prices (None: vLLM's default)."""

    gpu_memory_utilization: float
    layers: int
    offloaded: int = 0
    prefetch_step: int = 1
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"the judge's gpu_memory_utilization must be in (0, 1), "
                             f"got {self.gpu_memory_utilization}")
        if not (0 <= self.offloaded <= self.layers and self.prefetch_step >= 1):
            raise ValueError(f"the judge streams 0..{self.layers} layers, >= 1 ahead: got "
                             f"offloaded={self.offloaded}, prefetch_step={self.prefetch_step}")
        if (self.max_num_seqs is not None and self.max_num_seqs < 1) or (
                self.max_model_len is not None and self.max_model_len < 1):
            raise ValueError(f"the judge's max_num_seqs={self.max_num_seqs} and "
                             f"max_model_len={self.max_model_len} must be >= 1")


def offloaded_by(group_size: int, num_in_group: int, layers: int) -> int:
    """How many of `layers` vLLM's prefetch offload streams: layer i when
    i % group_size >= group_size - num_in_group (`vllm/model_executor/offloader/prefetch.py`)."""
    full, rest = divmod(layers, group_size)
    return full * num_in_group + max(0, rest - (group_size - num_in_group))


def prefetch_groups(layers: int, offloaded: int, prefetch_step: int = 1) -> PrefetchOffload | None:
    """vLLM's groups that stream the fewest layers >= `offloaded`; among equals the
    smallest groups: streamed layers then sit between resident ones, whose compute hides
    their copies. None: nothing to stream."""
    if offloaded == 0:
        return None
    if not 0 < offloaded <= layers:
        raise ValueError(f"cannot stream {offloaded} of {layers} layers")
    count, group, num = min(
        (offloaded_by(g, k, layers), g, k)
        for g in range(1, layers + 1) for k in range(1, g + 1)
        if offloaded_by(g, k, layers) >= offloaded
    )
    return PrefetchOffload(group, num, prefetch_step)


def judge_vllm_settings(settings: JudgeSettings, path: Path, seed: int,
                        device: JudgeDevice | None) -> VLLMSettings:
    """The judge engine's settings: on CPU (`device` None) the rollout engine's defaults;
    on CUDA the plan's share of memory, its streamed layers and sleep mode (the judge
    rests with the fleet). Eager: a verdict is a prefill, which CUDA graphs (captured for
    decode) would not speed up, and their memory is not in the judge's share."""
    base = VLLMSettings(model=path, max_model_len=settings.max_model_len,
                        max_num_seqs=settings.max_concurrency, seed=seed)
    if device is None:
        return base
    return dataclasses.replace(
        base, dtype="bfloat16", kv_cache_memory_bytes=None,
        max_num_seqs=device.max_num_seqs or settings.max_concurrency,
        max_model_len=device.max_model_len or settings.max_model_len,
        gpu_memory_utilization=device.gpu_memory_utilization, enable_sleep_mode=True,
        prefetch_offload=prefetch_groups(device.layers, device.offloaded, device.prefetch_step),
        max_num_batched_tokens=device.max_num_batched_tokens,
    )


def judge_engine_args(settings: JudgeSettings, path: Path, seed: int, device: JudgeDevice | None,
                      cuda: bool) -> dict[str, object]:
    """The exact `vllm.AsyncEngineArgs` keywords of the judge's engine (what a dry run
    prints): a reward model's pooling runner for `classify` verdicts, else vLLM's
    generative engine's."""
    vllm_settings = judge_vllm_settings(settings, path, seed, device)
    if settings.verdict == "classify":
        return pooling_kwargs(vllm_settings, cuda)
    return engine_kwargs(vllm_settings, cuda)


class EngineRest:
    """A judge engine's side of resting (`llm`: its AsyncLLM): vLLM's sleep at the
    fleet's level, and the wake the next time the judge is asked. Level 2 drops the
    weights; nothing syncs a judge's, so its wake reloads them from its directory."""

    def __init__(self, llm: Any, can_sleep: bool, name: str) -> None:
        self.llm = llm
        self.can_sleep = can_sleep
        self.name = name
        self.level: int | None = None  # asleep at this level; None: awake
        self._waking: asyncio.Task[None] | None = None

    async def sleep(self, level: int) -> None:
        if not self.can_sleep:
            raise RuntimeError(f"{self.name} was started without vLLM's sleep mode")
        if self.level is not None and self._waking is None:
            # Still asleep: a judge on a GPU that got no verdict since the fleet's last
            # rest (`JudgePool`) has its memory off the GPU already.
            return
        self.check_alive()
        busy = self.llm.get_num_unfinished_requests()
        if busy or self._waking is not None:
            raise RuntimeError(f"{self.name} cannot sleep with {busy} requests in flight "
                               f"(waking: {self._waking is not None})")
        async with self.dies_as_judge():
            await self.llm.sleep(level=level)
        self.level = level

    def check_alive(self) -> None:
        """JudgeDied when vLLM says its engine is dead (the pool restarts it)."""
        if self.llm.errored:
            raise JudgeDied(f"{self.name} died: {self.llm.dead_error}")

    @contextlib.asynccontextmanager
    async def dies_as_judge(self) -> AsyncIterator[None]:
        """vLLM's dead-engine error as `JudgeDied`, whatever call met it."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            yield
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died: {e}") from None

    async def wake(self) -> None:
        """Every request asked while it sleeps waits for one wake, which a request that
        times out meanwhile does not cancel (the others still need it)."""
        if self.level is None:
            return
        if self._waking is None:
            self._waking = asyncio.ensure_future(self._wake(self.level))
        await asyncio.shield(self._waking)

    async def _wake(self, level: int) -> None:
        try:
            async with self.dies_as_judge():
                await self.llm.wake_up(tags=None)
                if level >= 2:
                    await self.llm.collective_rpc("reload_weights")
            self.level = None
        finally:
            self._waking = None


class RestsThroughEngine:
    """The resting face of an engine that rests through its `EngineRest` (`self.rest`)."""

    rest: EngineRest

    @property
    def can_sleep(self) -> bool:
        return self.rest.can_sleep

    async def sleep(self, level: int) -> None:
        await self.rest.sleep(level)


def word_token(tokenizer: Any, word: str, setting: str) -> int:
    """The one token `word` is; RewardError naming the setting when it is several."""
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise RewardError(
            f"{setting}={word!r} is {len(ids)} tokens {pieces} for the judge's tokenizer; "
            "a logprob verdict reads one token: pick a word that is one token"
        )
    return int(ids[0])


def model_dir(model: str, hub_cache: str | None = None) -> Path:
    """A local directory, or a Hub id fetched into the cache (then found offline)."""
    if hub.is_hub_id(model) and not Path(model).exists():
        return hub.fetch(model, hub_cache)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise RewardError(f"reward.judge.model={model!r} is not a model directory (no config.json)")
    return path


class VLLMJudge(RestsThroughEngine):
    """`rpk.reward.judge.JudgeEngine` over a `VLLMEngine`. `owned`: `aclose` shuts the
    engine down (False when it is shared, as the integration tests share one)."""

    def __init__(self, engine: VLLMEngine, tokenizer: Any, settings: JudgeSettings, *,
                 owned: bool = True) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.owned = owned
        self.name = f"the judge {settings.model}"
        self.rest = EngineRest(engine.llm, engine.settings.enable_sleep_mode, self.name)
        self._words: list[int] = []
        if settings.verdict == "logprob":
            self._words = [word_token(tokenizer, settings.yes, "reward.judge.yes"),
                           word_token(tokenizer, settings.no, "reward.judge.no")]
            if self._words[0] == self._words[1]:
                raise RewardError(
                    f"reward.judge.yes={settings.yes!r} and reward.judge.no={settings.no!r} "
                    "are the same token"
                )

    @classmethod
    async def launch(cls, settings: JudgeSettings, *, hub_cache: str | None = None,
                     seed: int = 0, device: JudgeDevice | None = None,
                     env: Mapping[str, str | None] | None = None, in_thread: bool = False) -> VLLMJudge:
        """Start the judge's vLLM (`device`: its share of a rollout GPU, None on CPU; `env`:
        what pins it there, `rpk.engine.placement.device_env`). Blocks the event loop
        while the model loads, like the rollout's start: start it before the rollout
        engine, not beside it; `in_thread` (a restart while the run goes on) loads it
        in a thread instead."""
        from transformers import AutoTokenizer

        if settings.model is None:
            raise RewardError("reward.judge.model is unset: the judged rows need a judge")
        path = await asyncio.to_thread(model_dir, settings.model, hub_cache)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
        engine = await VLLMEngine.launch(judge_vllm_settings(settings, path, seed, device), env=env,
                                         name="judge", in_thread=in_thread)
        try:
            return cls(engine, tokenizer, settings)
        except BaseException:
            await engine.shutdown()
            raise

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sampling_params(self) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        final = RequestOutputKind.FINAL_ONLY
        if self.settings.verdict == "logprob":
            # Temperature 1 and no top-p: the log-probs returned are the model's own.
            return SamplingParams(n=1, max_tokens=1, temperature=1.0, seed=0,
                                  logprob_token_ids=list(self._words), output_kind=final)
        return SamplingParams(n=1, max_tokens=self.settings.max_tokens, temperature=0.0,
                              output_kind=final)

    async def judge(self, messages: Sequence[Mapping[str, str]], request_id: str) -> Reading:
        from vllm.inputs import TokensPrompt

        llm = self.engine.llm
        self.rest.check_alive()
        await self.rest.wake()
        prompt = TokensPrompt(prompt_token_ids=self.prompt_ids(messages))
        last = None
        async with self.rest.dies_as_judge():
            async for out in llm.generate(prompt, self.sampling_params(), request_id):
                last = out
        if last is None or not last.outputs:
            raise RuntimeError(f"vLLM ended judge request {request_id!r} without an output")
        completion = last.outputs[0]
        if self.settings.verdict != "logprob":
            return Reading(text=completion.text)
        first = (completion.logprobs or [{}])[0]
        yes, no = (first.get(t) for t in self._words)
        return Reading(
            text=completion.text,
            yes_logprob=yes.logprob if yes is not None else None,
            no_logprob=no.logprob if no is not None else None,
        )

    async def aclose(self) -> None:
        if self.owned:
            await self.engine.shutdown()


def pooling_kwargs(settings: VLLMSettings, cuda: bool) -> dict[str, object]:
    """`vllm.AsyncEngineArgs` keywords of a discriminative reward model: the pooling
    runner, and no sampling settings (nothing is sampled)."""
    kwargs = engine_kwargs(settings, cuda)
    kwargs.update(runner="pooling")
    kwargs.pop("logprobs_mode")
    return kwargs


class VLLMRewardModel(RestsThroughEngine):
    """`rpk.reward.judge.JudgeEngine` over a discriminative reward model (a
    `*ForSequenceClassification` checkpoint) served by vLLM's pooling runner (`classify`):
    the reading's score is the model's raw logit when it has one label, else the
    softmax probability of its last label ("good")."""

    def __init__(self, llm: Any, tokenizer: Any, settings: JudgeSettings, can_sleep: bool = False) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.settings = settings
        self.name = f"the reward model {settings.model}"
        self.rest = EngineRest(llm, can_sleep, self.name)

    @classmethod
    async def launch(cls, settings: JudgeSettings, *, hub_cache: str | None = None,
                     seed: int = 0, device: JudgeDevice | None = None,
                     env: Mapping[str, str | None] | None = None, in_thread: bool = False) -> VLLMRewardModel:
        import torch
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if settings.model is None:
            raise RewardError("reward.judge.model is unset: the judged rows need a judge")
        path = await asyncio.to_thread(model_dir, settings.model, hub_cache)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
        kwargs = judge_engine_args(settings, path, seed, device, torch.cuda.is_available())

        def start() -> Any:
            with _engine_env(env or {}):
                return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))  # type: ignore[arg-type]

        try:
            llm = await start_in_thread(start) if in_thread else start()
        except Exception as e:
            raise EngineStartError(f"vLLM failed to start the reward model {path}: "
                                   f"{type(e).__name__}: {e}") from e
        return cls(llm, tokenizer, settings, bool(kwargs["enable_sleep_mode"]))

    async def judge(self, messages: Sequence[Mapping[str, str]], request_id: str) -> Reading:
        import torch
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

        self.rest.check_alive()
        await self.rest.wake()
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        last = None
        async with self.rest.dies_as_judge():
            async for out in self.llm.encode(TokensPrompt(prompt_token_ids=list(ids)),
                                             PoolingParams(task="classify", use_activation=False),
                                             request_id):
                last = out
        if last is None:
            raise RuntimeError(f"vLLM ended reward-model request {request_id!r} without an output")
        logits = torch.as_tensor(last.outputs.data, dtype=torch.float32).flatten()
        if logits.numel() == 1:
            return Reading(score=float(logits[0]))
        return Reading(score=float(torch.softmax(logits, 0)[-1]))

    async def aclose(self) -> None:
        self.llm.shutdown()


class SleepingJudge(JudgeEngine, Protocol):
    """A judge engine that can rest (`VLLMJudge`, `VLLMRewardModel`, `JudgePool`)."""

    @property
    def can_sleep(self) -> bool: ...

    async def sleep(self, level: int) -> None: ...


class FleetAndJudge:
    """`rpk.core.protocols.Resting` over the colocated fleet and the judge beside it."""

    def __init__(self, fleet: Resting, judge: JudgeScorer, log: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.judge = judge
        self.log = log
        self._said = False

    @property
    def rest_level(self) -> int | None:
        return self.fleet.rest_level

    @property
    def resting(self) -> int | None:
        return self.fleet.resting

    async def rest(self, level: int) -> None:
        await self.fleet.rest(level)
        engine: SleepingJudge | None = self.judge.engine  # type: ignore[assignment]
        if engine is None:
            return
        if engine.can_sleep:
            await engine.sleep(level)
        elif not self._said:
            self._said = True
            self.log("judge: its vLLM runs without sleep mode (vLLM has none on CPU): it keeps "
                     "its memory while the trainer trains")

    async def wake_from_rest(self) -> None:
        # The judge wakes when it is next asked, not here: the fleet also wakes through
        # its weight sync, which never passes by this object.
        await self.fleet.wake_from_rest()


def with_judge(fleet: Resting, judge: JudgeScorer | None, log: Callable[[str], None]) -> Resting:
    """What rests while the trainer trains: the fleet, and the judge when there is one."""
    return fleet if judge is None else FleetAndJudge(fleet, judge, log)
