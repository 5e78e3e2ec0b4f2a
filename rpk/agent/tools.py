"""Tools a model calls during a trajectory: an OpenAI-style function schema (what chat
templates render with `apply_chat_template(..., tools=...)`) and the Python callable
that answers it, plus the runner that makes any call safe for the rollout.

A tool is named in config as `module:function` (an async function; a plain function runs
on one of rpk's tool workers), as `module:Class` (a stateful tool: one instance per trajectory,
made with the row's `create_kwargs` as veRL makes its tool instances, then called like a
function), or as a built-in (`calculator`, `python`). Its schema comes from the config's
schema file when that names it, else from the function's (or `Class.__call__`'s) type
hints and Google docstring (`transformers.utils.get_json_schema`, as verl's function
tools and TRL do).

`ToolRunner` is where a tool can no longer hurt a step: an exception, a call past
`timeout_s` or an output past `max_output_chars` all become the call's observation text
(`error: ...`, `timeout after 5.0 s`, the output cut with a marker) and count as a
failure. Nothing a tool does raises out of `run`, save cancellation (the trajectory was
aborted: the call must stop with it). A blocking tool runs on the runner's own workers
(`rpk.agent.workers`), never on the event loop's default executor: a hung one costs its
call, not rpk's own threaded work nor the process's exit.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import math
import operator
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpk.agent.parse import BadCall, ToolCall
from rpk.agent.workers import ToolsHung, ToolWorkers
from rpk.reward.code import CodeScorer
from rpk.reward.functions import is_async


class ToolError(ValueError):
    """A tool that cannot be loaded (bad `module:function`, no schema); names the spec."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable the model may call by `name`; `schema` is the OpenAI function schema
    (`{"type": "function", "function": {"name", "description", "parameters"}}`).
    `stateful`: `fn` is a factory (a class) made once per trajectory with the row's
    `create_kwargs`; the calls go to what it made. `ready`: awaited once before the run
    starts, so that a tool this machine cannot serve (the python tool without a working
    sandbox) stops the run in one line rather than failing every call."""

    name: str
    schema: Mapping[str, Any]
    fn: Callable[..., Any]
    stateful: bool = False
    ready: Callable[[], Awaitable[Any]] | None = None


@dataclass(frozen=True, slots=True)
class Bound:
    """A tool as one trajectory calls it: the callable and the row's hidden arguments."""

    fn: Callable[..., Any]
    hidden: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one call gave the model: the observation text, whether it failed (error,
    timeout, oversized output, unknown tool, unreadable call), its wall time from its
    start, and, for a blocking tool, the seconds it waited for a free worker first."""

    name: str
    text: str
    failed: bool
    seconds: float
    queued_s: float = 0.0


def function_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` in the OpenAI tool shape, accepting the bare `{"name", ...}` function too."""
    if schema.get("type") == "function" and isinstance(schema.get("function"), Mapping):
        return dict(schema)
    return {"type": "function", "function": dict(schema)}


def schema_name(schema: Mapping[str, Any]) -> str:
    name = function_schema(schema)["function"].get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"tool schema without a function name: {json.dumps(schema)[:200]}")
    return name


def load_schemas(path: str | Path) -> dict[str, dict[str, Any]]:
    """A JSON file holding a list of OpenAI tool schemas, by function name."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ToolError(f"agent.tool_schemas={str(path)!r}: cannot read a JSON list ({e})") from None
    if not isinstance(items, list) or not all(isinstance(s, Mapping) for s in items):
        raise ToolError(f"agent.tool_schemas={str(path)!r}: must be a JSON list of tool schemas")
    return {schema_name(s): function_schema(s) for s in items}


def import_spec(spec: str, where: str, error: type[Exception]) -> tuple[Any, str]:
    """What `module:name` names, and the name; `error` naming `where` (the config field
    and value) when it is not of that form or cannot be imported."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{where}: expected module:name")
    try:
        return getattr(importlib.import_module(module_name), attr), attr
    except (ImportError, AttributeError) as e:
        raise error(f"{where}: cannot import it ({e})") from None


def load_tool(
    spec: str, schemas: Mapping[str, Mapping[str, Any]] | None = None, code: CodeScorer | None = None,
) -> Tool:
    """The tool `spec` names: a built-in (`calculator`, `python`) or `module:function`.
    Its schema is `schemas[function name]` when given, else derived from the function.
    `code`: the run's code sandbox, which the `python` tool shares with code rewards
    (None: one of the default `reward.sandbox` settings)."""
    if spec in BUILTINS:
        if code is None:
            code = CodeScorer()
        return BUILTINS[spec](code)
    if ":" not in spec:
        raise ToolError(f"tool {spec!r}: expected module:function or one of {', '.join(BUILTINS)}")
    fn, attr = import_spec(spec, f"tool {spec!r}", ToolError)
    if not callable(fn):
        raise ToolError(f"tool {spec!r}: not callable")
    stateful = inspect.isclass(fn)
    if schemas and attr in schemas:
        schema = function_schema(schemas[attr])
    else:
        from transformers.utils import get_json_schema  # heavy; only for derived schemas

        try:
            schema = get_json_schema(fn.__call__ if stateful else fn)
        except Exception as e:  # transformers raises its own error types for bad docstrings
            raise ToolError(
                f"tool {spec!r}: no schema in agent.tool_schemas and none derivable from its "
                f"docstring and type hints ({e})"
            ) from None
        if stateful:  # get_json_schema names it __call__
            schema["function"]["name"] = attr
    return Tool(schema_name(schema), schema, fn, stateful)


