"""The start: `start_parts` plans the parts, starts the judge (on the GPUs, one engine per
rollout GPU: the plan's `rpk.judge.pool.JudgePlan`), then the rollout fleet beside the
trainer's load (with it the other nodes' judges, which join node 0's), and hands back
the run's `Components`; `assemble` is the whole way from a config (or a checkpoint to
resume) to them. A start that fails half-way stops what did start, newest first, and
raises the failure.

These two are where the config is read: they hand each builder its own section, or the
records `rpk.assembly.settings` and `plan_parts` make of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from rpk.agent.engine import AgentEngine
from rpk.agent.tools import Tool
from rpk.assembly.box import Colocation
from rpk.assembly.inputs import (
    Log,
    Placement,
    agent_tools,
    build_agent,
    code_sandbox,
    describe_val,
    load_prompts,
    load_val_prompts,
    run_model,
)
from rpk.assembly.parts import (
    TrainerPlan,
    build_round_policy,
    build_scorer,
    build_streaming,
    build_trainer,
    plan_parts,
    start_engine,
)
from rpk.assembly.settings import PartsSettings, judge_tier, parts_settings
from rpk.checkpoint import ResumePoint
from rpk.cluster.nodes import remote_hosts, remote_judges
from rpk.cluster.remote import HostClient
from rpk.config import Config, ConfigError
from rpk.controller import Components
from rpk.core.modes import StreamMode
from rpk.core.records import Prompt
from rpk.engine.fleet import Fleet, Rest
from rpk.gpu.device import mps_on
from rpk.gpu.launch import Joined
from rpk.judge.cache import unwrap
from rpk.judge.pool import JudgePool
from rpk.judge.rest import with_judge
from rpk.judge.tier import describe_tier, start_tier
from rpk.judge.tiny_recipe import JUDGE
from rpk.loop.elastic import RolloutTP
from rpk.loop.speculate import SpecTail
from rpk.loop.trainer import AsyncTrainer
from rpk.reward.code import CodeScorer
from rpk.reward.judge import JudgeScorer
from rpk.sched.tp_planner import TPPlanner
from rpk.tasks import tiny_build
from rpk.train.lora import base_of


async def start_parts(
    cfg: Config, placement: Placement, model_dir: Path, prompts: list[Prompt], log: Log,
    joined: Joined | None = None, val_prompts: Sequence[Prompt] = (), version: int = 0,
    state_from: Path | None = None, tools: Sequence[Tool] | None = None, code: CodeScorer | None = None,
    made: PartsSettings | None = None,
) -> Components:
    """Start the engine and load the trainer side by side, once everything cheap has been
    checked. `placement`: where the parts go (`place`); `model_dir` is what both load
    (the run's model, or a checkpoint of weight version `version`); `state_from`: the
    checkpoint whose trainer state (optimizer, RNG) the trainer resumes; `joined`: rank
    0's place in a multi-process run; `code` and `tools`: the run's code sandbox and its
    agent's tools on it (None: made here); `made`: the config's `PartsSettings` (None:
    made here). The validation prompts are scored and length-checked like the training
    ones."""
    made = parts_settings(cfg) if made is None else made
    every = [*prompts, *val_prompts]
    code = code_sandbox(cfg.reward) if code is None else code
    tools = agent_tools(cfg.agent, made.task, code) if tools is None else tools
    policy = build_round_policy(cfg.rollout, prompts, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                                tools=made.tools)
    scorer = build_scorer(cfg.reward, made.judge, every, cfg.rollout.max_tokens, code, seed=cfg.run.seed)
    async with contextlib.AsyncExitStack() as started:
        # Until the parts are handed over, a failure stops what did start, newest first.
        started.push_async_callback(scorer.aclose)
        agent = None
        if made.tools is not None:  # a multi-turn run
            agent = await asyncio.to_thread(build_agent, cfg.agent, cfg.rollout.max_turns, model_dir, every, tools)
            await agent.ready()
        if (sandbox := scorer.sandbox) is not None:
            # A machine that cannot isolate programs fails in one line, not per sample.
            log(f"code sandbox: {await sandbox.probe()}")
        if scorer.judge is not None and made.tiny_judge:
            # Before the plan, which reads the judge's config.
            await tiny_build.build(cfg.model.tiny_judge, Path(cfg.model.cache_dir), log, JUDGE)
        plan = await asyncio.to_thread(plan_parts, cfg, placement, model_dir, every)
        colo = plan.colocation
        several = placement.engine_nodes != (0,)
        if scorer.judge is not None:
            # Before the rollout's: two vLLM engines must not start side by side. On the
            # GPUs, one engine per rollout GPU, as the plan placed it; or the external
            # judge at reward.judge.url (`rpk.judge.tier`).
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            tier = judge_tier(cfg.reward.judge)
            await scorer.judge.start(functools.partial(
                start_tier, tier=tier, plan=plan.judge, visible=visible, node=0 if several else None, log=log))
            log(describe_tier(tier, plan.judge, scorer.judge.settings, visible))
            if plan.judge is not None and plan.judge.device is not None and not mps_on():
                log("judge: CUDA MPS is off, so the judge, the rollout replica and the trainer rank on a "
                    "GPU take turns on it; start nvidia-cuda-mps-control -d (same user) to share its SMs")

        async def load_trainer() -> AsyncTrainer:
            trainer = await _load_trainer(plan.trainer, model_dir, joined, state_from)
            started.push_async_callback(trainer.aclose)
            return trainer

        async def start_fleet(trainer: asyncio.Task[AsyncTrainer]) -> Fleet:
            fleet = await start_engine(model_dir, plan, version, log, trainer, _rest(colo, trainer))
            started.push_async_callback(fleet.shutdown)
            return fleet

        async with asyncio.TaskGroup() as tg:
            trainer_task = tg.create_task(load_trainer(), name="load-trainer")
            if colo is not None and colo.trainer_first:
                await (await trainer_task).offload(colo.offload)
            engine_task = tg.create_task(start_fleet(trainer_task), name="start-engine")
        engine, trainer = engine_task.result(), trainer_task.result()
        hosts = remote_hosts(engine) if several else {}
        if scorer.judge is not None and hosts:
            await _join_judges(scorer.judge, hosts, log)
        streaming = build_streaming(cfg.train, engine, log, plan.placement, plan.box)
        elastic = RolloutTP(TPPlanner(plan.planner), engine, trainer, plan.weight_bucket_bytes, log,
                            last_step=plan.last_step)
        # The loop starts trajectories through the agent engine; lending, resting and
        # regrouping still act on the fleet itself.
        rollout = agent.wrap(engine, log) if agent is not None else engine
        spec = SpecTail(policy.speculation, engine) if policy.speculation is not None else None
        if spec is not None and isinstance(rollout, AgentEngine):
            rollout.on_turn = spec.turn  # sibling trajectories draft from each other's turns
        parts = Components(
            model_dir, prompts, policy, scorer, rollout, trainer, streaming, list(val_prompts), elastic,
            lending_fleet=engine if streaming.mode is StreamMode.BORROW else None,
            resting_fleet=with_judge(engine, scorer.judge, log) if colo is not None else None,
            hosts=hosts,
            spec=spec,
            advantages=plan.advantages, eval_spec=plan.eval_spec,
            weight_bucket_bytes=plan.weight_bucket_bytes,
        )
        started.pop_all()  # the components stop them now (`Components.aclose`)
    return parts


def _rest(colo: Colocation | None, trainer: asyncio.Task[AsyncTrainer]) -> Rest | None:
    """How a colocated fleet shares its devices: it sleeps at the plan's level while the
    trainer trains, and even offload `none` drops the gradients and empties the trainer's
    cache before the KV cache wakes (vLLM's KV was sized beside the trainer's state alone)."""
    if colo is None:
        return None
    return Rest(colo.level, lambda: trainer.result().offload(colo.offload))


async def _load_trainer(
    plan: TrainerPlan, model_dir: Path, joined: Joined | None, state_from: Path | None
) -> AsyncTrainer:
    """The trainer, restored to `state_from` before a colocated trainer moves its state
    out and vLLM starts: restored later, the state would come back onto the devices
    beside vLLM's KV cache, where it does not fit."""
    trainer = await asyncio.to_thread(build_trainer, plan, model_dir, joined)
    if state_from is not None:
        try:
            await trainer.load(state_from)
        except BaseException:
            await trainer.aclose()
            raise
    return trainer


async def assemble(
    cfg: Config, placement: Placement, log: Log, resume: ResumePoint | None = None,
    joined: Joined | None = None,
) -> Components:
    """The run's components from the config: its model (or `resume`'s checkpoint), its
    prompts, then `start_parts`; resumed, the trainer, the policy and the TP planner are
    restored to the checkpoint. Said in `log` as it goes."""
    made = parts_settings(cfg)
    if resume is not None and cfg.model.lora_rank:
        try:
            model_dir = base_of(resume.checkpoint)  # a LoRA checkpoint holds the adapter alone
        except FileNotFoundError as e:
            raise ConfigError(f"> 0, but the checkpoint to resume is not a LoRA run's: {e}",
                              "model.lora_rank") from None
    elif resume is not None:
        model_dir = resume.checkpoint
    else:
        model_dir = await run_model(cfg.model, made.task, log)
    code = code_sandbox(cfg.reward)
    tools = agent_tools(cfg.agent, made.task, code)  # once: the prompts render their schemas, the agent runs them
    prompts = await asyncio.to_thread(load_prompts, made.prompts, model_dir, tools)
    val_prompts = await asyncio.to_thread(load_val_prompts, made.prompts, model_dir, tools)
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    log(f"model {model_dir}; {len(prompts)} prompts; {describe_val(prompts, val_prompts)}; "
        f"event loop {loop_kind}")
    version = resume.state.version if resume is not None else 0
    parts = await start_parts(
        cfg, placement, model_dir, prompts, log, joined, val_prompts, version,
        state_from=resume.checkpoint if resume is not None else None, tools=tools, code=code, made=made,
    )
    if resume is not None:
        try:
            parts.policy.load_state_dict(resume.state.policy)
            if parts.elastic is not None:
                parts.elastic.planner.load_state_dict(resume.state.tp_planner)
            if cfg.model.lora_rank:
                # The replicas started on the base: the checkpoint's adapter before any round.
                await parts.engine.update_weights(
                    parts.trainer.weight_buckets(parts.weight_bucket_bytes), parts.trainer.version
                )
        except BaseException:
            await parts.aclose()
            raise
    return parts


async def _join_judges(judge: JudgeScorer, hosts: Mapping[int, HostClient], log: Log) -> None:
    """The judge engines the other nodes' hosts started join node 0's in the scorer's pool."""
    remote = await remote_judges(hosts)
    if not remote:
        return
    pool = unwrap(judge.engine)
    if not isinstance(pool, JudgePool):
        await asyncio.gather(*(r.aclose() for r in remote))
        raise RuntimeError(f"the engine hosts serve {len(remote)} judge engines, but node 0's judge is "
                           f"{pool!r}, not one engine per GPU: the nodes disagree on the memory plan")
    pool.join(remote, [r.where for r in remote], [r.restart for r in remote])
    log(f"judge: {len(remote)} more engines on nodes {sorted({r.client.node for r in remote})}, "
        f"{len(pool.engines)} in all")
