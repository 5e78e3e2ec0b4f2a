"""Config -> components, in one place: the model directory, the prompts, the round
policy, the reward scorer, the rollout engine and the trainer. `rpk.run` hands them to
`rpk.controller`, which never calls back here; the benchmarks build the same pieces
through these functions.

Each builder takes the whole `Config` and reads its own sections; besides them only
`rpk.settings` (the records of the parts that take no config) copies config fields. The
cheap checks (config against data, reward functions, tools) run first; then what the
started parts are made from is worked out once (`plan_parts`: the box, the placement,
the context length, vLLM's settings, ...), and the slow starts (vLLM, the trainer's
model) take it from that plan.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Sequence

from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvError, EnvFactory, load_env, tool_env_factory
from rpk.agent.latency import LatencyModel
from rpk.agent.template import ObservationEncoder, TemplateError
from rpk.agent.tools import Tool, ToolError, ToolRunner, load_schemas, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.checkpoint import ResumePoint
from rpk.config import MULTI_TURN_TASKS, Config, ConfigError, TinySpec
from rpk.core.protocols import Engine, Lending, Resting
from rpk.core.records import Prompt
from rpk.data import load_files, numbered, to_prompts
from rpk.engine.fleet import Fleet
from rpk.engine.placement import FleetPlan, PlacementError, fleet_plan, replica_devices
from rpk.gpu.box import Box, Colocation, box_for, colocation
from rpk.gpu.layout import ParallelLayout
from rpk.loop.elastic import RolloutTP
from rpk.loop.evaluate import EvalSpec
from rpk.loop.feed import StreamMode, Streaming, can_borrow
from rpk.loop.trainer import AsyncTrainer
from rpk.reward import RewardStack, make_scorer, resolve
from rpk.reward.judge import JudgeScorer, check_template, is_judged
from rpk.reward.judge_vllm import VLLMJudge, VLLMRewardModel, with_judge
from rpk.reward.stack import judged_stack
from rpk.reward import remote
from rpk.sched.borrow import BorrowRule
from rpk.sched.policy import Policy, PolicyOptions, Sampling, make_policy
from rpk.sched.provision import EtaBounds
from rpk.sched.tp_planner import PlannerConfig, PlannerMode, TPPlanner
from rpk.settings import judge_settings, lora_settings, reward_settings, trainer_settings
from rpk.tasks import arith
from rpk.train.losses import advantage_fn

if TYPE_CHECKING:
    from rpk.cluster.remote import HostClient

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
    if r.weight_transfer == "m2n":
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
    if cfg.data.task == "tool_add":
        from rpk.tasks.tiny_multi import build_tool_add_model

        return build_tool_add_model(tiny_spec(cfg), Path(cfg.model.cache_dir), log=log)
    from rpk.tasks.tiny import build_tiny_model

    return build_tiny_model(cfg.model.tiny, Path(cfg.model.cache_dir), log=log)


def tiny_spec(cfg: Config) -> TinySpec:
    """The spec of the tiny model `data.task` trains (and whose problems it draws)."""
    return cfg.model.tiny_tool_add if cfg.data.task == "tool_add" else cfg.model.tiny


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


def task_module(task: str) -> Any:
    """The built-in task `data.task` names: a module with `make_rows` and `held_out_rows`
    (and, for a multi-turn task, `TOOLS` and `TOOL_SCHEMAS`, its tools as `agent.tools`
    would name them)."""
    if task == "tool_add":
        from rpk.tasks import tool_add

        return tool_add
    return arith


def builtin_rows(cfg: Config) -> list[dict[str, Any]]:
    """The built-in task's training rows (veRL layout)."""
    # Offset from the warm-up's seed so RL prompts are fresh draws, not the SFT set.
    return task_module(cfg.data.task).make_rows(
        cfg.data.builtin_size, seed=10_000 + cfg.run.seed, spec=tiny_spec(cfg).task)


