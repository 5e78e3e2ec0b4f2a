"""The pure parts of multi-turn rollouts: the tool-call parser, the tool runner (failure,
timeout, oversized output become observation text), the trajectory state machine and
the template's observation encoder."""

from __future__ import annotations

import asyncio
import json

import pytest

from rpk.agent.env import EnvStep, ToolEnv, row_tools_kwargs
from rpk.agent.parse import BadCall, ToolCall, format_tool_call, parse_tool_calls
from rpk.agent.template import ObservationEncoder, TemplateError
from rpk.agent.tools import ToolError, ToolRunner, load_schemas, load_tool
from rpk.agent.trajectory import Trajectory, TrajectoryPhase
from rpk.config import TinySpec
from rpk.core.records import FinishReason, GenRequest, IllegalTransition, Prompt, ToolUse
from rpk.tasks.tiny import build_tokenizer

# -- parser ---------------------------------------------------------------------------


def test_parser_reads_each_block_and_isolates_bad_ones() -> None:
    text = (
        'let me add <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
        '<tool_call>{"name": "last", "arguments": {}}'  # unterminated: the turn ended
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(calls[1], BadCall) and "not valid JSON" in calls[1].error
    assert isinstance(calls[2], BadCall) and "name" in calls[2].error
    assert calls[3] == ToolCall("calc", {"expression": "2+2"})
    assert calls[4] == ToolCall("last", {})
    assert parse_tool_calls("The answer is 42.") == []


def test_formatted_calls_parse_back() -> None:
    call = ToolCall("add", {"a": "0012", "b": "9"})
    assert parse_tool_calls("x" + format_tool_call(call) + "y") == [call]


# -- tools ----------------------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def runner(timeout_s: float = 0.2, cap: int = 16) -> ToolRunner:
    tools = [load_tool(f"tests.agent_fakes:{n}") for n in
             ("sleepy_tool", "failing_tool", "flooding_tool", "add_numbers")]
    return ToolRunner(tools + [load_tool("calculator")], timeout_s=timeout_s, max_output_chars=cap)


def test_failure_timeout_and_oversized_output_become_observation_text() -> None:
    r = runner()
    failed = run(r.run(ToolCall("failing_tool", {"x": 3})))
    assert failed.failed and failed.text == "error: broken on 3"
    slow = run(r.run(ToolCall("sleepy_tool", {"seconds": 30})))
    assert slow.failed and slow.text == "error: timeout after 0.2 s" and slow.seconds < 5
    big = run(r.run(ToolCall("flooding_tool", {"n": 100})))
    assert big.failed and big.text == "z" * 16 + "...[84 chars cut]"
    ok = run(r.run(ToolCall("flooding_tool", {"n": 16})))
    assert not ok.failed and ok.text == "z" * 16
    unknown = run(r.run(ToolCall("nope", {})))
    assert unknown.failed and "no tool named 'nope'" in unknown.text
    wrong_args = run(r.run(ToolCall("add_numbers", {"a": 1})))
    assert wrong_args.failed and "missing 1 required positional argument" in wrong_args.text
    assert run(r.run(ToolCall("add_numbers", {"a": 1, "b": 2}))).text == "3"


def test_calculator_is_arithmetic_only() -> None:
    r = runner()
    assert run(r.run(ToolCall("calculator", {"expression": "(12 + 30) * 2"}))).text == "84"
    for bad in ("__import__('os')", "9 ** 9 ** 9", "1 / 0"):
        assert run(r.run(ToolCall("calculator", {"expression": bad}))).failed, bad


def test_tool_env_runs_calls_counts_failures_and_ends_on_no_call() -> None:
    env = ToolEnv(runner(), max_parallel_calls=2)
    prompt = Prompt("u", (1,), "t", "", extra_info={
        "tools_kwargs": {"add_numbers": {"create_kwargs": {"b": 5}, "execute_kwargs": {}}}})
    run(env.reset(prompt))
    turn = (format_tool_call(ToolCall("add_numbers", {"a": 1, "b": 999}))
            + format_tool_call(ToolCall("failing_tool", {"x": 1}))
            + format_tool_call(ToolCall("add_numbers", {"a": 2})))
    step = run(env.step(turn))
    assert not step.done and step.tools.calls == 3 and step.tools.failures == 2
    # the row's hidden argument wins over the model's; the third call is over the limit
    assert [m["content"] for m in step.observation] == [
        "6", "error: broken on 1",
        "error: more than 2 tool calls in one turn; this one did not run"]
    assert run(env.step("The answer is 6.")).done
    assert row_tools_kwargs(prompt) == {"add_numbers": {"create_kwargs": {"b": 5}, "execute_kwargs": {}}}


def test_stateful_tool_is_made_per_trajectory_with_the_rows_create_kwargs() -> None:
    tally = load_tool("tests.agent_fakes:Tally")
    assert tally.stateful and tally.name == "Tally"
    assert tally.schema["function"]["parameters"]["required"] == ["n"]
    r = ToolRunner([tally])

    async def trajectory(start):
        env = ToolEnv(r)
        await env.reset(Prompt("u", (1,), "t", "", extra_info={
            "tools_kwargs": {"Tally": {"create_kwargs": {"start": start}}}}))
        outs = []
        for n in (1, 2):
            step = await env.step(format_tool_call(ToolCall("Tally", {"n": n})))
            outs.append(step.observation[0]["content"])
        return outs

    async def both():
        return await asyncio.gather(trajectory(10), trajectory(100))

    assert run(both()) == [["11", "13"], ["101", "103"]]
    bad = ToolEnv(r)
    run(bad.reset(Prompt("u", (1,), "t", "", extra_info={
        "tools_kwargs": {"Tally": {"create_kwargs": {"nope": 1}}}})))
    step = run(bad.step(format_tool_call(ToolCall("Tally", {"n": 1}))))
    assert step.tools.failures == 1 and "could not be created" in step.observation[0]["content"]


def test_user_tool_schema_from_config_file_or_docstring(tmp_path) -> None:
    schema = {"type": "function", "function": {"name": "add_numbers", "description": "sum",
                                               "parameters": {"type": "object", "properties": {}}}}
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([schema]))
    assert load_tool("tests.agent_fakes:add_numbers", load_schemas(path)).schema == schema
    derived = load_tool("tests.agent_fakes:add_numbers").schema["function"]
    assert derived["name"] == "add_numbers" and set(derived["parameters"]["required"]) == {"a", "b"}
    for bad in ("tests.agent_fakes", "tests.agent_fakes:nope", "no_such_module:f"):
        with pytest.raises(ToolError, match="tool"):
            load_tool(bad)


