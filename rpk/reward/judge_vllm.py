"""The judge's engine: a vLLM replica started, supervised and stopped by rpk like the
rollout replicas (`rpk.engine.vllm_engine.VLLMEngine`: its processes die with rpk's),
asked one request per response, so that vLLM's continuous batching batches the
responses that finish together.

A logprob verdict is one decode step: `SamplingParams(max_tokens=1,
logprob_token_ids=[yes, no])` returns exactly those two tokens' log-probs (vLLM 0.32,
`vllm/sampling_params.py`), whatever token is sampled. A graded verdict decodes up to
`reward.judge.max_tokens` tokens greedily.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rpk.reward.functions import RewardError
from rpk.reward.judge import JudgeDied, JudgeSettings, Reading

if TYPE_CHECKING:
    from rpk.engine.vllm_engine import VLLMEngine


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
    from rpk import hub

    if hub.is_hub_id(model) and not Path(model).exists():
        return hub.fetch(model, hub_cache)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise RewardError(f"reward.judge.model={model!r} is not a model directory (no config.json)")
    return path


class VLLMJudge:
    """`rpk.reward.judge.JudgeEngine` over a `VLLMEngine`. `owned`: `aclose` shuts the
    engine down (False when it is shared, as the integration tests share one)."""

    def __init__(self, engine: VLLMEngine, tokenizer: Any, settings: JudgeSettings, *,
                 owned: bool = True) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.owned = owned
        self.name = f"the judge {settings.model}"
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
                     seed: int = 0) -> VLLMJudge:
        """Start the judge's vLLM. Blocks the event loop while the model loads, like the
        rollout's start: start it before the rollout engine, not beside it."""
        from transformers import AutoTokenizer

        from rpk.engine.vllm_engine import VLLMEngine, VLLMSettings

        if settings.model is None:
            raise RewardError("reward.judge.model is unset: the judged rows need a judge")
        path = await asyncio.to_thread(model_dir, settings.model, hub_cache)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
        vllm_settings = VLLMSettings(
            model=path, max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_concurrency, seed=seed,
        )
        engine = await VLLMEngine.launch(vllm_settings, name="judge")
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
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self.engine.llm
        if llm.errored:
            raise JudgeDied(f"{self.name} died: {llm.dead_error}")
        prompt = TokensPrompt(prompt_token_ids=self.prompt_ids(messages))
        last = None
        try:
            async for out in llm.generate(prompt, self.sampling_params(), request_id):
                last = out
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died: {e}") from None
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


class VLLMRewardModel:
    """`rpk.reward.judge.JudgeEngine` over a discriminative reward model (a
    `*ForSequenceClassification` checkpoint) served by vLLM's pooling runner (`classify`):
    the reading's score is the model's raw logit when it has one label, else the
    softmax probability of its last label ("good")."""

    def __init__(self, llm: Any, tokenizer: Any, settings: JudgeSettings) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.settings = settings
        self.name = f"the reward model {settings.model}"

    @classmethod
    async def launch(cls, settings: JudgeSettings, *, hub_cache: str | None = None,
                     seed: int = 0) -> VLLMRewardModel:
        import torch
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rpk.engine.vllm_engine import EngineStartError, VLLMSettings, _engine_env, engine_kwargs

        if settings.model is None:
            raise RewardError("reward.judge.model is unset: the judged rows need a judge")
        path = await asyncio.to_thread(model_dir, settings.model, hub_cache)
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(path))
        kwargs = engine_kwargs(
            VLLMSettings(model=str(path), max_model_len=settings.max_model_len,
                         max_num_seqs=settings.max_concurrency, seed=seed),
            torch.cuda.is_available(),
        )
        kwargs.update(runner="pooling")
        kwargs.pop("logprobs_mode")  # a sampling setting: no samples here
        try:
            with _engine_env({}):
                llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))  # type: ignore[arg-type]
        except Exception as e:
            raise EngineStartError(f"vLLM failed to start the reward model {path}: "
                                   f"{type(e).__name__}: {e}") from e
        return cls(llm, tokenizer, settings)

    async def judge(self, messages: Sequence[Mapping[str, str]], request_id: str) -> Reading:
        import torch
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.llm.errored:
            raise JudgeDied(f"{self.name} died: {self.llm.dead_error}")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=False
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        last = None
        try:
            async for out in self.llm.encode(TokensPrompt(prompt_token_ids=list(ids)),
                                             PoolingParams(task="classify", use_activation=False),
                                             request_id):
                last = out
        except EngineDeadError as e:
            raise JudgeDied(f"{self.name} died: {e}") from None
        if last is None:
            raise RuntimeError(f"vLLM ended reward-model request {request_id!r} without an output")
        logits = torch.as_tensor(last.outputs.data, dtype=torch.float32).flatten()
        if logits.numel() == 1:
            return Reading(score=float(logits[0]))
        return Reading(score=float(torch.softmax(logits, 0)[-1]))

    async def aclose(self) -> None:
        self.llm.shutdown()
