"""A two-turn trajectory on the real vLLM engine: the second turn's prompt is exactly the
prompt, the first turn's sampled ids and the observation's template-encoded ids; the
sampled log-probs are finite and the loss mask covers the model's tokens only."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvStep
from rpk.agent.template import ObservationEncoder
from rpk.core.records import FinishReason, GenDelta, GenRequest, Prompt
from rpk.loop.rollout import Received

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

TURN_TOKENS = 6
OBSERVATION = [{"role": "tool", "name": "probe", "content": "42"}]


class CappedTurns:
    """The real engine, each turn cut at TURN_TOKENS and reported as the model's own
    stop: a random model seldom samples its end-of-turn token, and the trajectory needs
    its first turn to end for the environment to answer."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: list[GenRequest] = []

    @property
    def max_concurrency(self) -> int:
        return self.engine.max_concurrency

    async def start(self, requests):
        capped = [dataclasses.replace(r, max_tokens=min(r.max_tokens, TURN_TOKENS)) for r in requests]
        self.seen += capped
        streams = await self.engine.start(capped)
        return {rid: self._stop(s) for rid, s in streams.items()}

    async def _stop(self, stream):
        async for d in stream:
            if d.finished and d.finish_reason is FinishReason.LENGTH:
                d = dataclasses.replace(d, finish_reason=FinishReason.STOP)
            yield d

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


class OneObservation:
    """Answers the first turn with OBSERVATION, ends the trajectory on the second."""

    def __init__(self) -> None:
        self.steps = 0
        self.closed = False

    async def reset(self, prompt: Prompt) -> None:
        return None

    async def step(self, turn_text: str) -> EnvStep:
        self.steps += 1
        return EnvStep(tuple(OBSERVATION)) if self.steps == 1 else EnvStep(done=True, reward=1.0)

    async def close(self) -> None:
        self.closed = True


async def test_two_turn_trajectory_is_token_in_token_out(vllm_engine, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoder = ObservationEncoder(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = Prompt("q", tuple(tokenizer(text, add_special_tokens=False)["input_ids"]), "t", "5")
    inner = CappedTurns(vllm_engine)
    envs: list[OneObservation] = []

    def make() -> OneObservation:
        envs.append(OneObservation())
        return envs[-1]

    engine = AgentEngine(inner, make, encoder, {"q": prompt}, max_turns=4)
    rid = "agent-1"
    streams = await engine.start([GenRequest(rid, prompt.token_ids, 64, seed=5, prompt_uid="q")])
    deltas: list[GenDelta] = [d async for d in streams[rid]]
    got = Received()
    for d in deltas:
        got.add(d)

    first, second = inner.seen
    assert (first.request_id, second.request_id) == (f"{rid}-t1", f"{rid}-t2")
    turn1 = [t for d in deltas[: next(i for i, d in enumerate(deltas) if d.observation)]
             for t in d.token_ids]
    (obs,) = [d for d in deltas if d.observation]
    closed = turn1[-1] == tokenizer.eos_token_id
    assert obs.token_ids == encoder.encode(OBSERVATION, closed=closed).token_ids
    assert second.prompt_token_ids == prompt.token_ids + tuple(turn1) + obs.token_ids
    assert second.affinity == rid and second.max_tokens == min(TURN_TOKENS, 64 - len(turn1) - len(obs.token_ids))
    assert len(turn1) == TURN_TOKENS or closed
    turn2 = got.token_ids[len(turn1) + len(obs.token_ids):]
    assert 0 < len(turn2) <= TURN_TOKENS
    assert got.loss_mask() == (1,) * len(turn1) + (0,) * len(obs.token_ids) + (1,) * len(turn2)
    model_lps = [lp for lp, m in zip(got.logprobs, got.loss_mask()) if m]
    assert all(math.isfinite(lp) and lp <= 0 for lp in model_lps)
    assert got.reason is FinishReason.STOP and got.turns is not None and got.turns.turns == 2
    assert got.turns.env_reward == 1.0
    assert envs[0].closed and not engine._live