# -- trajectory -------------------------------------------------------------------------


def request(max_tokens: int = 20, seed: int | None = 7) -> GenRequest:
    return GenRequest("s1-p0-r0", (5, 6), max_tokens, seed=seed, prompt_uid="u")


def test_trajectory_context_mask_and_turn_requests() -> None:
    t = Trajectory(request(), max_turns=3)
    first = t.next_request()
    assert (first.request_id, first.prompt_token_ids, first.max_tokens, first.seed,
            first.affinity) == ("s1-p0-r0-t1", (5, 6), 20, 7, "s1-p0-r0")
    t.sampled((10, 11), (-0.1, -0.2), "ab")
    assert t.end_turn(FinishReason.STOP) and t.phase is TrajectoryPhase.ACTING
    t.acted(EnvStep(tools=ToolUse(calls=2, failures=1, seconds=0.5)))
    assert t.observe((90, 91, 92)) == (90, 91, 92)
    second = t.next_request()
    assert second.prompt_token_ids == (5, 6, 10, 11, 90, 91, 92) and second.max_tokens == 15
    assert second.seed == 7 * 1_000_003 + 2 and second.request_id == "s1-p0-r0-t2"
    t.sampled((12,), (-0.3,))
    assert t.mask == [1, 1, 0, 0, 0, 1] and t.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert t.end_turn(FinishReason.STOP)
    t.acted(EnvStep(done=True, reward=0.5))
    assert t.finished and t.reason is FinishReason.STOP
    assert t.stats().turns == 2 and t.stats().tools.failures == 1 and t.stats().env_reward == 0.5
    assert t.stats().tools.calls == 2 and t.stats().tools.seconds == 0.5


def test_tool_use_adds_up_field_by_field() -> None:
    a, b = ToolUse(1, 0, 0.5, 0.25, 0.125), ToolUse(2, 1, 1.0, 0.0, 0.5)
    assert a + b == ToolUse(calls=3, failures=1, seconds=1.5, queued_s=0.25, exposed_s=0.625)
    assert a + ToolUse() == a and EnvStep().tools == ToolUse()


def test_trajectory_stops_at_max_turns_and_budget() -> None:
    t = Trajectory(request(), max_turns=1)
    t.next_request()
    t.sampled((1,), (0.0,))
    assert not t.end_turn(FinishReason.STOP) and t.reason is FinishReason.STOP
    # an observation past the budget is cut and ends the trajectory on LENGTH
    t = Trajectory(request(max_tokens=5), max_turns=4)
    t.next_request()
    t.sampled((1, 2), (0.0, 0.0))
    assert t.end_turn(FinishReason.STOP)
    t.acted(EnvStep())
    assert t.observe((7, 8, 9, 10)) == (7, 8, 9)
    assert t.reason is FinishReason.LENGTH and t.mask == [1, 1, 0, 0, 0]
    # a turn that ran out of budget
    t = Trajectory(request(max_tokens=5), max_turns=4)
    t.next_request()
    t.sampled((1,) * 5, (0.0,) * 5)
    assert not t.end_turn(FinishReason.LENGTH) and t.reason is FinishReason.LENGTH