class ToolRunner:
    """Runs the model's calls against `tools`, each bounded in time and output; the
    blocking ones on `workers` (by default 16 of their own)."""

    def __init__(
        self, tools: Sequence[Tool], timeout_s: float = 10.0, max_output_chars: int = 512,
        clock: Callable[[], float] = time.monotonic, workers: ToolWorkers | None = None,
    ) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ToolError(f"tools with the same name: {sorted(names)}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.clock = clock
        self.workers = workers if workers is not None else ToolWorkers(16, clock=clock)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [function_schema(t.schema) for t in self.tools.values()]

    def bind(self, tools_kwargs: Mapping[str, Mapping[str, Any]]) -> dict[str, Bound]:
        """The tools as one trajectory calls them, from its row's `tools_kwargs` (veRL's
        `{tool: {create_kwargs, execute_kwargs}}`): a stateful tool is made with its
        create_kwargs; a function has nothing to make, so both reach its every call
        (execute's win on a clash). A tool whose creation fails is an error observation
        on each call, not a failed step."""
        bound = {}
        for name, tool in self.tools.items():
            kw = tools_kwargs.get(name) or {}
            create, execute = dict(kw.get("create_kwargs") or {}), dict(kw.get("execute_kwargs") or {})
            if not tool.stateful:
                bound[name] = Bound(tool.fn, {**create, **execute})
                continue
            try:
                bound[name] = Bound(tool.fn(**create), execute)
            except Exception as e:
                bound[name] = Bound(_raiser(f"the tool could not be created ({_describe(e)})"), {})
        return bound

    async def run(self, call: ToolCall | BadCall, bound: Mapping[str, Bound] | None = None) -> ToolResult:
        """The observation of one call, to `bound[name]` (`bind`; default: the tools as
        they are, no hidden arguments). Hidden arguments come from the data row; the
        model neither sees them nor can override them."""
        if isinstance(call, BadCall):
            return ToolResult("", f"error: {call.error}", True, 0.0)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: no tool named {call.name!r} (tools: "
                                         f"{', '.join(self.tools) or 'none'})", True, 0.0)
        if tool.stateful and bound is None:
            raise ToolError(f"tool {tool.name!r} is stateful: call it through bind()")
        target = (bound or {}).get(call.name) or Bound(tool.fn, {})
        kwargs = {**call.arguments, **target.hidden}
        started, queued = self.clock(), 0.0
        try:
            if is_async(target.fn):
                async with asyncio.timeout(self.timeout_s):
                    out = await target.fn(**kwargs)
            else:
                out, queued, _ = await self.workers.call(target.fn, kwargs, self.timeout_s)
                started += queued  # the timeout and the call's time count from its start
                if inspect.isawaitable(out):
                    async with asyncio.timeout(self.timeout_s - (self.clock() - started)):
                        out = await out
        except TimeoutError:
            return ToolResult(tool.name, f"error: timeout after {self.timeout_s} s", True,
                              self.clock() - started, queued)
        except ToolsHung as e:
            return ToolResult(tool.name, f"error: {e}", True, 0.0, self.clock() - started)
        except Exception as e:  # the tool's own failure is the model's observation
            return ToolResult(tool.name, f"error: {_describe(e)}", True, self.clock() - started,
                              queued)
        seconds = self.clock() - started
        text = out if isinstance(out, str) else json.dumps(out, default=str)
        if len(text) > self.max_output_chars:
            cut = len(text) - self.max_output_chars
            return ToolResult(tool.name, f"{text[: self.max_output_chars]}...[{cut} chars cut]",
                              True, seconds, queued)
        return ToolResult(tool.name, text, False, seconds, queued)


def _describe(e: BaseException) -> str:
    # The message alone when there is one: it is what a model learns to read (and what
    # reference trajectories write); the type name when the message is empty.
    return str(e) or type(e).__name__


def _raiser(message: str) -> Callable[..., Any]:
    async def fail(**_: Any) -> Any:
        raise RuntimeError(message)

    return fail


# --------------------------------------------------------------------------- built-ins

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Bounds that keep one expression from eating the rollout's CPU (9**9**9).
_MAX_EXPONENT = 512
_MAX_DIGITS = 4000


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
            raise ValueError(f"result longer than {_MAX_DIGITS} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("result is not finite")
        return value
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


async def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2"
    """
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    return str(_evaluate(tree))


def _calculator_tool(code: CodeScorer) -> Tool:
    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string",
            "description": "numbers with + - * / // % ** and parentheses, e.g. \"(12 + 30) * 2\"",
        }}, "required": ["expression"]},
    }}
    return Tool("calculator", schema, calculator)


def _python_tool(code: CodeScorer) -> Tool:
    """Runs programs in the run's code sandbox, the one code rewards use (its slots, its
    limits: no network, bounded memory, processes and CPU time), each under the
    sandbox's timeout for a program not yet known good (`reward.sandbox.timeout_max_s`);
    the tool's own timeout bounds its wall time."""
    sandbox, timeout_s = code.sandbox, code.cfg.timeout_max_s

    async def python(code: str) -> str:
        result = await sandbox.run({"main.py": code}, ["main.py"], "", timeout_s=timeout_s)
        out = result.stdout.decode(errors="replace")
        if not result.ok:
            err = result.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"{result.status} (exit {result.returncode}): {' '.join(err)}")
        return out

    schema = {"type": "function", "function": {
        "name": "python", "description": "Runs a Python program and returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {
            "type": "string", "description": "the program; print the values you need",
        }}, "required": ["code"]},
    }}
    return Tool("python", schema, python, ready=sandbox.probe)


BUILTINS: dict[str, Callable[[CodeScorer], Tool]] = {"calculator": _calculator_tool, "python": _python_tool}
