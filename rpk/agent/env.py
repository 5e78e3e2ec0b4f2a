"""Environments: what answers a model turn, in the style of gymnasium and verifiers.

An environment lives for one trajectory: `reset(prompt)` before the first turn (the
prompt's row, veRL layout, carries per-row settings in `extra_info`), `step(turn_text)`
after each model turn, returning the observation messages that the chat template turns
into the next turn's context, whether the trajectory is done, and an optional reward;
`close()` once, however the trajectory ended (aborted too).

`ToolEnv` is the tool-calling environment: it runs the turn's `<tool_call>` blocks and
answers with one `tool` message per call; a turn without a call is the final answer.
A user's own environment is any class with the same three async methods, named in
config as `module:Class` and built with no arguments, one per trajectory.

`reset` returns nothing: the prompt's tokens are the start of the context, rendered once
when the data was loaded, and an environment that wants to say more first says it in
the row's prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rpk.agent.parse import BadCall, ToolCall, parse_tool_calls
from rpk.agent.tools import Bound, ToolResult, ToolRunner, import_spec
from rpk.core.records import Prompt, ToolUse

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EnvStep:
    """What the environment answers to one model turn. Its tools are what the metrics
    report (an environment without tools leaves them 0)."""

    observation: tuple[Message, ...] = ()
    done: bool = False
    reward: float | None = None
    tools: ToolUse = ToolUse()


class Environment(Protocol):
    async def reset(self, prompt: Prompt) -> None: ...

    async def step(self, turn_text: str) -> EnvStep: ...

    async def close(self) -> None: ...


EnvFactory = Callable[[], Environment]


class EnvError(ValueError):
    """An environment class that cannot be loaded; names the spec."""


def load_env(spec: str) -> EnvFactory:
    """The class `module:Class` names, as a factory of one environment per trajectory."""
    cls, _ = import_spec(spec, f"agent.env={spec!r}", EnvError)
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"agent.env={spec!r}: has no {', '.join(missing)} method(s)")
    return cls


def row_tools_kwargs(prompt: Prompt) -> dict[str, Mapping[str, Any]]:
    """A row's per-tool settings in veRL's layout, `extra_info.tools_kwargs.<tool>` =
    `{create_kwargs, execute_kwargs}` (see `ToolRunner.bind`)."""
    given = prompt.extra_info.get("tools_kwargs") or {}
    return {name: kw for name, kw in given.items() if isinstance(kw, Mapping)}


class ToolEnv:
    """Runs a turn's tool calls (at most `max_parallel_calls` of them, concurrently);
    a turn that calls nothing ends the trajectory."""

    def __init__(self, runner: ToolRunner, max_parallel_calls: int = 4) -> None:
        self.runner = runner
        self.max_parallel_calls = max_parallel_calls
        self.bound: dict[str, Bound] = {}

    async def reset(self, prompt: Prompt) -> None:
        self.bound = self.runner.bind(row_tools_kwargs(prompt))

    async def step(self, turn_text: str) -> EnvStep:
        calls = parse_tool_calls(turn_text)
        if not calls:
            return EnvStep(done=True)
        ran, skipped = calls[: self.max_parallel_calls], calls[self.max_parallel_calls :]
        results: list[ToolResult] = list(await asyncio.gather(
            *(self.runner.run(c, self.bound) for c in ran)
        ))
        # The surplus is answered too, so that every block the model wrote gets a reply
        # and it learns the limit.
        results += [ToolResult(_name(c), f"error: more than {self.max_parallel_calls} tool "
                                         "calls in one turn; this one did not run", True, 0.0)
                    for c in skipped]
        return EnvStep(
            observation=tuple(_tool_message(r) for r in results),
            tools=ToolUse(calls=len(results), failures=sum(r.failed for r in results),
                          seconds=sum(r.seconds for r in results),
                          queued_s=sum(r.queued_s for r in results)),
        )

    async def close(self) -> None:
        self.bound = {}


def _name(call: ToolCall | BadCall) -> str:
    return call.name if isinstance(call, ToolCall) else ""


def _tool_message(result: ToolResult) -> Message:
    msg: dict[str, Any] = {"role": "tool", "content": result.text}
    if result.name:
        msg["name"] = result.name
    return msg


def tool_env_factory(runner: ToolRunner, max_parallel_calls: int) -> EnvFactory:
    return lambda: ToolEnv(runner, max_parallel_calls)


def env_reward(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """The environment's own reward as a reward function of veRL's signature
    (`--reward.function rpk.agent.env:env_reward`): what the last step's `EnvStep.reward`
    said; 0.0 for a trajectory whose environment never gave one (it ran out of turns or
    tokens first)."""
    value = (extra_info or {}).get("env_reward")
    return 0.0 if value is None else float(value)
