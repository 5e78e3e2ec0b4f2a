"""What a run is made from, checked before anything starts: where its parts go
(`place`), its model (a path, a Hub id or rpk's tiny model), its prompts (the task's
built-in rows, `rpk.tasks.TASKS`, or the config's files), and a multi-turn run's tools
and agent parts. Cheap or blocking-but-quick; nothing here starts an engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvError, EnvFactory, load_env, tool_env_factory
from rpk.agent.template import ObservationEncoder, TemplateError
from rpk.agent.tools import Tool, ToolError, ToolRunner, load_schemas, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.assembly.settings import reward_settings
from rpk.config import Config, ConfigError, TinySpec
from rpk.core.modes import TransferChoice
from rpk.core.protocols import Engine
from rpk.core.records import Prompt
from rpk.data import load_files, numbered, to_prompts
from rpk.engine.placement import FleetPlan, PlacementError, fleet_plan
from rpk.gpu.layout import ParallelLayout
from rpk.loop.evaluate import EvalSpec
from rpk.reward.code import CodeScorer
from rpk.sched.toolwait import LatencyDraws, LatencyModel
from rpk.tasks import task

Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the run's parts go, worked out once from the config and this process's
    layout, and passed on: the rollout's devices and layouts (`fleet`), the nodes that
    run replicas, and the layout itself (None: one process, as the tests build)."""

    fleet: FleetPlan
    engine_nodes: tuple[int, ...] = (0,)
    layout: ParallelLayout | None = None


def place(cfg: Config, layout: ParallelLayout | None = None) -> Placement:
    """The run's placement, checked: choices that make no layouts, or engine nodes that
    do not fit the run, are config errors naming the field."""
    r = cfg.rollout
    try:
        fleet = fleet_plan(r.devices, r.tp_sizes, r.tp_size, r.tp == "elastic")
    except PlacementError as e:
        name = "tp_size" if e.field == "tp" else e.field
        raise ConfigError(f"{getattr(r, name)!r}: {e}", f"rollout.{name}") from None
    if r.weight_transfer == TransferChoice.M2N:
        check_m2n(layout)
    if layout is None:
        return Placement(fleet)
    return Placement(fleet, check_engine_nodes(cfg, layout), layout)


def check_m2n(layout: ParallelLayout | None) -> None:
    """`rollout.weight_transfer m2n` sends each trainer rank's own shards: it needs a
    sharded trainer."""
    if layout is None or not layout.distributed:
        raise ConfigError("'m2n' sends each trainer rank's own shards and needs a sharded trainer "
                          "(dist.nproc > 1, or torchrun); this run has one process",
                          "rollout.weight_transfer")


def check_engine_nodes(cfg: Config, layout: ParallelLayout) -> tuple[int, ...]:
    """The nodes that run rollout replicas, checked."""
    from rpk.cluster.nodes import check_nodes

    r = cfg.rollout
    return check_nodes(layout.engine_nodes, layout.nnodes, r.tp_switch, r.weight_transfer)


def resolve_model(cfg: Config, log: Log) -> Path:
    """`model.path`, checked, or rpk's tiny model (built on a cache miss). Blocking."""
    if cfg.model.path is not None:
        from rpk import hub

        if hub.is_hub_id(cfg.model.path):
            log(f"model {cfg.model.path}: from the Hugging Face Hub (cache: {cfg.model.hub_cache or 'HF_HOME'})")
            return hub.fetch(cfg.model.path, cfg.model.hub_cache)
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path={cfg.model.path!r}: no HF model (config.json) there")
        return path
    from rpk.tasks.tiny import build_tiny_model

    return build_tiny_model(tiny_spec(cfg), Path(cfg.model.cache_dir), log=log,
                            recipe=task(cfg.data.task).tiny_recipe())


async def run_model(cfg: Config, log: Log) -> Path:
    """`resolve_model` for a run: the tiny model is built in a child process, which a
    signal stops at once (`rpk.tasks.tiny_build`)."""
    if cfg.model.path is not None:
        return await asyncio.to_thread(resolve_model, cfg, log)
    from rpk.tasks import tiny_build

    return await tiny_build.build(tiny_spec(cfg), Path(cfg.model.cache_dir), log,
                                  task(cfg.data.task).tiny_recipe())


def tiny_spec(cfg: Config) -> TinySpec:
    """The spec of the tiny model `data.task` trains (and whose problems it draws)."""
    return task(cfg.data.task).tiny_spec(cfg.model)


def model_config_dir(cfg: Config) -> Path:
    """Where `model.path`'s config.json is, fetching nothing else (a dry run)."""
    from rpk import hub

    if cfg.model.path is not None and hub.is_hub_id(cfg.model.path):
        return hub.fetch(cfg.model.path, cfg.model.hub_cache, config_only=True)
    path = Path(cfg.model.path or "")
    if not (path / "config.json").exists():
        raise ConfigError(f"model.path={cfg.model.path!r}: no HF model (config.json) there")
    return path


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def builtin_rows(cfg: Config) -> list[dict[str, Any]]:
    """The built-in task's training rows (veRL layout)."""
    # Offset from the warm-up's seed so RL prompts are fresh draws, not the SFT set.
    return task(cfg.data.task).module().make_rows(
        cfg.data.builtin_size, seed=10_000 + cfg.run.seed, spec=tiny_spec(cfg).task)


def load_prompts(cfg: Config, model_dir: Path, tools: Sequence[Tool] | None = None) -> list[Prompt]:
    """The training prompts, tokenised with the model's chat template (and a multi-turn
    run's tool schemas, which templates render into the system turn; `tools`: the run's,
    None loads them). Blocking."""
    tokenizer = _tokenizer(model_dir)
    schemas = tool_schemas(agent_tools(cfg) if tools is None else tools)
    if cfg.data.train_files:
        return load_files(cfg.data.train_files, tokenizer, cfg.data.max_prompt_tokens, schemas)
    return to_prompts(numbered(builtin_rows(cfg)), f"builtin:rpk/{cfg.data.task}", tokenizer,
                      cfg.data.max_prompt_tokens, schemas)