def load_prompts(cfg: Config, model_dir: Path) -> list[Prompt]:
    """The training prompts, tokenised with the model's chat template (and a multi-turn
    run's tool schemas, which templates render into the system turn). Blocking."""
    tokenizer = _tokenizer(model_dir)
    tools = tool_schemas(cfg)
    if cfg.data.train_files:
        return load_files(cfg.data.train_files, tokenizer, cfg.data.max_prompt_tokens, tools)
    return to_prompts(numbered(builtin_rows(cfg)), f"builtin:rpk/{cfg.data.task}", tokenizer,
                      cfg.data.max_prompt_tokens, tools)


def load_val_prompts(cfg: Config, model_dir: Path) -> list[Prompt]:
    """The validation prompts: `data.val_files`, else the built-in task's held-out split
    (none equal to a training prompt), else none. Blocking."""
    d = cfg.data
    if d.val_files:
        return load_files(d.val_files, _tokenizer(model_dir), d.max_prompt_tokens, tool_schemas(cfg))
    if d.train_files or not d.val_size:
        return []
    try:
        rows = task_module(d.task).held_out_rows(
            d.val_size, seed=20_000 + cfg.run.seed, exclude=builtin_rows(cfg), spec=tiny_spec(cfg).task
        )
    except ValueError as e:
        raise ConfigError(f"data.val_size={d.val_size}: {e}; lower it or set it to 0") from None
    return to_prompts(numbered(rows), f"builtin-val:rpk/{d.task}", _tokenizer(model_dir),
                      d.max_prompt_tokens, tool_schemas(cfg))


def agent_tools(cfg: Config) -> list[Tool]:
    """A multi-turn run's tools: `agent.tools`, else the built-in task's; checked (each
    imports, each has a schema) before anything slow starts."""
    a = cfg.agent
    try:
        schemas = load_schemas(a.tool_schemas) if a.tool_schemas else {}
        if a.tools:
            return [load_tool(spec, schemas) for spec in a.tools]
    except ToolError as e:
        raise ConfigError(str(e), "agent.tools") from None
    if a.env is None and cfg.data.task in MULTI_TURN_TASKS:
        task = task_module(cfg.data.task)
        lat = a.tool_latency
        latency = LatencyModel(lat.median_s, lat.p99_s, lat.timeout_frac)
        # The task's tools answer after the modelled latency, as remote tools would.
        return [dataclasses.replace(t, fn=functools.partial(t.fn, latency=latency))
                for t in (load_tool(spec, task.TOOL_SCHEMAS) for spec in task.TOOLS)]
    return []


def tool_schemas(cfg: Config) -> list[dict[str, Any]]:
    return [dict(t.schema) for t in agent_tools(cfg)] if cfg.multi_turn else []


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

    def wrap(self, inner: Engine) -> AgentEngine:
        """The rollout engine the loop drives: each request a trajectory on `inner`."""
        return AgentEngine(inner, self.env, self.encoder, self.prompts, self.max_turns,
                           self.step_timeout_s)


def build_agent(cfg: Config, model_dir: Path, prompts: Sequence[Prompt]) -> AgentSetup | None:
    """For a multi-turn run (`Config.multi_turn`): the parts that make each request a
    trajectory (`rpk.agent`), answered by `agent.env` or by a `ToolEnv` over the tools,
    its observations encoded with the model's chat template. None for a single-turn
    run. Blocking (it loads the tokenizer)."""
    if not cfg.multi_turn:
        return None
    a = cfg.agent
    tools = agent_tools(cfg)
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


