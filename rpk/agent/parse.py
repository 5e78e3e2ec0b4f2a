"""Tool calls in a model turn's text, in the Hermes/Qwen format that chat templates teach:

    <tool_call>
    {"name": "add", "arguments": {"a": "123", "b": "456"}}
    </tool_call>

Each block is parsed on its own: a block whose JSON is bad, or that names no function,
becomes a `BadCall` (its error goes back to the model as that call's observation) while
the other blocks of the turn still run. vLLM's Hermes parser drops every call of a turn
when one block is bad, which would turn one typo into a silent final answer; verl skips
bad blocks one at a time, which is what this does.

A final `<tool_call>` without its closing tag is accepted (a model that stopped on its
end-of-turn token right after the JSON), as vLLM's parser does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

# Non-greedy up to the first closing tag, or to the end of the text for an unterminated
# last block. A literal "</tool_call>" inside an argument string ends the block early
# (vllm#45167); the JSON is then bad and the model is told so.
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One well-formed call: a function name and its JSON-object arguments."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BadCall:
    """A `<tool_call>` block that could not be read; `error` says why, for the model."""

    text: str
    error: str


def parse_tool_calls(text: str) -> list[ToolCall | BadCall]:
    """Every `<tool_call>` block of `text`, in order; [] when the turn calls nothing."""
    return [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]


def _parse_block(body: str) -> ToolCall | BadCall:
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return BadCall(raw, f"the tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict):
        return BadCall(raw, f"the tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return BadCall(raw, "the tool call has no \"name\" string")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # Some templates (Qwen3) and models write the arguments as a JSON string.
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return BadCall(raw, f"the arguments of {name!r} are not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return BadCall(raw, f"the arguments of {name!r} must be a JSON object, got "
                            f"{type(args).__name__}")
    return ToolCall(name, args)


def format_tool_call(call: ToolCall) -> str:
    """The block a model writes for `call` (what reference trajectories and tests use)."""
    payload = json.dumps({"name": call.name, "arguments": dict(call.arguments)})
    return f"{OPEN}\n{payload}\n{CLOSE}"
