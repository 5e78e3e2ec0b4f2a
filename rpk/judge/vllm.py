"""The judge's engine: a vLLM replica started, supervised and stopped by rpk like the
rollout replicas (`rpk.engine.vllm_engine.VLLMEngine`: its processes die with rpk's),
asked one request per response (per vote), so that vLLM's continuous batching batches
the responses that finish together. Requests go in as token ids (`rpk.judge.prompt`:
the data fields tokenised as text), tokenised in a thread, off the event loop.

What it reads is the verdict kind's (`rpk.reward.verdict.KINDS`):
- the yes/no log-probs at the first output token: `SamplingParams(max_tokens=1,
  logprob_token_ids=[yes, no])` returns exactly those two tokens' log-probs (vLLM 0.32,
  `vllm/sampling_params.py`), whatever token is sampled;
- after a thought: the judge writes up to `reason_tokens` tokens, stopped by the verdict
  marker; then one more one-token request over the prompt, the thought's token ids and
  the marker reads the yes/no log-probs right after the marker (built on the ids vLLM
  returned, never on re-tokenised text; the prompt and thought are prefix-cached);
- the text of a graded judge, and whether it ended it itself;
- a reward model's score, on vLLM's pooling runner.

On CUDA the judge lives on the rollout GPUs (`JudgeDevice`: its share of each GPU, and
the layers it streams from pinned host memory with vLLM's prefetch offload) and rests
with the fleet (`rpk.judge.rest`). The judge's engines over the rollout GPUs of every
engine node, and the pool the scorer asks them through, are `rpk.judge.pool`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rpk import hub
from rpk.core.modes import Runner
from rpk.core.records import FinishReason
from rpk.engine.vllm_engine import VLLMEngine
from rpk.engine.vllm_settings import PrefetchOffload, VLLMSettings, engine_kwargs
from rpk.judge.prompt import ChatTokens
from rpk.judge.rest import EngineRest, RestsThroughEngine
from rpk.reward.functions import RewardError
from rpk.reward.judge import JudgeDied, JudgeRequest, JudgeSettings, request_from, template_kwargs
from rpk.reward.verdict import Reading, Reads, Sampling

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams


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
                        device: JudgeDevice | None, runner: Runner = Runner.GENERATE) -> VLLMSettings:
    """The judge engine's settings: on CPU (`device` None) the rollout engine's defaults;
    on CUDA the plan's share of memory, its streamed layers and sleep mode (the judge
    rests with the fleet). Eager: a logprob verdict is a prefill, which CUDA graphs
    (captured for decode) would not speed up, and their memory is not in the judge's
    share. Every verdict asks `votes` requests at once."""
    base = VLLMSettings(model=path, max_model_len=settings.max_model_len,
                        max_num_seqs=settings.max_requests, seed=seed, runner=runner)
    if device is None:
        return base
    return dataclasses.replace(
        base, dtype="bfloat16", kv_cache_memory_bytes=None,
        max_num_seqs=device.max_num_seqs or settings.max_requests,
        max_model_len=device.max_model_len or settings.max_model_len,
        gpu_memory_utilization=device.gpu_memory_utilization, enable_sleep_mode=True,
        prefetch_offload=prefetch_groups(device.layers, device.offloaded, device.prefetch_step),
        max_num_batched_tokens=device.max_num_batched_tokens,
    )


def judge_engine_args(settings: JudgeSettings, path: Path, seed: int, device: JudgeDevice | None,
                      cuda: bool) -> dict[str, object]:
    """The exact `vllm.AsyncEngineArgs` keywords of the judge's engine (what a dry run
    prints): its verdict kind's runner (a reward model's pooling runner for `classify`)."""
    return engine_kwargs(judge_vllm_settings(settings, path, seed, device, engine_class(settings).runner), cuda)


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


def yes_no_ids(tokenizer: Any, settings: JudgeSettings) -> list[int]:
    """The yes and no words' token ids, where the verdict kind reads them (else none)."""
    if not settings.kind.words:
        return []
    ids = [word_token(tokenizer, settings.yes, "reward.judge.yes"),
           word_token(tokenizer, settings.no, "reward.judge.no")]
    if ids[0] == ids[1]:
        raise RewardError(f"reward.judge.yes={settings.yes!r} and reward.judge.no={settings.no!r} "
                          "are the same token")
    return ids


def chat_tokens(tokenizer: Any, settings: JudgeSettings) -> ChatTokens:
    """The judge's prompt tokens, checked on an example: a chat template that cannot keep
    the data apart (or refuses a `chat_template_kwargs` keyword) stops the run at its start."""
    tokens = ChatTokens(tokenizer, template_kwargs(settings.chat_template_kwargs))
    tokens.check(request_from(settings, "question", "reference", "response"))
    return tokens