def build_policy(cfg: Config, prompts: Sequence[Prompt]) -> Policy:
    r = cfg.rollout
    if len(prompts) < r.prompts_per_step:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} but the dataset has only "
            f"{len(prompts)} prompts"
        )
    sampling = Sampling(
        prompts_per_step=r.prompts_per_step,
        responses_per_prompt=r.responses_per_prompt,
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=cfg.run.seed,
        drop_zero_variance=r.dynamic_sampling,
    )
    options = PolicyOptions(
        eta_prompts=r.eta_prompts,
        eta_responses=r.eta_responses,
        shuffle=cfg.data.shuffle,
        lookahead_rounds=r.lookahead_rounds,
        adaptive_eta=r.adaptive_eta,
        eta_bounds=EtaBounds(
            (r.eta_prompts_min, r.eta_prompts_max), (r.eta_responses_min, r.eta_responses_max)
        ),
        concurrency=r.max_num_seqs,
    )
    return make_policy(r.policy, prompts, sampling, options)


def build_scorer(cfg: Config, prompts: Sequence[Prompt]) -> RewardStack:
    """Checked before the engine starts: a missing reward, a function that veRL could not
    call, or a missing token fails in seconds. Judged rows (`reward.judge`) need no rule
    reward; the judge's engine starts later, in `build`."""
    rw, settings = cfg.reward, reward_settings(cfg)
    judge_cfg = judge_settings(cfg)
    judged = {p.uid for p in prompts if is_judged(p, judge_cfg.data_sources)}
    judge = None
    if judged:
        if judge_cfg.model is None:
            some = next(p for p in prompts if p.uid in judged)
            raise ConfigError(
                f"{len(judged)} rows are judged (the first: {some.uid}, data_source "
                f"{some.data_source!r}, reward_model.style {some.reward_style!r}) but no judge "
                "is set", "reward.judge.model",
            )
        check_template(judge_cfg.template)
        judge = JudgeScorer(judge_cfg)
    # compare_rules: judged rows keep a rule reward too, checked beside the judge.
    ruled = [p for p in prompts if p.uid not in judged or judge_cfg.compare_rules]
    max_tokens = cfg.rollout.max_tokens
    if rw.url is not None:
        # The service picks the function per data source; the run cannot check it here.
        # A token variable the environment lacks is a RewardError now, not at the first call.
        scorer = remote.HTTPScorer(
            rw.url, token=remote.read_token(rw.token_env), timeout_s=rw.timeout_s,
            max_concurrency=rw.max_concurrency, batch_size=rw.batch_size, linger_ms=rw.linger_ms,
            retries=rw.retries, backoff_s=rw.backoff_s,
        )
        return judged_stack(
            settings, scorer, lambda data_source: f"the reward service {rw.url}",
            remote.FAILURE_KINDS, judge, max_tokens=max_tokens,
        )
    functions = resolve(rw.function, {p.data_source for p in ruled}, rw.functions) if ruled else {}
    return make_scorer(settings, functions, max_tokens=max_tokens, judge=judge)


def model_context_length(model_dir: Path) -> int:
    hf = json.loads((model_dir / "config.json").read_text())
    return int(hf.get("max_position_embeddings") or hf.get("max_sequence_length") or 2048)


def check_lengths(cfg: Config, model_dir: Path, prompts: Sequence[Prompt]) -> int:
    """The engine's context length, checked against the longest prompt + max_tokens."""
    limit = cfg.rollout.max_model_len or model_context_length(model_dir)
    longest = max(len(p.token_ids) for p in prompts)
    if longest + cfg.rollout.max_tokens > limit:
        raise ConfigError(
            f"rollout.max_tokens={cfg.rollout.max_tokens} plus the longest prompt "
            f"({longest} tokens) exceeds the context length {limit}"
        )
    return limit


def check_engine_nodes(cfg: Config, layout: ParallelLayout) -> tuple[int, ...]:
    """The nodes that run rollout replicas, checked."""
    from rpk.cluster.nodes import check_nodes

    r = cfg.rollout
    return check_nodes(layout.engine_nodes, layout.nnodes, r.tp_switch, r.weight_transfer)


