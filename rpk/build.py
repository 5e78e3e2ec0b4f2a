"""Config -> components, in one place: the model directory, the prompts, the round
policy, the reward scorer, the rollout engine and the trainer. `rpk.controller` runs
them; the benchmarks build the same pieces through these functions.

Each builder takes the whole `Config` and reads its own sections; nothing else copies
config fields into constructors. The cheap checks (config against data, reward
functions, lengths) run before the slow starts (vLLM, the trainer's model).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from rpk.config import Config, ConfigError
from rpk.core.protocols import Engine
from rpk.core.records import Prompt
from rpk.data import load_files, numbered, to_prompts
from rpk.engine.fleet import Fleet
from rpk.engine.placement import fleet_plan, replica_devices
from rpk.loop.evaluate import EvalSpec
from rpk.loop.step import AsyncTrainer, Streaming, can_borrow
from rpk.reward import RewardStack, make_scorer, resolve, with_shaping
from rpk.reward import remote
from rpk.sched.borrow import BorrowRule
from rpk.sched.policy import Policy, PolicyOptions, Sampling, make_policy
from rpk.sched.provision import EtaBounds
from rpk.sched.tp_planner import PlannerConfig, TPPlanner
from rpk.tasks import arith

Log = Callable[[str], None]


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
    from rpk.tiny import build_tiny_model

    return build_tiny_model(cfg.model.tiny, Path(cfg.model.cache_dir), log=log)


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
    return arith.make_rows(cfg.data.builtin_size, seed=10_000 + cfg.run.seed, spec=cfg.model.tiny.task)


def load_prompts(cfg: Config, model_dir: Path) -> list[Prompt]:
    """The training prompts, tokenised with the model's chat template. Blocking."""
    tokenizer = _tokenizer(model_dir)
    if cfg.data.train_files:
        return load_files(cfg.data.train_files, tokenizer, cfg.data.max_prompt_tokens)
    return to_prompts(numbered(builtin_rows(cfg)), "builtin:rpk/arith", tokenizer, cfg.data.max_prompt_tokens)


def load_val_prompts(cfg: Config, model_dir: Path) -> list[Prompt]:
    """The validation prompts: `data.val_files`, else the built-in task's held-out split
    (none equal to a training prompt), else none. Blocking."""
    d = cfg.data
    if d.val_files:
        return load_files(d.val_files, _tokenizer(model_dir), d.max_prompt_tokens)
    if d.train_files or not d.val_size:
        return []
    try:
        rows = arith.held_out_rows(
            d.val_size, seed=20_000 + cfg.run.seed, exclude=builtin_rows(cfg), spec=cfg.model.tiny.task
        )
    except ValueError as e:
        raise ConfigError(f"data.val_size={d.val_size}: {e}; lower it or set it to 0") from None
    return to_prompts(numbered(rows), "builtin-val:rpk/arith", _tokenizer(model_dir), d.max_prompt_tokens)


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
    call, or a missing token fails in seconds."""
    if cfg.reward.url is not None:
        # The service picks the function per data source; the run cannot check it here.
        scorer = remote.HTTPScorer.from_config(cfg.reward)
        return RewardStack(
            with_shaping(cfg.reward, scorer, max_tokens=cfg.rollout.max_tokens),
            name_of=lambda data_source: f"the reward service {cfg.reward.url}",
            failure_kinds=remote.FAILURE_KINDS,
        )
    functions = resolve(cfg.reward.function, {p.data_source for p in prompts}, cfg.reward.functions)
    return make_scorer(cfg.reward, functions, max_tokens=cfg.rollout.max_tokens)


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


def check_engine_nodes(cfg: Config, place: Any) -> tuple[int, ...]:
    """The nodes that run rollout replicas (`place`: a `ParallelLayout`), checked."""
    from rpk.engine.nodes import check_nodes

    r = cfg.rollout
    return check_nodes(place.engine_nodes, place.nnodes, r.tp_switch, r.weight_transfer)


def start_node_host(cfg: Config, node: int) -> Any:
    """On a follower that is local rank 0 of engine node `node` > 0: its engine host,
    started from the controller's spec (`rpk.engine.nodes`). Blocking."""
    from datetime import timedelta

    from rpk.engine.nodes import NodeHost, default_store

    # The spec comes once the controller has its model and prompts (minutes when it
    # builds the tiny model first); the follower would be waiting for commands anyway.
    return NodeHost.start(default_store(), node, timedelta(days=7), cfg.dist.engine_start_timeout_s)