def load_val_prompts(cfg: Config, model_dir: Path, tools: Sequence[Tool] | None = None) -> list[Prompt]:
    """The validation prompts: `data.val_files`, else the built-in task's held-out split
    (none equal to a training prompt), else none; rendered with `tools`' schemas as
    `load_prompts` renders them. Blocking."""
    d = cfg.data
    if not d.val_files and (d.train_files or not d.val_size):
        return []
    schemas = tool_schemas(agent_tools(cfg) if tools is None else tools)
    if d.val_files:
        return load_files(d.val_files, _tokenizer(model_dir), d.max_prompt_tokens, schemas)
    try:
        rows = task(d.task).module().held_out_rows(
            d.val_size, seed=20_000 + cfg.run.seed, exclude=builtin_rows(cfg), spec=tiny_spec(cfg).task
        )
    except ValueError as e:
        raise ConfigError(f"data.val_size={d.val_size}: {e}; lower it or set it to 0") from None
    return to_prompts(numbered(rows), f"builtin-val:rpk/{d.task}", _tokenizer(model_dir),
                      d.max_prompt_tokens, schemas)


def agent_tools(cfg: Config, code: CodeScorer | None = None) -> list[Tool]:
    """A multi-turn run's tools: `agent.tools`, else the built-in task's; checked (each
    imports, each has a schema) before anything slow starts. `code`: the run's code
    sandbox (`code_sandbox`), which the python tool shares."""
    a = cfg.agent
    try:
        schemas = load_schemas(a.tool_schemas) if a.tool_schemas else {}
        if a.tools:
            return [load_tool(spec, schemas, code) for spec in a.tools]
    except ToolError as e:
        raise ConfigError(str(e), "agent.tools") from None
    if not uses_task_tools(cfg):
        return []
    rows = task(cfg.data.task).module()
    tools = [load_tool(spec, rows.TOOL_SCHEMAS) for spec in rows.TOOLS]
    model = task_tool_latency(cfg)
    if model is None:
        return tools
    # The task's tools answer after the modelled latency, as remote tools would.
    draws = LatencyDraws(model)
    return [dataclasses.replace(t, fn=functools.partial(t.fn, latency=draws)) for t in tools]


def uses_task_tools(cfg: Config) -> bool:
    """The run's tools are the built-in task's: a multi-turn task, and neither
    `agent.tools` nor `agent.env` set."""
    a = cfg.agent
    return not a.tools and a.env is None and task(cfg.data.task).multi_turn


def task_tool_latency(cfg: Config) -> LatencyModel | None:
    """The latency the built-in task's tool answers after (`agent.tool_latency`), which
    length_aware's provisioning prices too; None where the run's tools are not the
    task's (their latency is learnt from the rounds) or `median_s` is 0 (they answer
    at once)."""
    lat = cfg.agent.tool_latency
    if not uses_task_tools(cfg) or lat.median_s == 0:
        return None
    return LatencyModel(lat.median_s, lat.p99_s, lat.timeout_frac)


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [dict(t.schema) for t in tools]


def code_sandbox(cfg: Config) -> CodeScorer:
    """The run's one code sandbox (`reward.sandbox`): code rewards score on it and the
    agent's python tool runs on it, so they share its slots, limits and timeout."""
    return CodeScorer(reward_settings(cfg).sandbox)


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
    cfg: Config, model_dir: Path, prompts: Sequence[Prompt], tools: Sequence[Tool] | None = None,
) -> AgentSetup | None:
    """For a multi-turn run (`Config.multi_turn`): the parts that make each request a
    trajectory (`rpk.agent`), answered by `agent.env` or by a `ToolEnv` over `tools`
    (None loads them), its observations encoded with the model's chat template. None for
    a single-turn run. Blocking (it loads the tokenizer)."""
    if not cfg.multi_turn:
        return None
    a = cfg.agent
    tools = agent_tools(cfg) if tools is None else list(tools)
    if a.env is not None:
        try:
            env = load_env(a.env)
        except EnvError as e:
            raise ConfigError(str(e)) from None
    elif tools:
        runner = ToolRunner(tools, a.tool_timeout_s, a.max_tool_output_chars,
                            workers=ToolWorkers(a.tool_workers))
        env = tool_env_factory(runner, a.max_parallel_calls)
    else:
        raise ConfigError(f"data.task {cfg.data.task!r} has no tools; set agent.tools or agent.env")
    try:
        encoder = ObservationEncoder(_tokenizer(model_dir), [t.schema for t in tools], str(model_dir))
    except TemplateError as e:
        raise ConfigError(f"model {model_dir}: {e}") from None
    return AgentSetup(tuple(tools), env, encoder, {p.uid: p for p in prompts}, cfg.rollout.max_turns,
                      a.tool_timeout_s if a.env is not None else None)


def eval_spec(cfg: Config) -> EvalSpec:
    r = cfg.rollout
    return EvalSpec(
        k=cfg.run.eval_k, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
        seed=cfg.run.seed,
    )


def describe_val(prompts: list[Prompt], val_prompts: list[Prompt]) -> str:
    if not val_prompts:
        return "no validation"
    trained = {p.token_ids for p in prompts}
    shared = sum(1 for p in val_prompts if p.token_ids in trained)
    return f"{len(val_prompts)} validation prompts" + (
        f" ({shared} of them also training prompts)" if shared else ""
    )