def start_node_host(cfg: Config, node: int) -> Any:
    """On a follower that is local rank 0 of engine node `node` > 0: its engine host,
    started from the controller's spec (`rpk.cluster.nodes`). Blocking."""
    from datetime import timedelta

    from rpk.cluster.nodes import NodeHost, default_store

    # The spec comes once the controller has its model and prompts (minutes when it
    # builds the tiny model first); the follower would be waiting for commands anyway.
    return NodeHost.start(default_store(), node, timedelta(days=7), cfg.dist.engine_start_timeout_s)


async def start_engine(
    cfg: Config, model_dir: Path, parts: PartsPlan, version: int, log: Log,
    trainer: Awaitable[AsyncTrainer] | None = None,
) -> Fleet:
    """The rollout fleet: every layout of the plan's fleet (one unpinned replica by
    default; on CUDA the memory plan's layouts, `rpk.gpu.box`), serving the model as
    weight version `version`; in a run over several nodes, every engine node's replicas.
    `trainer`: the sharded trainer being loaded, which an m2n weight path sends from."""
    from rpk.engine.m2n import COMMUNICATORS, TrainerShards
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.gpu.box import weight_path

    r, box, settings = cfg.rollout, parts.box, parts.engine
    if box.memory is not None:
        log(box.memory.table())
    plan, platform = parts.placement.fleet, box.platform
    layout = parts.placement.layout
    backend = weight_path(cfg, box, layout.world_size if layout is not None else 1)
    adapter = lora_adapter(cfg, model_dir)
    if adapter is not None:
        log(f"weights: LoRA rank {cfg.model.lora_rank}, each sync a new adapter version (PEFT files)")
        backend = "shm"  # the base never moves after start: no transfer engine, no m2n lanes
    shards = TrainerShards(trainer) if backend in COMMUNICATORS and trainer is not None else None
    if backend in COMMUNICATORS:
        if backend == "nccl_m2n" and cfg.run.verify_sync:
            raise ConfigError("true with nccl_m2n: vLLM's m2n engine reports no digests of what its "
                              "workers received; verify with rollout.weight_transfer nccl", "run.verify_sync")
        log(f"weights: {backend}, every trainer rank sends its own shards")

    async def start_local() -> Fleet:
        return await launch_fleet(
            settings, plan, platform=platform, backend=backend, switch=r.tp_switch,
            version=version, log=log, verify=cfg.run.verify_sync, shards=shards, adapter=adapter,
        )

    nodes = parts.placement.engine_nodes
    if nodes == (0,):
        return await start_local()
    return await start_nodes(cfg, model_dir, settings, plan, platform, version, log, nodes, start_local, adapter)


def lora_adapter(cfg: Config, model_dir: Path) -> dict[str, Any] | None:
    """A LoRA run's `adapter_config.json` content, which every sync's adapter carries."""
    adapters = lora_settings(cfg)
    if adapters is None:
        return None
    from rpk.train.lora import adapter_config

    return adapter_config(adapters, model_dir)


async def start_nodes(
    cfg: Config, model_dir: Path, settings: Any, plan: Any, platform: str, version: int, log: Log,
    nodes: tuple[int, ...], start_local: Callable[[], Awaitable[Fleet]], adapter: dict[str, Any] | None = None,
) -> Fleet:
    """The fleet over every engine node: node 0's replicas (`start_local`) and the other
    nodes' hosts, weights over gloo (or the HTTP fallback), the hosts' token out of the
    rendezvous store, TLS where `dist.tls_cert` is set (`rpk.cluster.nodes`). `adapter`:
    a LoRA run's, whose versions are uploaded to each host (`RemoteReplica.load_adapter`)."""
    from rpk.cluster import nodes as n
    from rpk.cluster.remote import client_ssl
    from rpk.engine.adapter import AdapterTransport
    from rpk.engine.verify import VerifiedTransport

    d, remote = cfg.dist, n.remote_transfer(cfg.rollout.weight_transfer, platform)
    if adapter is not None:
        remote = "shm"  # the hosts' replicas take adapters, never a weight-transfer engine
    token, token_file = n.run_token(Path(cfg.run.out_dir))
    engine = {k: v for k, v in dataclasses.asdict(settings).items() if k != "model"}
    spec = n.EngineSpec(str(model_dir), engine, plan.tp_sizes, plan.tp, tuple(cfg.rollout.devices),
                        version, str(token_file or ""), remote, cfg.run.verify_sync,
                        d.tls_cert, d.tls_key)
    if adapter is not None:
        transport: Any = AdapterTransport(adapter)
        path = "LoRA adapters over HTTP"
    else:
        transport = n.node_transport(remote, n.advertised_address())
        path = "gloo" if remote == "gloo" else "HTTP uploads (the fallback)"
    log(f"weights to the other nodes' replicas: {path}")
    try:
        return await n.launch_nodes(
            spec, token, nodes, n.default_store(), start_local=start_local,
            timeout_s=d.engine_start_timeout_s, log=log, tls=client_ssl(d.tls_ca) if d.tls_cert else None,
            transport=VerifiedTransport(transport) if cfg.run.verify_sync else transport,
        )
    finally:
        if token_file is not None:  # every host has read it (or the start failed)
            token_file.unlink(missing_ok=True)