def model_dir(model: str, hub_cache: str | None = None) -> Path:
    """A local directory, or a Hub id fetched into the cache (then found offline)."""
    if hub.is_hub_id(model) and not Path(model).exists():
        return hub.fetch(model, hub_cache)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise RewardError(f"reward.judge.model={model!r} is not a model directory (no config.json)")
    return path


class VLLMJudgeEngine(RestsThroughEngine):
    """A judge model on a `VLLMEngine`: what `VLLMJudge` and `VLLMRewardModel` share (the
    start, the dead-engine check, the wake, the prompt's tokens). `owned`: `aclose`
    shuts the engine down (False when it is shared, as the integration tests share one)."""

    runner: ClassVar[Runner]
    role: ClassVar[str]  # what it is called in what it says

    def __init__(self, engine: VLLMEngine, tokenizer: Any, settings: JudgeSettings, *,
                 owned: bool = True) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.owned = owned
        self.name = f"{self.role} {settings.model}"
        self.rest = EngineRest(engine.llm, engine.settings.enable_sleep_mode, self.name)
        self.tokens = chat_tokens(tokenizer, settings)
        self._tokenising: dict[JudgeRequest, asyncio.Future[list[int]]] = {}

    @classmethod
    def preflight(cls, tokenizer: Any, settings: JudgeSettings) -> None:
        """What the tokenizer must allow, checked before the engine starts (so a bad
        setting costs no engine start)."""
        chat_tokens(tokenizer, settings)

    @classmethod
    async def launch(cls, settings: JudgeSettings, *, hub_cache: str | None = None,
                     seed: int = 0, device: JudgeDevice | None = None,
                     env: Mapping[str, str | None] | None = None, in_thread: bool = False) -> VLLMJudgeEngine:
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
        cls.preflight(tokenizer, settings)
        engine = await VLLMEngine.launch(judge_vllm_settings(settings, path, seed, device, cls.runner),
                                         env=env, name="judge", in_thread=in_thread)
        try:
            return cls(engine, tokenizer, settings)
        except BaseException:
            await engine.shutdown()
            raise

    def _alive(self) -> None:
        llm = self.engine.llm
        if llm.errored:
            raise JudgeDied(f"{self.name} died: {llm.dead_error}")

    async def ready(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        self._alive()
        try:
            await self.rest.wake()
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died while waking: {e}") from None

    async def sleep(self) -> None:
        """As `RestsThroughEngine.sleep`; a dead engine says `JudgeDied` (the pool
        restarts it)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        self._alive()
        try:
            await self.rest.sleep()
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died while going to sleep: {e}") from None

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        from vllm.v1.engine.exceptions import EngineDeadError

        self._alive()
        ids = await self._ids(request)
        try:
            return await self._answer(ids, request_id)
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died: {e}") from None

    async def _ids(self, request: JudgeRequest) -> list[int]:
        """`request`'s token ids, tokenised in a thread once for all of its votes in
        flight. Tokenised apart, the votes reached vLLM in the order their threads ended;
        waiting on one tokenisation they resume, and are sent, in the order they asked.
        Shielded: a vote that times out leaves the others their ids."""
        pending = self._tokenising.get(request)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self.tokens.ids, request))
            self._tokenising[request] = pending
            pending.add_done_callback(lambda done: self._tokenised(request, done))
        return list(await asyncio.shield(pending))

    def _tokenised(self, request: JudgeRequest, done: asyncio.Future[list[int]]) -> None:
        self._tokenising.pop(request, None)
        if not done.cancelled():
            done.exception()  # read: the votes that still wait get it through their shields

    async def _answer(self, ids: list[int], request_id: str) -> Reading:
        raise NotImplementedError

    async def aclose(self) -> None:
        if self.owned:
            await self.engine.shutdown()


class VLLMJudge(VLLMJudgeEngine):
    """`rpk.reward.judge.JudgeEngine` over a chat model: the logprob, reason and score
    verdicts."""

    runner = Runner.GENERATE
    role = "the judge"

    def __init__(self, engine: VLLMEngine, tokenizer: Any, settings: JudgeSettings, *,
                 owned: bool = True) -> None:
        super().__init__(engine, tokenizer, settings, owned=owned)
        self._words = yes_no_ids(tokenizer, settings)
        # Appended, on a line of its own, after a thought that did not write it.
        self._marker = self.tokens.text_ids("\n" + settings.verdict_marker)
        self._reads: dict[Reads, Callable[[list[int], str], Awaitable[Reading]]] = {
            Reads.FIRST_TOKEN: self._first_token,
            Reads.AFTER_MARKER: self._after_marker,
            Reads.TEXT: self._text,
        }

    @classmethod
    def preflight(cls, tokenizer: Any, settings: JudgeSettings) -> None:
        super().preflight(tokenizer, settings)
        yes_no_ids(tokenizer, settings)

    def sampling_params(self, sampling: Sampling, words: bool) -> SamplingParams:
        """vLLM's params for `sampling`; `words`: the yes/no log-probs of its one token
        (at temperature 1, seeded: the log-probs returned are the model's own)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        return SamplingParams(
            n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            seed=0 if words else None, stop=list(sampling.stop) or None,
            logprob_token_ids=list(self._words) if words else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _answer(self, ids: list[int], request_id: str) -> Reading:
        return await self._reads[self.settings.kind.reads](ids, request_id)

    async def _generate(self, ids: list[int], params: SamplingParams, request_id: str) -> CompletionOutput:
        from vllm.inputs import TokensPrompt

        last = None
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=ids), params, request_id):
            last = out
        if last is None or not last.outputs:
            raise RuntimeError(f"vLLM ended judge request {request_id!r} without an output")
        return last.outputs[0]

    async def _words_at(self, ids: list[int], request_id: str) -> tuple[float | None, float | None]:
        """The yes and no words' log-probs of the token after `ids`."""
        out = await self._generate(ids, self.sampling_params(Sampling(1, 1.0), words=True), request_id)
        first = (out.logprobs or [{}])[0]
        yes, no = (first.get(t) for t in self._words)
        return (yes.logprob if yes is not None else None, no.logprob if no is not None else None)

    async def _first_token(self, ids: list[int], request_id: str) -> Reading:
        yes, no = await self._words_at(ids, request_id)
        return Reading(yes_logprob=yes, no_logprob=no)

    async def _after_marker(self, ids: list[int], request_id: str) -> Reading:
        sampling = self.settings.kind.sampling(self.settings)
        assert sampling is not None
        thought = await self._generate(ids, self.sampling_params(sampling, words=False), request_id)
        said = list(thought.token_ids)
        ended = FinishReason(thought.finish_reason) is FinishReason.STOP
        wrote = ended and thought.stop_reason == self.settings.verdict_marker
        if not wrote:
            if ended and said:
                said.pop()  # its end-of-text token: the thought goes on to the marker
            said += self._marker
        # The judge's own marker tokens when it wrote it (vLLM keeps the ids up to the
        # one that completed the stop string): what it continues from.
        yes, no = await self._words_at(ids + said, f"{request_id}/verdict")
        return Reading(text=thought.text, yes_logprob=yes, no_logprob=no, marker_cut=not wrote)

    async def _text(self, ids: list[int], request_id: str) -> Reading:
        sampling = self.settings.kind.sampling(self.settings)
        assert sampling is not None
        out = await self._generate(ids, self.sampling_params(sampling, words=False), request_id)
        return Reading(text=out.text, finished=FinishReason(out.finish_reason) is FinishReason.STOP)


