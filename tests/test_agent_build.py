"""A multi-turn run as `rpk.assembly` assembles it from config: a user's own tool
(`module:function`, its schema from a config file or its docstring), rows in veRL's
multi-turn layout with hidden per-row tool arguments, and the wrap of the rollout
engine; and the config's refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rpk import assembly
from rpk.agent.engine import AgentEngine
from rpk.agent.parse import ToolCall, format_tool_call
from rpk.agent.tools import Tool
from rpk.config import AgentConfig, Config, ConfigError, DataConfig, RewardConfig, TinySpec, from_argv
from rpk.core.outcomes import RoundPlan
from rpk.core.records import FinishReason, Prompt, Response, RoundKind, ToolUse, TurnStats
from rpk.loop.rollout import run_round
from rpk.reward.functions import reward_extra_info
from rpk.tasks import task
from rpk.tasks.tiny import build_tokenizer
from tests.agent_fakes import TurnEngine, turn_of
from tests.fakes import LengthScorer, mean_centred


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny tokenizer and its chat template (no weights needed)."""
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(TinySpec()).save_pretrained(path)
    return path


def rows_file(tmp_path: Path) -> Path:
    rows = [{
        "prompt": [{"role": "user", "content": f"What do {n} figs cost?"}],
        "data_source": "shop",
        "reward_model": {"style": "rule", "ground_truth": f"{1.25 * n * 1.1:.2f} USD"},
        "agent_name": "tool_agent",
        "extra_info": {"need_tools_kwargs": True,
                       "tools_kwargs": {"price": {"execute_kwargs": {"currency": "USD"}}}},
    } for n in (2, 3)]
    path = tmp_path / "shop.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("schema_file", [False, True])
async def test_users_tool_runs_through_builds_loading_path(model_dir, tmp_path, schema_file) -> None:
    agent = {"tools": ("tests.user_tools:price",)}
    if schema_file:
        schemas = tmp_path / "tools.json"
        schemas.write_text(json.dumps([{"type": "function", "function": {
            "name": "price", "description": "what fruit costs",
            "parameters": {"type": "object", "properties": {
                "item": {"type": "string"}, "quantity": {"type": "integer"}},
                "required": ["item", "quantity"]}}}]))
        agent["tool_schemas"] = str(schemas)
    cfg = Config(data=DataConfig(train_files=(str(rows_file(tmp_path)),)), agent=AgentConfig(**agent))
    assert cfg.multi_turn
    tools = assembly.agent_tools(cfg.agent, task(cfg.data.task))
    (schema,) = assembly.tool_schemas(tools)
    assert schema["function"]["name"] == "price"
    assert ("description" in schema["function"]["parameters"]["properties"]["item"]) != schema_file
    prompts = assembly.load_prompts(assembly.prompt_source(cfg), model_dir, tools)
    setup = assembly.build_agent(cfg.agent, cfg.rollout.max_turns, model_dir, prompts, tools)
    await setup.ready()

    tok = assembly.inputs._tokenizer(model_dir)

    def reply(req):
        n = 2 if req.prompt_uid.endswith("row 1") or req.prompt_uid.endswith("line 1") else 3
        if turn_of(req) == 1:
            return format_tool_call(ToolCall("price", {"item": "fig", "quantity": n}))
        return "That is the price."

    inner = TurnEngine(reply, lambda t: tok(t, add_special_tokens=False)["input_ids"])
    engine = setup.wrap(inner)
    assert isinstance(engine, AgentEngine) and engine.max_turns == cfg.rollout.max_turns
    plan = RoundPlan(1, RoundKind.SYNC, tuple(prompts), 2, 2, 2, 200)
    result = await run_round(plan, engine, LengthScorer(10**6), mean_centred, version=0)
    for g in result.groups:
        for m in g.members:
            # the row's hidden currency reached the call; the model never wrote it
            assert f"<|im_start|>tool\n{g.prompt.ground_truth}<|im_end|>" in m.response.text
            assert m.response.turns is not None and m.response.turns.tools.failures == 0


def test_single_turn_runs_have_no_tools() -> None:
    assert not Config().multi_turn  # start_parts builds no agent for it
    assert assembly.tool_schemas(assembly.agent_tools(AgentConfig(), task("arith"))) == []


def test_bad_tools_and_envs_fail_before_anything_starts(model_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match="agent.tools.*cannot import"):
        assembly.agent_tools(AgentConfig(tools=("tests.user_tools:nope",)), task("arith"))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ConfigError, match="tool_schemas"):
        assembly.agent_tools(AgentConfig(tools=("calculator",), tool_schemas=str(bad_json)), task("arith"))
    with pytest.raises(ConfigError, match="agent.env.*cannot import"):
        assembly.build_agent(AgentConfig(env="tests.user_tools:Nope"), 8, model_dir, [], [])
    with pytest.raises(ConfigError, match="rollout.policy partial with a multi-turn task"):
        from_argv(["--agent.tools", "calculator", "--rollout.policy", "partial"])
    with pytest.raises(ConfigError, match="agent.env"):
        from_argv(["--agent.tools", "calculator", "--agent.env", "m:C"])


async def test_a_tool_that_cannot_run_here_stops_the_build_in_one_line(model_dir) -> None:
    async def broken() -> None:
        raise RuntimeError("no sandbox")

    calculator = AgentConfig(tools=("calculator",))
    setup = assembly.build_agent(calculator, 8, model_dir, [], assembly.agent_tools(calculator, task("arith")))
    bad = assembly.AgentSetup((Tool("python", {}, print, ready=broken),), setup.env, setup.encoder,
                           {}, 2, None)
    with pytest.raises(ConfigError, match="agent.tools tool 'python' cannot run here: no sandbox"):
        await bad.ready()


@pytest.mark.parametrize("backend", ["thread", "process"])
async def test_reward_functions_see_the_trajectorys_turns_and_env_reward(backend) -> None:
    """`rpk.agent.env:env_reward` makes an environment's reward the trajectory's; any
    reward function finds the turn counts in extra_info."""
    prompt = Prompt("u", (1,), "guess", "7", extra_info={"level": 2})
    cfg = Config(reward=RewardConfig(function="rpk.agent.env:env_reward", backend=backend))
    scorer = assembly.build_scorer(cfg.reward, assembly.run_judge_settings(cfg), [prompt], cfg.rollout.max_tokens)
    try:
        done = Response(prompt, 0, (5, 6), (0.0, 0.0), FinishReason.STOP, 0,
                        turns=TurnStats(3, ToolUse(calls=2), env_reward=0.75))
        assert (await scorer.score(done)).reward == 0.75
        cut = dataclasses.replace(done, turns=TurnStats(8))
        assert (await scorer.score(cut)).reward == 0.0
    finally:
        await scorer.aclose()
    assert reward_extra_info(done) == {"level": 2, "num_turns": 3, "tool_calls": 2,
                                       "tool_failures": 0, "env_reward": 0.75}
    assert reward_extra_info(dataclasses.replace(done, turns=None)) == {"level": 2}


def test_a_checkpoint_of_one_built_in_task_does_not_resume_another() -> None:
    from rpk.assembly.settings import fingerprint

    arith = fingerprint(Config())
    assert arith["data.train_files"] == "built-in task, 4096 prompts"  # as before data.task
    assert fingerprint(Config(data=DataConfig(task="tool_add")))["data.train_files"] != arith["data.train_files"]