async def start_engine(
    cfg: Config, model_dir: Path, max_model_len: int, version: int = 0, log: Log = lambda line: None,
    joined: Any = None,
) -> Fleet:
    """The rollout fleet: every layout of `rollout.tp_sizes` over `rollout.devices`
    (one unpinned replica by default), serving the model as weight version `version`;
    in a run over several nodes (`joined`), every engine node's replicas."""
    from rpk.engine.vllm_fleet import launch_fleet, transfer_backend
    from rpk.gpu.box import box_for, engine_settings

    r = cfg.rollout
    box = box_for(cfg, model_dir)
    if box.memory is not None:
        log(box.memory.table())
    settings = engine_settings(cfg, str(model_dir), max_model_len, box)
    plan, platform = box.fleet, box.platform
    backend = transfer_backend(r.weight_transfer, plan, platform, trainer_device=0)

    async def start_local() -> Fleet:
        return await launch_fleet(
            settings, plan, platform=platform, backend=backend, switch=r.tp_switch,
            version=version, log=log,
        )

    nodes = check_engine_nodes(cfg, joined.layout) if joined is not None else (0,)
    if nodes == (0,):
        return await start_local()
    import dataclasses

    from rpk.engine.nodes import EngineSpec, default_store, launch_nodes, new_token

    engine = {k: v for k, v in dataclasses.asdict(settings).items() if k != "model"}
    spec = EngineSpec(str(model_dir), engine, plan.tp_sizes, plan.tp, tuple(r.devices), version, new_token())
    return await launch_nodes(
        spec, nodes, default_store(), start_local=start_local,
        timeout_s=cfg.dist.engine_start_timeout_s, log=log,
    )


def build_tp_planner(cfg: Config, model_dir: Path | None = None) -> TPPlanner:
    plan = _fleet(cfg, model_dir)
    return TPPlanner(PlannerConfig(cfg.rollout.tp, plan.tp_sizes, plan.tp))


def _fleet(cfg: Config, model_dir: Path | None) -> Any:
    """The rollout's layouts: the config's on CPU, the memory plan's on CUDA."""
    from rpk.gpu.box import box_for

    if model_dir is None:
        r = cfg.rollout
        return fleet_plan(r.devices, r.tp_sizes, r.tp_size, r.tp == "elastic")
    return box_for(cfg, model_dir).fleet


def make_torch_trainer(cfg: Config, model_dir: Path, sharding: Any = None) -> Any:
    """One rank's torch trainer (the only one, unsharded). Blocking: it loads the model."""
    from rpk.gpu.box import box_for, trainer_options
    from rpk.gpu.device import trainer_device
    from rpk.train.trainer import TorchTrainer

    return TorchTrainer(
        model_dir,
        cfg.train,
        max_response_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        device=trainer_device(cfg.train.device),
        sharding=sharding,
        defer_reduction=trainer_options(cfg, box_for(cfg, model_dir))["defer_reduction"],
    )


def build_trainer(cfg: Config, model_dir: Path, joined: Any = None) -> AsyncTrainer:
    """The trainer on its own thread (and, on GPU, its own CUDA stream): the torch
    trainer, or in a multi-process run the `DistTrainer` that drives every rank's shard
    (`joined`: this rank's `rpk.gpu.launch.Joined`). Blocking: it loads the model."""
    from rpk.gpu.device import trainer_device
    from rpk.gpu.streams import side_stream_init

    if joined is None:
        trainer = make_torch_trainer(cfg, model_dir)
    else:
        from rpk.gpu.commands import DistTrainer

        def make(directory: str) -> Any:
            return make_torch_trainer(cfg, Path(directory), joined.sharding)

        trainer = DistTrainer(joined.channel, make, str(model_dir))
    return AsyncTrainer(trainer, thread_init=side_stream_init(trainer_device(cfg.train.device)))


