"""What a run is made from, checked before anything starts: where its parts go
(`place`), its model (a path, a Hub id or rpk's tiny model), its prompts (the task's
built-in rows, `rpk.tasks.TASKS`, or the config's files: `PromptSource`), and a
multi-turn run's tools and agent parts. Cheap or blocking-but-quick; nothing here
starts an engine. Each builder takes its own config section, or the record
`rpk.assembly.settings` makes of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpk import hub
from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvError, EnvFactory, load_env, tool_env_factory
from rpk.agent.template import ObservationEncoder, TemplateError
from rpk.agent.tools import Tool, ToolError, ToolRunner, load_schemas, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.assembly.settings import PromptSource, reward_settings, task_tool_latency, uses_task_tools
from rpk.cluster.nodes import check_nodes
from rpk.config import ConfigError
from rpk.config.execution import RolloutConfig
from rpk.config.inputs import AgentConfig, ModelConfig, RewardConfig
from rpk.core.modes import TransferChoice
from rpk.core.protocols import Engine
from rpk.core.records import Prompt
from rpk.data import load_files, numbered, to_prompts
from rpk.engine.placement import FleetPlan, PlacementError, fleet_plan
from rpk.gpu.layout import ParallelLayout
from rpk.reward.code import CodeScorer
from rpk.sched.toolwait import LatencyDraws
from rpk.tasks import Task, tiny_build
from rpk.tasks.tiny import build_tiny_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the run's parts go, worked out once from the config and this process's
    layout, and passed on: the rollout's devices and layouts (`fleet`), the nodes that
    run replicas, and the layout itself (None: one process, as the tests build)."""

    fleet: FleetPlan
    engine_nodes: tuple[int, ...] = (0,)
    layout: ParallelLayout | None = None


def place(rollout: RolloutConfig, layout: ParallelLayout | None = None) -> Placement:
    """The run's placement, checked: choices that make no layouts, or engine nodes that
    do not fit the run, are config errors naming the field."""
    r = rollout
    try:
        fleet = fleet_plan(r.devices, r.tp_sizes, r.tp_size, r.tp == "elastic")
    except PlacementError as e:
        name = "tp_size" if e.field == "tp" else e.field
        raise ConfigError(f"{getattr(r, name)!r}: {e}", f"rollout.{name}") from None
    if r.weight_transfer == TransferChoice.M2N:
        check_m2n(layout)
    if layout is None:
        return Placement(fleet)
    return Placement(fleet, check_engine_nodes(rollout, layout), layout)


def check_m2n(layout: ParallelLayout | None) -> None:
    """`rollout.weight_transfer m2n` sends each trainer rank's own shards: it needs a
    sharded trainer."""
    if layout is None or not layout.distributed:
        raise ConfigError("'m2n' sends each trainer rank's own shards and needs a sharded trainer "
                          "(dist.nproc > 1, or torchrun); this run has one process",
                          "rollout.weight_transfer")


def check_engine_nodes(rollout: RolloutConfig, layout: ParallelLayout) -> tuple[int, ...]:
    """The nodes that run rollout replicas, checked."""
    return check_nodes(layout.engine_nodes, layout.nnodes, rollout.tp_switch, rollout.weight_transfer)


