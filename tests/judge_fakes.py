"""Stand-ins for the judge's engine side: a real HF chat tokenizer built here (the tiny
judge's recipe: ChatML with `<|im_start|>` and `<|im_end|>` as special tokens, nothing
downloaded), and a scripted AsyncLLM whose every call is bound to vLLM's signature and
whose answers a test writes as a function of the prompt's token ids."""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from rpk.engine.vllm_settings import VLLMSettings
from tests.fakes import SignedLLM


@functools.cache
def _judge_tokenizer() -> Any:
    from rpk.config import JudgeTinySpec
    from rpk.judge.tiny import corpus
    from rpk.tasks.tiny import build_tokenizer

    spec = JudgeTinySpec()
    return build_tokenizer(spec, corpus(spec))


def judge_tokenizer() -> Any:
    """The tiny judge's tokenizer (a copy: a test may change its chat template)."""
    return copy.deepcopy(_judge_tokenizer())


def completion(token_ids: list[int] = (), text: str = "", finish: str = "stop", stop_reason: Any = None,
               logprobs: dict[int, float] | None = None) -> SimpleNamespace:
    """One of vLLM's CompletionOutputs: `logprobs` the first position's, by token id."""
    first = None if logprobs is None else [{t: SimpleNamespace(logprob=v) for t, v in logprobs.items()}]
    return SimpleNamespace(token_ids=list(token_ids), text=text, finish_reason=finish,
                           stop_reason=stop_reason, logprobs=first)


Answer = Callable[[list[int], Any], SimpleNamespace]


class ScriptLLM(SignedLLM):
    """An AsyncLLM whose `generate` answers `answer(prompt_ids, params)` (a completion) and
    `encode` gives `score`; it sleeps and wakes (a wake takes `wake_s`), refuses a
    verdict while asleep, and keeps every prompt it was sent."""

    def __init__(self, log: list, answer: Answer | None = None, score: float = 0.0,
                 wake_s: float = 0.0, busy: int = 0) -> None:
        super().__init__(log)
        self.answer = answer or (lambda ids, params: completion())
        self.score = score
        self.wake_s = wake_s
        self.busy = busy
        self.awake = True
        self.dead_error = None
        self.prompts: list[list[int]] = []
        self.params: list[Any] = []

    async def sleep(self, *a: Any, **k: Any) -> None:
        await super().sleep(*a, **k)
        self.awake = False

    async def wake_up(self, *a: Any, **k: Any) -> bool:
        self._call("wake_up", *a, **k)
        await asyncio.sleep(self.wake_s)
        self.awake = True
        return True

    def get_num_unfinished_requests(self) -> int:
        return self.busy

    async def generate(self, prompt: Any, params: Any, request_id: str, *a: Any, **k: Any):
        self._call("generate", prompt, params, request_id, *a, **k)
        assert self.awake, "a verdict asked of a sleeping judge"
        self.prompts.append(list(prompt["prompt_token_ids"]))
        self.params.append(params)
        yield SimpleNamespace(outputs=[self.answer(self.prompts[-1], params)])

    async def encode(self, prompt: Any, pooling_params: Any, request_id: str, *a: Any, **k: Any):
        self._call("encode", prompt, pooling_params, request_id, *a, **k)
        assert self.awake, "a score asked of a sleeping reward model"
        self.prompts.append(list(prompt["prompt_token_ids"]))
        yield SimpleNamespace(outputs=SimpleNamespace(data=[self.score]))


class ScriptEngine:
    """What `VLLMJudgeEngine` uses of a `VLLMEngine`: its AsyncLLM and settings."""

    def __init__(self, llm: ScriptLLM, sleeps: bool = True) -> None:
        self.llm = llm
        self.settings = VLLMSettings(model="judge", enable_sleep_mode=sleeps)
        self.shut = False

    async def shutdown(self) -> None:
        self.shut = True