def make_torch_trainer(cfg: Config, model_dir: Path, sharding: Any = None) -> Any:
    """One rank's torch trainer (the only one, unsharded). Blocking: it loads the model."""
    from rpk.gpu.box import trainer_options
    from rpk.gpu.device import trainer_device
    from rpk.train.trainer import TorchTrainer

    box, device = box_for(cfg, model_dir), trainer_device(cfg.train.device)
    trainer = TorchTrainer(
        model_dir,
        trainer_settings(cfg),
        max_response_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        device=device,
        sharding=sharding,
        defer_reduction=trainer_options(cfg, box)["defer_reduction"],
        adapters=lora_settings(cfg),
    )
    if sharding is None and device == "cpu" and not cfg.model.lora_rank:
        from rpk.engine.vllm_fleet import transfer_backend

        if transfer_backend(cfg.rollout.weight_transfer, box.fleet, box.platform, 0) == "cpu_ipc":
            from rpk.engine.shm_engine import share_weights

            # cpu_ipc then hands the replicas its parameters where they lie: one copy a sync.
            share_weights(trainer.model)
    return trainer


def build_trainer(cfg: Config, model_dir: Path, joined: Any = None) -> AsyncTrainer:
    """The trainer on its own thread (and, on GPU, its own CUDA stream): the torch
    trainer, or in a multi-process run the `DistTrainer` that drives every rank's shard
    (`joined`: this rank's `rpk.gpu.launch.Joined`). Blocking: it loads the model."""
    from rpk.gpu.device import trainer_device
    from rpk.gpu.streams import side_stream_init

    if joined is None:
        trainer = make_torch_trainer(cfg, model_dir)
    else:
        from rpk.train.dist import DistTrainer

        def make(directory: str) -> Any:
            return make_torch_trainer(cfg, Path(directory), joined.sharding)

        trainer = DistTrainer(joined.channel, make, str(model_dir))
    return AsyncTrainer(trainer, thread_init=side_stream_init(trainer_device(cfg.train.device)))


