"""Scripted pieces for multi-turn tests: an inner engine whose turns say what a script
says, tools that fail, hang or flood, an environment that counts its calls, and for the
simulator an observation encoder and tools that take virtual time."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Sequence

from rpk.agent.env import EnvStep
from rpk.agent.template import Encoded
from rpk.core.records import FinishReason, GenDelta, GenRequest, Prompt, ToolUse
from rpk.sim import SimEngine

EOS = 2  # the tiny tokenizer's <|im_end|>


def turn_of(request: GenRequest) -> int:
    """A trajectory's turn number from its inner request id (`...-tN`)."""
    return int(request.request_id.rsplit("-t", 1)[1])


def trajectory_of(request: GenRequest) -> str:
    return request.request_id.rsplit("-t", 1)[0]


class TurnEngine:
    """Each request's reply is `reply(request)` (text), tokenised by `encode`, ending
    with the EOS id when it fits the request's budget (STOP) and cut at the budget
    otherwise (LENGTH); `chunk` tokens per delta, one event-loop turn apart. Every
    sampled token gets a log-prob of its own (-0.001, -0.002, ...), so a test can tell
    which sampled token ended up where."""

    def __init__(
        self, reply: Callable[[GenRequest], str], encode: Callable[[str], Sequence[int]],
        chunk: int = 3, delay_s: float = 0.0,
    ) -> None:
        self.reply = reply
        self.encode = encode
        self.chunk = chunk
        self.delay_s = delay_s
        self.seen: list[GenRequest] = []
        self.sampled: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self._lp = itertools.count(1)

    @property
    def max_concurrency(self) -> int:
        return 64

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        for r in requests:
            self.seen.append(r)
            self.running.add(r.request_id)
        return {r.request_id: self._generate(r) for r in requests}

    async def _generate(self, request: GenRequest) -> AsyncIterator[GenDelta]:
        text = self.reply(request)
        ids = [*self.encode(text), EOS]
        reason = FinishReason.STOP
        if len(ids) > request.max_tokens:
            ids, reason = ids[: request.max_tokens], FinishReason.LENGTH
        lps = [-next(self._lp) / 1000 for _ in ids]
        self.sampled[request.request_id] = (tuple(ids), tuple(lps))
        try:
            for lo in range(0, len(ids), self.chunk):
                await asyncio.sleep(self.delay_s)
                hi = min(lo + self.chunk, len(ids))
                last = hi == len(ids)
                yield GenDelta(request.request_id, tuple(ids[lo:hi]), tuple(lps[lo:hi]),
                               text=text if last else "", finished=last,
                               finish_reason=reason if last else None)
        finally:
            self.running.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    async def update_weights(self, buckets, version: int) -> None:
        return None

    async def shutdown(self) -> None:
        return None


class CountingEnv:
    """Answers each turn with one tool message until `turns_of(prompt)` turns are done;
    optionally waits `sleep_s` per step. Records resets, steps and closes."""

    def __init__(self, turns_of: Callable[[Prompt], int], log: list[tuple[str, str]],
                 sleep_s: float = 0.0) -> None:
        self.turns_of = turns_of
        self.log = log
        self.sleep_s = sleep_s
        self.prompt: Prompt | None = None
        self.steps = 0

    async def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt
        self.log.append(("reset", prompt.uid))

    async def step(self, turn_text: str) -> EnvStep:
        assert self.prompt is not None
        self.steps += 1
        self.log.append(("step", self.prompt.uid))
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)
        if self.steps >= self.turns_of(self.prompt):
            return EnvStep(done=True, reward=1.0)
        return EnvStep(({"role": "tool", "content": f"obs{self.steps}"},), tools=ToolUse(calls=1, seconds=0.5))

    async def close(self) -> None:
        assert self.prompt is not None
        self.log.append(("close", self.prompt.uid))


async def sleepy_tool(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return "slept"


async def failing_tool(x: int) -> str:
    """Fails.

    Args:
        x: ignored
    """
    raise RuntimeError(f"broken on {x}")


async def flooding_tool(n: int) -> str:
    """Returns n characters.

    Args:
        n: how many
    """
    return "z" * n


async def add_numbers(a: int, b: int) -> int:
    """Adds two integers (a user's own tool, loaded as tests.agent_fakes:add_numbers).

    Args:
        a: the first
        b: the second
    """
    return a + b


class Tally:
    """A stateful tool (one per trajectory, made with the row's create_kwargs)."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    async def __call__(self, n: int) -> int:
        """Adds n to the running total and returns it.

        Args:
            n: how much to add
        """
        self.total += n
        return self.total


class FixedObservation:
    """An encoder stand-in for engines without a tokenizer (the simulator)."""

    def encode(self, observation, closed: bool = True) -> Encoded:
        return Encoded((5, 5, 5), "obs")

    def ends_turn(self, token_id) -> bool:
        return True


class SlowTools:
    """Each turn calls a tool that takes `seconds_of(prompt)` of virtual time, `calls`
    times, then the trajectory ends."""

    def __init__(self, engine: SimEngine, calls: int, seconds_of) -> None:
        self.engine, self.calls, self.seconds_of = engine, calls, seconds_of
        self.steps = 0
        self.closed = False

    async def reset(self, prompt: Prompt) -> None:
        self.seconds = self.seconds_of(prompt)

    async def step(self, turn_text: str) -> EnvStep:
        self.steps += 1
        if self.steps > self.calls:
            return EnvStep(done=True)
        await self.engine.node.sleep_until(self.engine.clock() + self.seconds)
        return EnvStep(({"role": "tool", "content": "r"},), tools=ToolUse(calls=1, seconds=self.seconds))

    async def close(self) -> None:
        self.closed = True