def test_trajectory_refuses_calls_out_of_phase() -> None:
    t = Trajectory(request(seed=None), max_turns=2)
    with pytest.raises(IllegalTransition):
        t.sampled((1,), (0.0,))
    assert t.next_request().seed is None
    with pytest.raises(IllegalTransition):
        t.next_request()
    with pytest.raises(IllegalTransition):
        t.observe((1,))


# -- template ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TinySpec())


def test_observation_is_the_templates_suffix_after_the_turns_end(tokenizer) -> None:
    enc = ObservationEncoder(tokenizer)
    obs = [{"role": "tool", "name": "add", "content": "579"}]
    got = enc.encode(obs)
    assert got.text == "\n<|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n"
    assert got.token_ids == tuple(tokenizer(got.text, add_special_tokens=False)["input_ids"])
    # sampled turn + observation = what the template renders for the whole conversation
    turn = tokenizer("I call add", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    whole = tokenizer.apply_chat_template(
        [{"role": "assistant", "content": "I call add"}, *obs], tokenize=False,
        add_generation_prompt=True)
    assert "<|im_start|>assistant\n" + tokenizer.decode(turn + list(got.token_ids)) == whole
    assert enc.ends_turn(tokenizer.eos_token_id) and not enc.ends_turn(5)
    # a turn that did not end on <|im_end|> is closed by the observation
    assert enc.encode(obs, closed=False).text.startswith("<|im_end|>\n<|im_start|>tool")


def test_template_that_rewrites_history_is_refused_in_one_line(tokenizer) -> None:
    class Rewriting:
        eos_token = "<|im_end|>"
        name_or_path = "rewriting-template"

        def convert_tokens_to_ids(self, token):
            return 2

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            # drops an assistant turn's text once anything follows it (as Qwen3 drops
            # earlier <think> blocks)
            out = []
            for i, m in enumerate(messages):
                content = "" if m["role"] == "assistant" and i < len(messages) - 1 else m["content"]
                out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
            return "".join(out) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    with pytest.raises(TemplateError, match="rewriting-template.*does not keep an assistant turn"):
        ObservationEncoder(Rewriting())

    class Counting(Rewriting):
        name_or_path = "counting-template"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
            # numbers each tool result by the characters before it: history-dependent
            out = ""
            for m in messages:
                body = m["content"] if m["role"] != "tool" else f"#{len(out)} {m['content']}"
                out += f"<|im_start|>{m['role']}\n{body}<|im_end|>\n"
            return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    with pytest.raises(TemplateError, match="counting-template.*differently depending on"):
        ObservationEncoder(Counting())


def test_qwen3_style_template_merges_a_steps_tool_results(tokenizer) -> None:
    """A Qwen3-style template (vLLM ships one for MiniCPM-V 4.5): the last assistant turn
    renders with a thinking block, earlier ones without (which the encoder tolerates: it
    never re-renders sampled turns), and consecutive tool results share one user turn."""
    from pathlib import Path

    vllm = pytest.importorskip("vllm")
    path = Path(vllm.__file__).parent / "transformers_utils/chat_templates/template_minicpmv45.jinja"
    if not path.is_file():
        pytest.skip(f"{path} is not in this vLLM")
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = path.read_text()
    enc = ObservationEncoder(tok, tools=[load_tool("calculator").schema], name="minicpmv45")
    got = enc.encode([{"role": "tool", "content": "4"}, {"role": "tool", "content": "9"}])
    assert got.text == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n"
                        "9\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_python_tool_runs_in_the_code_sandbox() -> None:
    from rpk.reward.sandbox import SandboxUnavailable

    tool = load_tool("python")
    try:
        run(tool.ready())
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    r = ToolRunner([tool], timeout_s=30)
    assert run(r.run(ToolCall("python", {"code": "print(6 * 7)"}))).text == "42\n"
    boom = run(r.run(ToolCall("python", {"code": "raise ValueError('boom')"})))
    assert boom.failed and boom.text.endswith("ValueError: boom")


def test_python_tool_shares_the_runs_code_sandbox_and_its_timeout() -> None:
    from rpk.reward.code import CodeScorer, SandboxSettings
    from rpk.reward.sandbox import SandboxUnavailable

    code = CodeScorer(SandboxSettings(timeout_min_s=0.5, timeout_max_s=0.5))
    tool = load_tool("python", code=code)
    assert tool.ready == code.sandbox.probe  # one sandbox: its slots and its probe
    try:
        run(tool.ready())
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")
    slow = run(ToolRunner([tool], timeout_s=30).run(
        ToolCall("python", {"code": "import time\ntime.sleep(5)"})))
    assert slow.failed and "timeout" in slow.text