def build_streaming(
    cfg: Config, engine: Lending | None = None, log: Log | None = None,
    placement: Placement | None = None, box: Box | None = None,
) -> Streaming:
    """The config's streaming, or the one `box`'s memory plan fits (on CUDA); borrow on an
    engine that cannot lend (one replica) falls back to thread, said once in `log`.
    Borrowing with a sharded trainer (several processes in `placement.layout`) trains on
    the lent replicas' ranks alone where they make whole HSDP replicate groups
    (`ParallelLayout.ranks_on`); elsewhere every rank computes, said once."""
    t = cfg.train
    mode = StreamMode(t.stream_mode)
    planned = box.stream_mode if box is not None else None
    if planned is not None and StreamMode(planned) is not mode:
        if log is not None:
            log(f"train.stream_mode {mode.value}: the memory plan fits no training beside the "
                f"tail on these GPUs; training after each round instead")
        mode = StreamMode(planned)
    if mode is StreamMode.BORROW and engine is not None and not can_borrow(engine):
        if log is not None:
            log("train.stream_mode borrow needs >= 2 rollout replicas; this fleet has fewer: "
                "streaming on the trainer thread instead")
        mode = StreamMode.THREAD
    sharded = placement is not None and placement.layout is not None and placement.layout.distributed
    ranks = _borrowed_ranks(placement, log) if mode is StreamMode.BORROW and sharded else None
    return Streaming(
        mode=mode, start_frac=t.stream_start_frac, chunk_tokens=t.stream_chunk_tokens,
        borrow=BorrowRule(min_frac=t.borrow_min_frac, max_frac=t.borrow_max_frac,
                          check_s=t.borrow_check_s),
        trainer_ranks=ranks,
    )


def _borrowed_ranks(
    placement: Placement, log: Log | None
) -> Callable[[Sequence[str]], Sequence[int] | None]:
    plan, layout = placement.fleet, placement.layout
    assert layout is not None
    said: list[bool] = []

    def ranks(names: Sequence[str]) -> Sequence[int] | None:
        found = layout.ranks_on([d for n in names for d in replica_devices(n, plan)])
        if found is None and log is not None and not said:
            said.append(True)
            log(f"borrow: replicas {list(names)} are not whole HSDP replicate groups of the "
                f"trainer ({layout.describe()}): every rank trains while they are lent")
        return found

    return ranks


@dataclass(frozen=True, slots=True)
class PartsPlan:
    """What the started parts are made from, worked out from the config once, after the
    cheap checks and before anything starts (`plan_parts`)."""

    box: Box  # this machine's: platform, memory plan, the rollout's layouts
    placement: Placement  # its fleet: the box's
    max_model_len: int  # checked against the longest prompt + max_tokens
    engine: Any  # the `VLLMSettings` every replica starts from
    colocation: Colocation | None  # how rollout and training share the devices
    planner: PlannerConfig  # elastic TP between rounds
    advantages: Callable[[Sequence[float]], list[float]]  # the loss's
    eval_spec: EvalSpec
    weight_bucket_bytes: int


def plan_parts(
    cfg: Config, placement: Placement, model_dir: Path, prompts: Sequence[Prompt]
) -> PartsPlan:
    """The plan of the run's started parts. Blocking (it reads the model's config): on
    CUDA the memory plan, which reads the model's size, places the rollout (the trainer
    builder, also called alone, asks `box_for`'s cache)."""
    from rpk.engine.adapter import max_lora_rank
    from rpk.gpu.box import engine_settings

    max_model_len = check_lengths(cfg, model_dir, prompts)
    box = box_for(cfg, model_dir)
    engine, colo = engine_settings(cfg, str(model_dir), max_model_len, box), colocation(cfg, box)
    if cfg.model.lora_rank:
        engine = dataclasses.replace(engine, max_lora_rank=max_lora_rank(cfg.model.lora_rank))
        if colo is not None and colo.level >= 2:
            # A LoRA sync is the adapter alone: resting replicas keep the base (level 1).
            colo = dataclasses.replace(colo, level=1)
    return PartsPlan(
        box, dataclasses.replace(placement, fleet=box.fleet), max_model_len, engine, colo,
        PlannerConfig(PlannerMode(cfg.rollout.tp), box.fleet.tp_sizes, box.fleet.tp),
        advantage_fn(cfg.train.loss), eval_spec(cfg), cfg.rollout.weight_bucket_mb * 2**20,
    )