def build_streaming(
    cfg: Config, engine: Engine | None = None, log: Log | None = None, joined: Any = None,
    model_dir: Path | None = None,
) -> Streaming:
    """The config's streaming; borrow on an engine that cannot lend (one replica) falls
    back to thread, said once in `log`. Borrowing with a sharded trainer (`joined`)
    trains on the lent replicas' ranks alone where they make whole HSDP replicate
    groups (`ParallelLayout.ranks_on`); elsewhere every rank computes, said once."""
    t = cfg.train
    mode = t.stream_mode
    planned = box_stream_mode(cfg, model_dir)
    if planned is not None and planned != mode:
        if log is not None:
            log(f"train.stream_mode {mode}: the memory plan fits no training beside the tail "
                f"on these GPUs; training after each round instead")
        mode = planned
    if mode == "borrow" and engine is not None and not can_borrow(engine):
        if log is not None:
            log("train.stream_mode borrow needs >= 2 rollout replicas; this fleet has fewer: "
                "streaming on the trainer thread instead")
        mode = "thread"
    ranks = _borrowed_ranks(cfg, joined, log, model_dir) if mode == "borrow" and joined is not None else None
    return Streaming(
        mode=mode, start_frac=t.stream_start_frac, chunk_tokens=t.stream_chunk_tokens,
        borrow=BorrowRule(min_frac=t.borrow_min_frac, max_frac=t.borrow_max_frac,
                          check_s=t.borrow_check_s),
        trainer_ranks=ranks,
    )


def _colocation(cfg: Config, model_dir: Path) -> Any:
    from rpk.gpu.box import box_for, colocation

    return colocation(cfg, box_for(cfg, model_dir))


def box_stream_mode(cfg: Config, model_dir: Path | None) -> str | None:
    if model_dir is None:
        return None
    from rpk.gpu.box import box_for

    return box_for(cfg, model_dir).stream_mode


def _borrowed_ranks(
    cfg: Config, joined: Any, log: Log | None, model_dir: Path | None = None
) -> Callable[[Sequence[str]], Sequence[int] | None]:
    plan = _fleet(cfg, model_dir)
    layout = joined.layout
    said: list[bool] = []

    def ranks(names: Sequence[str]) -> Sequence[int] | None:
        found = layout.ranks_on([d for n in names for d in replica_devices(n, plan)])
        if found is None and log is not None and not said:
            said.append(True)
            log(f"borrow: replicas {list(names)} are not whole HSDP replicate groups of the "
                f"trainer ({layout.describe()}): every rank trains while they are lent")
        return found

    return ranks


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

    async def aclose(self) -> None:
        try:
            await self.engine.shutdown()
        finally:
            try:
                await self.scorer.aclose()
            finally:
                await self.trainer.aclose()


async def build(
    cfg: Config, model_dir: Path, prompts: list[Prompt], log: Log, joined: Any = None,
    val_prompts: Sequence[Prompt] = (), version: int = 0,
) -> Components:
    """Start the engine and load the trainer side by side, once everything cheap has been
    checked. `model_dir` is what both load (the run's model, or a checkpoint of weight
    version `version`); `joined`: rank 0's place in a multi-process run. The validation
    prompts are scored and length-checked like the training ones."""
    policy = build_policy(cfg, prompts)
    scorer = build_scorer(cfg, [*prompts, *val_prompts])
    try:
        if (sandbox := scorer.sandbox) is not None:
            # A machine that cannot isolate programs fails in one line, not per sample.
            log(f"code sandbox: {await sandbox.probe()}")
        max_model_len = check_lengths(cfg, model_dir, [*prompts, *val_prompts])
        colo = _colocation(cfg, model_dir)
        async with asyncio.TaskGroup() as tg:
            trainer_task = tg.create_task(
                asyncio.to_thread(build_trainer, cfg, model_dir, joined), name="load-trainer"
            )
            if colo is not None and colo.trainer_first:
                await (await trainer_task).offload(colo.offload)
            engine_task = tg.create_task(
                start_engine(cfg, model_dir, max_model_len, version, log, joined), name="start-engine"
            )
    except BaseException:
        await _close_started(scorer, locals().get("engine_task"), locals().get("trainer_task"))
        raise
    engine = engine_task.result()
    if colo is not None and isinstance(engine, Fleet):
        engine.rest_level = colo.level
        if colo.offload != "none":
            trainer = trainer_task.result()
            engine.before_kv = lambda: trainer.offload(colo.offload)
    return Components(
        model_dir, prompts, policy, scorer, engine, trainer_task.result(),
        build_streaming(cfg, engine, log, joined, model_dir), list(val_prompts),
    )


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
