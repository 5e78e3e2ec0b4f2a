"""Long additions with an adder tool: rpk's built-in multi-turn task.

The problems are arith's (`rpk.tasks.arith`: the same power-law digit counts, the same
question), but the model may not add columns itself: it calls the `add` tool, which
takes at most 4 digits per operand and a carry, once per 4-column chunk, units first,
feeding each chunk's carry out into the next call, then writes the answer. A 3-digit
sum needs one call, a 20-digit sum five, so the turn count has the same long tail as
the digit count. The tool fails 5% of the time (`AdderBusy`); a failed call is simply
made again, which the warm-up shows and RL rewards. Called as a tool in a run, it
answers after a latency drawn as a remote tool's would be (`agent.tool_latency`,
`rpk.sched.toolwait`), or never (the call's timeout ends it).

The layout is chosen for a tiny transformer, as arith's is (see its docstring): every
digit the model copies stands behind a label of its own, so that each copy is an
induction-head match rather than a position offset to count:
- an operand is the chunk's digits behind their column labels, most significant first
  (`"a":"D4C8B2A1"` is 4821, `"b":"d0c3b9a7"` is 397): each `D4` is copied from the
  question's `D4d0`; the labels of a chunk are consecutive letters, and chunk k covers
  the labels 4k..4k+3, so every chunk but the top one has the same width;
- the tool labels the sum's digits with the first operand's labels behind an `s` (for
  sum: `sD5sC2sB1sA8 carry=0`), and the tokenizer learns each `sD` as one token
  (`rpk.tasks.tiny_multi.corpus`). `sD` occurs nowhere but in tool results, so the
  answer's `sD` fetches the digit behind an `sD` before it: a plain induction-head
  match on one token. (A colon behind the label, `D:5`, makes it a match on two tokens,
  `D` then `:`, which the tiny model does not learn: docs/default-run.md);
- the adder is one stateful tool per trajectory and answers with the running sum: the
  digits of this call and of every earlier call of the trajectory, most significant
  first (see the second example below). The answer is then a copy of the last result,
  which the warm-up learns reliably; copying each chunk from its own, earlier result
  it learns far less often, and a sum of several calls needs every chunk right
  (docs/default-run.md);
- the carry comes back as `carry=1`, after the result's last label, and is copied into
  the next call's `"carry"`;
- the answer lists the sum's digits most significant first, as labelled as the last
  result holds them (`Answer: sD5sC2sB1sA8`); only its digits are scored (`Answer:
  5218` scores the same).

Example, 4821 + 397 (the question is arith's):

    user:      What is 4821 + 397?
               Columns:
               D4d0;C8c3;B2b9;A1a7
    assistant: <tool_call>{"name":"add","arguments":{"a":"D4C8B2A1","b":"d0c3b9a7","carry":0}}</tool_call>
    tool:      sD5sC2sB1sA8 carry=0
    assistant: Answer: sD5sC2sB1sA8

With a second chunk (14821 + 30397), the second call is
`{"a":"E1","b":"e3","carry":0}` and its result `sE4sD5sC2sB1sA8 carry=0`, which the
answer copies.

A sum whose top column carries out is redrawn (as in arith), so the last result's carry
is always 0 and the answer has as many digits as the first operand.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from collections.abc import Sequence
from typing import Any

from rpk.sched.toolwait import LatencyDraws, uniform
from rpk.tasks import TASKS, arith
from rpk.tasks.arith import Problem, columns, make_problem
from rpk.tasks.specs import ArithSpec

DATA_SOURCE = TASKS["tool_add"].data_source
AGENT_NAME = "tool_agent"  # veRL's multi-turn agent loop name, in the rows
TOOL_NAME = "add"
CHUNK_DIGITS = 4  # the adder's width: at most this many digits per operand
FAIL_RATE = 0.05
SUM_MARK = "s"  # before each of a result's labels: `sD` is one token, unique to results
BUSY_MESSAGE = "adder busy, try again"

TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            f"Add two numbers of at most {CHUNK_DIGITS} digits each and a carry. A digit "
            "may stand behind a column letter (D4C8B2A1 is 4821); the sum's digits come "
            "back behind the first operand's letters, each after an s (sD5sC2sB1sA8), "
            "with those of this trajectory's earlier calls (the running sum, most significant "
            "first), followed by this call's carry out (carry=0 or carry=1). Fails now and "
            "then: call it again."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "string", "description": "first operand, most significant digit first"},
                "b": {"type": "string", "description": "second operand, most significant digit first"},
                "carry": {"type": "integer", "description": "carry in, 0 or 1"},
            },
            "required": ["a", "b", "carry"],
        },
    },
}

# The task's tools for the agent's loader (`rpk.agent.tools.load_tool`), by spec, with
# their schemas by attribute name: the adder is stateful, one `Adder` per trajectory
# made with the row's create_kwargs. Named, not imported: rpk.agent depends on the
# reward functions, which depend on the tasks.
TOOLS = ("rpk.tasks.tool_add:Adder",)
TOOL_SCHEMAS = {"Adder": TOOL_SCHEMA}

_OPERAND_RE = re.compile(r"(?:[A-Za-z]?[0-9])+")
_SUM_LABELLED_RE = re.compile(r"(?:s[A-Z][0-9])+")


class AdderBusy(RuntimeError):
    """The adder's simulated transient failure: the same call, made again, may pass."""