class VLLMRewardModel(VLLMJudgeEngine):
    """`rpk.reward.judge.JudgeEngine` over a discriminative reward model (a
    `*ForSequenceClassification` checkpoint) served by vLLM's pooling runner (`classify`),
    fed the conversation through its own chat template: the reading's score is the
    model's raw logit when it has one label, else the softmax probability of its last
    label ("good")."""

    runner = Runner.POOLING
    role = "the reward model"

    async def _answer(self, ids: list[int], request_id: str) -> Reading:
        import torch
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

        last = None
        async for out in self.engine.llm.encode(TokensPrompt(prompt_token_ids=ids),
                                                PoolingParams(task="classify", use_activation=False),
                                                request_id):
            last = out
        if last is None:
            raise RuntimeError(f"vLLM ended reward-model request {request_id!r} without an output")
        logits = torch.as_tensor(last.outputs.data, dtype=torch.float32).flatten()
        if logits.numel() == 1:
            return Reading(score=float(logits[0]))
        return Reading(score=float(torch.softmax(logits, 0)[-1]))


# Each engine class under the runner it declares: a verdict kind's runner picks it.
ENGINES: Mapping[Runner, type[VLLMJudgeEngine]] = {e.runner: e for e in (VLLMJudge, VLLMRewardModel)}


def engine_class(settings: JudgeSettings) -> type[VLLMJudgeEngine]:
    """The engine `settings`' verdict kind needs."""
    return ENGINES[settings.kind.runner]
