"""The multi-turn task: problems and rows in veRL's layout, the adder tool (its sums, its
refusals, its seeded 5% failures), the reward, and reference trajectories that the
agent's own parser and tool runner replay to the right answer."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from rpk.agent.parse import ToolCall, parse_tool_calls
from rpk.agent.tools import ToolRunner, load_tool
from rpk.config import ArithSpec
from rpk.tasks import tool_add
from rpk.tasks.arith import make_problem
from rpk.tasks.tool_add import Adder, AdderBusy, add_digits, compute_score


def _problem(digits: int, seed: int = 0):
    rng = random.Random(seed)
    while True:
        p = make_problem(rng, ArithSpec())
        if p.digits == digits:
            return p


def test_rows_follow_verls_multi_turn_layout_and_repeat_for_a_seed() -> None:
    rows = tool_add.make_rows(200, seed=3)
    assert rows == tool_add.make_rows(200, seed=3)
    assert rows != tool_add.make_rows(200, seed=4)
    for i, row in enumerate(rows):
        assert row["agent_name"] == "tool_agent"
        assert row["data_source"] == tool_add.DATA_SOURCE
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].startswith("What is ")
        a, b = message["content"].split("?")[0].removeprefix("What is ").split(" + ")
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(int(a) + int(b))}
        extra = row["extra_info"]
        assert extra["index"] == i and extra["digits"] == len(a)
        assert extra["calls"] == math.ceil(len(a) / 4)
        assert extra["need_tools_kwargs"] is True
        assert isinstance(extra["tools_kwargs"]["add"]["create_kwargs"]["seed"], int)
    # arith's power law: most problems take one call, a few take five.
    calls = [row["extra_info"]["calls"] for row in tool_add.make_rows(4000, seed=0)]
    assert calls.count(1) > len(calls) / 2 and calls.count(5) > 0 and max(calls) == 5


def test_held_out_rows_share_no_question_with_the_training_rows() -> None:
    train = tool_add.make_rows(500, seed=1)
    val = tool_add.held_out_rows(100, seed=2, exclude=train)
    questions = {r["prompt"][0]["content"] for r in train}
    assert len(val) == 100 and not questions & {r["prompt"][0]["content"] for r in val}
    with pytest.raises(ValueError, match="outside the training rows"):
        tool_add.held_out_rows(10, seed=2, exclude=train, spec=ArithSpec(max_digits=1))


def test_the_adder_adds_four_digit_chunks_with_a_carry_and_labels_the_sum() -> None:
    assert add_digits("D4C8B2A1", "d0c3b9a7", 0) == "sD5sC2sB1sA8 carry=0"
    assert add_digits("H9G9F9E9", "h0g0f0e0", 1) == "sH0sG0sF0sE0 carry=1"
    assert add_digits("4821", "397", 1) == "5219 carry=0"
    assert add_digits(12, 9, 0) == "21 carry=0"
    # Labels only when the first operand labels every digit of the sum.
    assert add_digits("A5", "b3a9", 0) == "44 carry=0"
    with pytest.raises(ValueError, match="a='12345' has 5 digits; the adder takes at most 4"):
        add_digits("12345", "1", 0)
    for carry in (2, 1.0, True, "1"):
        with pytest.raises(ValueError, match=f"carry={carry!r} must be 0 or 1"):
            add_digits("1", "1", carry)
    with pytest.raises(ValueError, match="b='x' is not digits"):
        add_digits("1", "x", 0)


def test_the_adder_answers_with_the_running_sum_of_its_trajectory() -> None:
    # 14821 + 30397: the second chunk's result holds the whole sum, which the answer copies.
    adder = Adder(0, fail_rate=0.0)
    assert adder.run("D4C8B2A1", "d0c3b9a7", 0) == "sD5sC2sB1sA8 carry=0"
    assert adder.run("E1", "e3", 0) == "sE4sD5sC2sB1sA8 carry=0"
    # A chunk summed again takes its newer digits; the carry is this call's own.
    assert adder.run("D9C8B2A1", "d0c3b9a7", 0) == "sE4sD0sC2sB1sA8 carry=1"
    # An unlabelled call answers alone and leaves the running sum as it was.
    assert adder.run("12", "9", 0) == "21 carry=0"
    assert adder.run("F1", "f1", 0) == "sF2sE4sD0sC2sB1sA8 carry=0"
    # A fresh adder (another trajectory) starts from nothing.
    assert Adder(0, fail_rate=0.0).run("E1", "e3", 0) == "sE4 carry=0"
    # Repeated labels cannot be placed in the running sum: the digits come back bare.
    assert Adder(0, fail_rate=0.0).run("A1A2", "a0a0", 0) == "12 carry=0"


def test_the_adder_fails_five_percent_of_calls_deterministically_per_seed() -> None:
    n = 20000
    rate = sum(tool_add.fails(7, call) for call in range(n)) / n
    assert abs(rate - tool_add.FAIL_RATE) < 4 * math.sqrt(0.05 * 0.95 / n)

    def outcomes(seed: int) -> list[str]:
        adder, out = Adder(seed), []
        for _ in range(200):
            try:
                out.append(asyncio.run(adder("A1", "a2", 0)))
            except AdderBusy as e:
                out.append(f"busy: {e}")
        return out

    first = outcomes(11)
    assert first == outcomes(11) and first != outcomes(12)
    assert {"sA3 carry=0", f"busy: {tool_add.BUSY_MESSAGE}"} == set(first)
    # A failed call, made again, is a fresh draw: retries get through.
    busy = first.index(f"busy: {tool_add.BUSY_MESSAGE}")
    assert first[busy + 1] == "sA3 carry=0" or first[busy + 2] == "sA3 carry=0"


@pytest.mark.parametrize(("digits", "calls"), [(1, 1), (3, 1), (4, 1), (5, 2), (12, 3), (20, 5)])
def test_a_reference_trajectory_calls_once_per_four_digit_chunk(digits: int, calls: int) -> None:
    problem = _problem(digits)
    messages = tool_add.reference_messages(problem, seed=0, fail_rate=0.0)
    assert [m["role"] for m in messages] == ["user", *["assistant", "tool"] * calls, "assistant"]
    assert tool_add.calls_needed(digits) == calls
    # Each result holds every digit summed so far; the answer is the last one's copy.
    results = [m["content"].removesuffix(" carry=0").removesuffix(" carry=1")
               for m in messages if m["role"] == "tool"]
    assert [len(r) for r in results] == [3 * min(4 * (k + 1), digits) for k in range(calls)]
    assert all(later.endswith(earlier) for earlier, later in zip(results, results[1:]))
    assert messages[-1]["content"] == f"Answer: {results[-1]}"
    assert tool_add.extract_answer(messages[-1]["content"]) == problem.answer


def _replay(row: dict, messages: list[dict[str, str]]) -> tuple[list[str], int]:
    """The reference's calls, parsed with the agent's parser and run by its tool runner
    with the tool loaded as build loads it (one Adder per trajectory, the row's seed)."""
    (spec,) = tool_add.TOOLS
    tool = load_tool(spec, tool_add.TOOL_SCHEMAS)
    assert tool.name == "add" and tool.stateful and tool.schema == tool_add.TOOL_SCHEMA
    runner = ToolRunner([tool])
    bound = runner.bind(row["extra_info"]["tools_kwargs"])
    observed, failures = [], 0
    for message in messages[1:-1]:
        if message["role"] != "assistant":
            continue
        (call,) = parse_tool_calls(message["content"])
        assert isinstance(call, ToolCall) and call.name == "add"
        result = asyncio.run(runner.run(call, bound))
        observed.append(result.text)
        failures += result.failed
    return observed, failures


def test_reference_trajectories_replay_through_the_agents_parser_and_runner() -> None:
    rows = tool_add.make_rows(300, seed=5)
    total_failures = 0
    for row in rows:
        seed = row["extra_info"]["tools_kwargs"]["add"]["create_kwargs"]["seed"]
        problem = _problem_of(row)
        messages = tool_add.reference_messages(problem, seed)
        observed, failures = _replay(row, messages)
        assert observed == [m["content"] for m in messages if m["role"] == "tool"]
        calls = sum(m["role"] == "assistant" for m in messages) - 1
        assert calls == row["extra_info"]["calls"] + failures
        total_failures += failures
        assert compute_score(row["data_source"], messages[-1]["content"],
                             row["reward_model"]["ground_truth"]) == 1.0
    # 5% of ~400 calls: a few trajectories show a failure and its retry.
    assert 5 <= total_failures <= 50


def _problem_of(row: dict):
    a, b = row["prompt"][0]["content"].split("?")[0].removeprefix("What is ").split(" + ")
    from rpk.tasks.arith import Problem

    return Problem(int(a), int(b), len(a), row["prompt"][0]["content"], row["reward_model"]["ground_truth"])


def test_a_failed_call_is_made_again_as_it_was() -> None:
    p = _problem(9)
    seed = next(s for s in range(1000) if tool_add.fails(s, 0) and not tool_add.fails(s, 1))
    messages = tool_add.reference_messages(p, seed)
    assert messages[2] == {"role": "tool", "content": f"error: {tool_add.BUSY_MESSAGE}"}
    assert messages[1] == messages[3]
    assert messages[4]["content"].endswith("carry=0") or messages[4]["content"].endswith("carry=1")


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("<tool_call>...</tool_call>\nAnswer: sD5sC2sB1sA8", 1.0),
        ("Answer: sD5sC2sB1sA8<|im_end|>", 1.0),
        ("Answer: 5218", 1.0),
        ("Answer: D5C2B1A8", 1.0),
        ("Answer: 1\nAnswer: sD5sC2sB1sA8", 1.0),
        ("Answer: sD5sC2sB1sA9", 0.0),
        ("Answer: 52180", 0.0),
        ("sD5sC2sB1sA8 carry=0", 0.0),
        ("", 0.0),
        (None, 0.0),
    ],
)
def test_the_reward_is_the_exact_answer(text: object, score: float) -> None:
    assert compute_score(tool_add.DATA_SOURCE, text, "5218") == score