# --------------------------------------------------------------------------- the tool


def _operand(name: str, value: Any) -> list[tuple[str | None, int]]:
    """(label or None, digit) per digit of an operand, most significant first."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if not isinstance(value, str) or not _OPERAND_RE.fullmatch(value):
        raise ValueError(f"{name}={value!r} is not digits (each may follow one letter)")
    pairs = [(m.group(1) or None, int(m.group(2))) for m in re.finditer(r"([A-Za-z]?)([0-9])", value)]
    if len(pairs) > CHUNK_DIGITS:
        raise ValueError(f"{name}={value!r} has {len(pairs)} digits; the adder takes at most {CHUNK_DIGITS}")
    return pairs


def chunk_sum(a: Any, b: Any, carry: Any) -> tuple[list[tuple[str | None, str]], int]:
    """One call's sum of `a + b + carry` in as many digits as the longer operand, most
    significant first, each with `a`'s label when `a` has one distinct label per digit
    of the sum (else None), and the carry out. ValueError names a bad argument."""
    da, db = _operand("a", a), _operand("b", b)
    if type(carry) is not int or carry not in (0, 1):
        raise ValueError(f"carry={carry!r} must be 0 or 1")
    width = max(len(da), len(db))
    total = int("".join(str(d) for _, d in da)) + int("".join(str(d) for _, d in db)) + carry
    digits = str(total % 10**width).zfill(width)
    labels = [label for label, _ in da]
    if len(labels) != width or not all(labels) or len(set(labels)) != width:
        labels = [None] * width
    return list(zip(labels, digits)), total // 10**width


def result_text(digits: Sequence[tuple[str | None, str]], carry_out: int) -> str:
    """The adder's text for labelled digits (`sD5sC2...`, or bare digits when any is
    unlabelled) and a carry out."""
    if all(label for label, _ in digits):
        body = "".join(f"{SUM_MARK}{label}{digit}" for label, digit in digits)
    else:
        body = "".join(digit for _, digit in digits)
    return f"{body} carry={carry_out}"


def add_digits(a: Any, b: Any, carry: Any) -> str:
    """The answer of a fresh adder to one call that does not fail: `chunk_sum` as text.
    ValueError names a bad argument."""
    return result_text(*chunk_sum(a, b, carry))


def fails(seed: int, call: int, rate: float = FAIL_RATE) -> bool:
    """Whether call number `call` of an adder seeded `seed` fails: a hash, not a shared
    random stream, so that the answer does not depend on what other trajectories called
    meanwhile."""
    return uniform(seed, call) < rate


class Adder:
    """One trajectory's adder: its n-th call fails iff `fails(seed, n)` and, called as a
    tool, answers after its trajectory's n-th latency draw (`latency.start(seed)`;
    never, when that is infinite: the caller's timeout ends it, as a remote tool's
    would), so failures replay exactly for a seed, waits for a seed's n-th trajectory,
    and a retry draws afresh. A labelled call answers with the running sum:
    its digits and those of the trajectory's earlier labelled calls, by label, most
    significant (last in the alphabet) first; a label summed again takes the newer digit."""

    __slots__ = ("seed", "fail_rate", "calls", "wait", "sums")

    def __init__(self, seed: int = 0, fail_rate: float = FAIL_RATE,
                 latency: LatencyDraws | None = None) -> None:
        self.seed = seed
        self.fail_rate = fail_rate
        self.calls = 0
        self.wait = latency.start(seed) if latency is not None else None
        self.sums: dict[str, str] = {}

    def run(self, a: Any, b: Any, carry: Any = 0) -> str:
        """One call, synchronously (pure arithmetic): the result text, or AdderBusy."""
        call = self.calls
        self.calls += 1
        return self._answer(call, a, b, carry)

    async def __call__(self, a: Any, b: Any, carry: Any = 0) -> str:
        # A call that never answers was still made: the next one draws afresh.
        call = self.calls
        self.calls += 1
        seconds = self.wait(call) if self.wait is not None else 0.0
        if math.isinf(seconds):
            await asyncio.Event().wait()  # until the caller's timeout cancels it
        elif seconds > 0:
            await asyncio.sleep(seconds)
        return self._answer(call, a, b, carry)

    def _answer(self, call: int, a: Any, b: Any, carry: Any) -> str:
        if fails(self.seed, call, self.fail_rate):
            raise AdderBusy(BUSY_MESSAGE)
        digits, carry_out = chunk_sum(a, b, carry)
        labelled = {label: digit for label, digit in digits if label is not None}
        if len(labelled) < len(digits):
            return result_text(digits, carry_out)
        self.sums.update(labelled)
        running = sorted(self.sums.items(), key=lambda item: item[0], reverse=True)
        return result_text(running, carry_out)


# --------------------------------------------------------------------------- reference


def chunks(problem: Problem) -> list[list[tuple[str, int, int]]]:
    """The problem's columns (label, digit of a, digit of b), units first, in chunks of
    CHUNK_DIGITS columns: one tool call each."""
    cols = columns(problem.a, problem.b, problem.digits)
    return [cols[k : k + CHUNK_DIGITS] for k in range(0, len(cols), CHUNK_DIGITS)]


def call_arguments(chunk: Sequence[tuple[str, int, int]], carry: int) -> dict[str, Any]:
    """The reference call's arguments for one chunk (columns units first)."""
    top_first = list(reversed(chunk))
    return {
        "a": "".join(f"{label}{x}" for label, x, _ in top_first),
        "b": "".join(f"{label.lower()}{y}" for label, _, y in top_first),
        "carry": carry,
    }