def resolve_model(model: ModelConfig, builtin: Task, log: Log) -> Path:
    """`model.path`, checked, or the tiny model `builtin` trains (built on a cache miss).
    Blocking."""
    if model.path is not None:
        if hub.is_hub_id(model.path):
            log(f"model {model.path}: from the Hugging Face Hub (cache: {model.hub_cache or 'HF_HOME'})")
            return hub.fetch(model.path, model.hub_cache)
        path = Path(model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path={model.path!r}: no HF model (config.json) there")
        return path
    return build_tiny_model(builtin.tiny_spec(model), Path(model.cache_dir), log=log,
                            recipe=builtin.tiny_recipe())


async def run_model(model: ModelConfig, builtin: Task, log: Log) -> Path:
    """`resolve_model` for a run: the tiny model is built in a child process, which a
    signal stops at once (`rpk.tasks.tiny_build`)."""
    if model.path is not None:
        return await asyncio.to_thread(resolve_model, model, builtin, log)
    return await tiny_build.build(builtin.tiny_spec(model), Path(model.cache_dir), log, builtin.tiny_recipe())


def model_config_dir(model: ModelConfig) -> Path:
    """Where `model.path`'s config.json is, fetching nothing else (a dry run)."""
    if model.path is not None and hub.is_hub_id(model.path):
        return hub.fetch(model.path, model.hub_cache, config_only=True)
    path = Path(model.path or "")
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path={model.path!r}: no HF model (config.json) there")
    return path


def _tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def builtin_rows(source: PromptSource) -> list[dict[str, Any]]:
    """The built-in task's training rows (veRL layout)."""
    # Offset from the warm-up's seed so RL prompts are fresh draws, not the SFT set.
    judged = {"judged_frac": source.data.judged_frac} if source.task.judged else {}
    return source.task.module().make_rows(source.data.builtin_size, seed=10_000 + source.seed,
                                          spec=source.problems, **judged)


def load_prompts(source: PromptSource, model_dir: Path, tools: Sequence[Tool] = ()) -> list[Prompt]:
    """The training prompts, tokenised with the model's chat template (and a multi-turn
    run's tool schemas, which templates render into the system turn). Blocking."""
    d, tokenizer, schemas = source.data, _tokenizer(model_dir), tool_schemas(tools)
    if d.train_files:
        return load_files(d.train_files, tokenizer, d.max_prompt_tokens, schemas)
    return to_prompts(numbered(builtin_rows(source)), f"builtin:rpk/{source.task.name}", tokenizer,
                      d.max_prompt_tokens, schemas)


def load_val_prompts(source: PromptSource, model_dir: Path, tools: Sequence[Tool] = ()) -> list[Prompt]:
    """The validation prompts: `data.val_files`, else the built-in task's held-out split
    (none equal to a training prompt), else none; rendered with `tools`' schemas as
    `load_prompts` renders them. Blocking."""
    d = source.data
    if not d.val_files and (d.train_files or not d.val_size):
        return []
    schemas = tool_schemas(tools)
    if d.val_files:
        return load_files(d.val_files, _tokenizer(model_dir), d.max_prompt_tokens, schemas)
    try:
        rows = source.task.module().held_out_rows(
            d.val_size, seed=20_000 + source.seed, exclude=builtin_rows(source), spec=source.problems
        )
    except ValueError as e:
        raise ConfigError(f"data.val_size={d.val_size}: {e}; lower it or set it to 0") from None
    return to_prompts(numbered(rows), f"builtin-val:rpk/{source.task.name}", _tokenizer(model_dir),
                      d.max_prompt_tokens, schemas)


def agent_tools(agent: AgentConfig, builtin: Task, code: CodeScorer | None = None) -> list[Tool]:
    """A multi-turn run's tools: `agent.tools`, else the built-in task's; checked (each
    imports, each has a schema) before anything slow starts. `code`: the run's code
    sandbox (`code_sandbox`), which the python tool shares."""
    try:
        schemas = load_schemas(agent.tool_schemas) if agent.tool_schemas else {}
        if agent.tools:
            return [load_tool(spec, schemas, code) for spec in agent.tools]
    except ToolError as e:
        raise ConfigError(str(e), "agent.tools") from None
    if not uses_task_tools(agent, builtin):
        return []
    rows = builtin.module()
    tools = [load_tool(spec, rows.TOOL_SCHEMAS) for spec in rows.TOOLS]
    model = task_tool_latency(agent, builtin)
    if model is None:
        return tools
    # The task's tools answer after the modelled latency, as remote tools would.
    draws = LatencyDraws(model)
    return [dataclasses.replace(t, fn=functools.partial(t.fn, latency=draws)) for t in tools]


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [dict(t.schema) for t in tools]


def code_sandbox(reward: RewardConfig) -> CodeScorer:
    """The run's one code sandbox (`reward.sandbox`): code rewards score on it and the
    agent's python tool runs on it, so they share its slots, limits and timeout."""
    return CodeScorer(reward_settings(reward).sandbox)


@dataclass(frozen=True, slots=True)
class AgentSetup:
    """A multi-turn run's parts, checked: what answers the turns (`env`, one per
    trajectory), the observation encoder, and the rows a request may answer (training
    and validation, by uid)."""

    tools: tuple[Tool, ...]
    env: EnvFactory
    encoder: ObservationEncoder
    prompts: Mapping[str, Prompt]
    max_turns: int
    step_timeout_s: float | None  # an environment's step; a ToolEnv bounds each call itself

    async def ready(self) -> None:
        """Every tool's own start-up check (the python tool probes its sandbox)."""
        for tool in self.tools:
            if tool.ready is not None:
                try:
                    await tool.ready()
                except Exception as e:
                    raise ConfigError(f"tool {tool.name!r} cannot run here: {e}", "agent.tools") from None

    def wrap(self, inner: Engine, log: Log | None = None) -> AgentEngine:
        """The rollout engine the loop drives: each request a trajectory on `inner`;
        failing environment steps said in `log`."""
        return AgentEngine(inner, self.env, self.encoder, self.prompts, self.max_turns,
                           self.step_timeout_s, log=log)


def build_agent(
    agent: AgentConfig, max_turns: int, model_dir: Path, prompts: Sequence[Prompt], tools: Sequence[Tool],
) -> AgentSetup:
    """A multi-turn run's parts (`Config.multi_turn`): what makes each request a
    trajectory (`rpk.agent`), answered by `agent.env` or by a `ToolEnv` over `tools`,
    its observations encoded with the model's chat template, at most `max_turns` model
    turns each (`rollout.max_turns`). Blocking (it loads the tokenizer)."""
    if agent.env is not None:
        try:
            env = load_env(agent.env)
        except EnvError as e:
            raise ConfigError(str(e)) from None
    elif tools:
        runner = ToolRunner(tools, agent.tool_timeout_s, agent.max_tool_output_chars,
                            workers=ToolWorkers(agent.tool_workers))
        env = tool_env_factory(runner, agent.max_parallel_calls)
    else:
        raise ConfigError("a multi-turn run with no tools: set agent.tools or agent.env")
    try:
        encoder = ObservationEncoder(_tokenizer(model_dir), [t.schema for t in tools], str(model_dir))
    except TemplateError as e:
        raise ConfigError(f"model {model_dir}: {e}") from None
    return AgentSetup(tuple(tools), env, encoder, {p.uid: p for p in prompts}, max_turns,
                      agent.tool_timeout_s if agent.env is not None else None)


def describe_val(prompts: list[Prompt], val_prompts: list[Prompt]) -> str:
    if not val_prompts:
        return "no validation"
    trained = {p.token_ids for p in prompts}
    shared = sum(1 for p in val_prompts if p.token_ids in trained)
    return f"{len(val_prompts)} validation prompts" + (
        f" ({shared} of them also training prompts)" if shared else ""
    )