@dataclass(slots=True)
class Components:
    """Everything a run steps with; `aclose` stops what was started."""

    model_dir: Path
    prompts: list[Prompt]
    policy: Policy
    scorer: RewardStack
    engine: Engine  # a Fleet, as `build` starts it
    trainer: AsyncTrainer
    streaming: Streaming
    val_prompts: list[Prompt] = field(default_factory=list)
    # elastic TP between rounds (`rpk.loop.elastic`): a fleet's, as `build` starts it;
    # None runs the engine as it is
    elastic: RolloutTP | None = None
    lender: Lending | None = None  # the fleet, when the trainer borrows its replicas
    rester: Resting | None = None  # the fleet, when it shares its devices with the trainer
    hosts: Mapping[int, HostClient] = field(default_factory=dict)  # other nodes' engine hosts
    advantages: Callable[[Sequence[float]], list[float]] = field(kw_only=True)  # the loss's
    eval_spec: EvalSpec = field(kw_only=True)
    weight_bucket_bytes: int = field(kw_only=True)

    async def aclose(self) -> None:
        try:
            await self.engine.shutdown()
        finally:
            try:
                await self.scorer.aclose()
            finally:
                await self.trainer.aclose()


async def build(
    cfg: Config, placement: Placement, model_dir: Path, prompts: list[Prompt], log: Log,
    joined: Any = None, val_prompts: Sequence[Prompt] = (), version: int = 0,
    state_from: Path | None = None,
) -> Components:
    """Start the engine and load the trainer side by side, once everything cheap has been
    checked. `placement`: where the parts go (`place`); `model_dir` is what both load
    (the run's model, or a checkpoint of weight version `version`); `state_from`: the
    checkpoint whose trainer state (optimizer, RNG) the trainer resumes; `joined`: rank
    0's place in a multi-process run. The validation prompts are scored and
    length-checked like the training ones."""
    policy = build_policy(cfg, prompts)
    scorer = build_scorer(cfg, [*prompts, *val_prompts])
    try:
        agent = await asyncio.to_thread(build_agent, cfg, model_dir, [*prompts, *val_prompts])
        if agent is not None:
            await agent.ready()
        if (sandbox := scorer.sandbox) is not None:
            # A machine that cannot isolate programs fails in one line, not per sample.
            log(f"code sandbox: {await sandbox.probe()}")
        if scorer.judge is not None:
            # Before the rollout's: two vLLM engines must not start side by side.
            kind = VLLMRewardModel if scorer.judge.settings.verdict == "classify" else VLLMJudge
            await scorer.judge.start(
                lambda s: kind.launch(s, hub_cache=cfg.model.hub_cache, seed=cfg.run.seed)
            )
            log(f"judge: {scorer.judge.settings.model} ({scorer.judge.settings.verdict} verdicts)")
        plan = await asyncio.to_thread(plan_parts, cfg, placement, model_dir, [*prompts, *val_prompts])
        colo = plan.colocation
        async with asyncio.TaskGroup() as tg:
            trainer_task = tg.create_task(
                _load_trainer(cfg, model_dir, joined, state_from), name="load-trainer"
            )
            if colo is not None and colo.trainer_first:
                await (await trainer_task).offload(colo.offload)
            engine_task = tg.create_task(
                start_engine(cfg, model_dir, plan, version, log, trainer_task), name="start-engine"
            )
    except BaseException:
        await _close_started(scorer, locals().get("engine_task"), locals().get("trainer_task"))
        raise
    engine, trainer = engine_task.result(), trainer_task.result()
    if colo is not None:
        engine.rest_level = colo.level
        # Even `none` drops the gradients and empties the trainer's cache before the KV wakes.
        engine.before_kv = lambda: trainer.offload(colo.offload)
    streaming = build_streaming(cfg, engine, log, plan.placement, plan.box)
    elastic = RolloutTP(TPPlanner(plan.planner), engine, trainer, plan.weight_bucket_bytes, log,
                        last_step=cfg.run.steps)
    # The loop starts trajectories through the agent engine; lending, resting and
    # regrouping still act on the fleet itself.
    rollout = agent.wrap(engine) if agent is not None else engine
    return Components(
        model_dir, prompts, policy, scorer, rollout, trainer, streaming, list(val_prompts), elastic,
        lender=engine if streaming.mode is StreamMode.BORROW else None,
        rester=with_judge(engine, scorer.judge, log) if colo is not None else None,
        hosts=_remote_hosts(engine) if placement.engine_nodes != (0,) else {},
        advantages=plan.advantages, eval_spec=plan.eval_spec,
        weight_bucket_bytes=plan.weight_bucket_bytes,
    )