def call_text(arguments: dict[str, Any]) -> str:
    """An assistant turn that calls the adder, in the Hermes/Qwen format without its
    newlines and JSON spaces (a tiny model pays for every token)."""
    payload = json.dumps({"name": TOOL_NAME, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{payload}</tool_call>"


def error_text(error: BaseException) -> str:
    """The observation a failed call leaves (what rpk's tool runner writes)."""
    return f"error: {error}"


def reference_messages(problem: Problem, seed: int, fail_rate: float = FAIL_RATE,
                       stop_early: bool = False) -> list[dict[str, str]]:
    """A correct trajectory as chat messages: the question, one call per chunk (a failed
    call made again as it was), each result as a `tool` message, and the answer. The
    failures are those of `Adder(seed)`, so the trajectory is what the tool would do.
    `stop_early` (a sum of two calls or more): the last call is not made and the answer
    copies the partial sum before it, as the warm-up's habit does (`rpk.tasks.tiny_multi`)."""
    adder = Adder(seed, fail_rate)
    messages = [{"role": "user", "content": problem.question}]
    carry = 0
    result = ""
    todo = chunks(problem)
    if stop_early and len(todo) > 1:
        todo = todo[:-1]
    for chunk in todo:
        arguments = call_arguments(chunk, carry)
        while True:
            messages.append({"role": "assistant", "content": call_text(arguments)})
            try:
                result = adder.run(**arguments)
            except AdderBusy as e:
                messages.append({"role": "tool", "content": error_text(e)})
                continue
            messages.append({"role": "tool", "content": result})
            break
        carry = int(result.rpartition(" carry=")[2])
    # The last result holds the whole sum (the adder's running sum).
    messages.append({"role": "assistant", "content": f"Answer: {result.rpartition(' carry=')[0]}"})
    return messages


# --------------------------------------------------------------------------- reward


def extract_answer(text: str) -> str | None:
    """The value of the last `Answer:` line with its labels dropped (`sD5sC2sB1sA8` is
    5218), or None when there is none."""
    value = arith.extract_answer(text)  # which takes arith's `D5C2B1A8` too
    if value is not None and _SUM_LABELLED_RE.fullmatch(value):
        return value[2::3]
    return value


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """veRL's reward signature: 1.0 iff the trajectory's last `Answer:` value (labels
    dropped) is the sum, else 0.0. The sum must come from the tool's results: the answer
    line is all that is read."""
    return arith.exact_score(solution_str, ground_truth, extract_answer)


# --------------------------------------------------------------------------- rows


def calls_needed(digits: int) -> int:
    """Adder calls a correct trajectory makes when no call fails."""
    return -(-digits // CHUNK_DIGITS)


def _row(p: Problem, index: int, seed: int) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": p.question}],
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {
            "index": index,
            "digits": p.digits,
            "calls": calls_needed(p.digits),
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"seed": seed}}},
        },
    }


def make_rows(n: int, seed: int, spec: ArithSpec = ArithSpec()) -> list[dict[str, Any]]:
    """`n` prompts in veRL's multi-turn row layout; the same seed gives the same rows.
    Each row names its adder's failure seed in `extra_info.tools_kwargs.add`."""
    rng = random.Random(seed)
    return [_row(make_problem(rng, spec), i, rng.randrange(2**31)) for i in range(n)]


def held_out_rows(
    n: int, seed: int, exclude: Sequence[dict[str, Any]], spec: ArithSpec = ArithSpec()
) -> list[dict[str, Any]]:
    """`n` distinct rows like `make_rows`'s, none with the question of a row of `exclude`
    (see `rpk.tasks.arith.held_out_rows`). ValueError when `n` such rows cannot be drawn."""
    return arith.draw_held_out(
        n, seed, exclude, spec, lambda p, index, rng: _row(p, index, rng.randrange(2**31))
    )