async def _load_trainer(
    cfg: Config, model_dir: Path, joined: Any, state_from: Path | None
) -> AsyncTrainer:
    """The trainer, restored to `state_from` before a colocated trainer moves its state
    out and vLLM starts: restored later, the state would come back onto the devices
    beside vLLM's KV cache, where it does not fit."""
    trainer = await asyncio.to_thread(build_trainer, cfg, model_dir, joined)
    if state_from is not None:
        try:
            await trainer.load(state_from)
        except BaseException:
            await trainer.aclose()
            raise
    return trainer


async def assemble(
    cfg: Config, placement: Placement, log: Log, resume: ResumePoint | None = None,
    joined: Any = None,
) -> Components:
    """The run's components from the config: its model (or `resume`'s checkpoint), its
    prompts, then `build`; resumed, the trainer, the policy and the TP planner are
    restored to the checkpoint. Said in `log` as it goes."""
    if resume is not None and cfg.model.lora_rank:
        from rpk.train.lora import base_of

        try:
            model_dir = base_of(resume.checkpoint)  # a LoRA checkpoint holds the adapter alone
        except FileNotFoundError as e:
            raise ConfigError(f"> 0, but the checkpoint to resume is not a LoRA run's: {e}", "model.lora_rank") from None
    elif resume is not None:
        model_dir = resume.checkpoint
    else:
        model_dir = await asyncio.to_thread(resolve_model, cfg, log)
    prompts = await asyncio.to_thread(load_prompts, cfg, model_dir)
    val_prompts = await asyncio.to_thread(load_val_prompts, cfg, model_dir)
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    log(f"model {model_dir}; {len(prompts)} prompts; {_describe_val(prompts, val_prompts)}; "
        f"event loop {loop_kind}")
    version = resume.state.get("version", 0) if resume is not None else 0
    parts = await build(
        cfg, placement, model_dir, prompts, log, joined, val_prompts, version,
        state_from=resume.checkpoint if resume is not None else None,
    )
    if resume is not None:
        try:
            parts.policy.load_state_dict(resume.state["policy"])
            if parts.elastic is not None:
                parts.elastic.planner.load_state_dict(resume.state.get("tp_planner", {}))
            if cfg.model.lora_rank:
                # The replicas started on the base: the checkpoint's adapter before any round.
                await parts.engine.update_weights(
                    parts.trainer.weight_buckets(parts.weight_bucket_bytes), parts.trainer.version
                )
        except BaseException:
            await parts.aclose()
            raise
    return parts


def _describe_val(prompts: list[Prompt], val_prompts: list[Prompt]) -> str:
    if not val_prompts:
        return "no validation"
    trained = {p.token_ids for p in prompts}
    shared = sum(1 for p in val_prompts if p.token_ids in trained)
    return f"{len(val_prompts)} validation prompts" + (
        f" ({shared} of them also training prompts)" if shared else ""
    )


def _remote_hosts(engine: Fleet) -> dict[int, HostClient]:
    """The engine hosts of a fleet over several nodes, for the controller to watch."""
    from rpk.cluster.nodes import remote_hosts

    return remote_hosts(engine)


async def _close_started(scorer: RewardStack, *tasks: Any) -> None:
    """A start that failed half-way stops what did start: the other task's engine or
    trainer, and the scorer's pool."""
    for task in tasks:
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            continue
        started = task.result()
        if isinstance(started, AsyncTrainer):
            await started.aclose()
        else:
            await started.shutdown()
    await scorer.aclose()
