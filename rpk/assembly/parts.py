"""The run's parts: the round policy, the reward scorer, the rollout fleet (one node's
replicas or every engine node's), the trainer and the streaming; and `plan_parts`, what
the started parts are made from, worked out once from the config after the cheap checks
(`rpk.assembly.inputs`) and before the slow starts (`rpk.assembly.start`).

Each builder takes its own config section, the settings record made of it
(`rpk.assembly.settings`), or the records of the `PartsPlan`; only `plan_parts` and
`trainer_plan` read the whole config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from rpk.assembly.box import (
    Box,
    Colocation,
    TrainerChoices,
    box_for,
    colocation,
    engine_settings,
    judge_plan,
    trainer_choices,
    weight_path,
)
from rpk.assembly.inputs import Log, Placement
from rpk.assembly.settings import (
    ToolTiming,
    canary_settings,
    copy_fields,
    eval_spec,
    hybrid_settings,
    lora_settings,
    reward_settings,
    speculation,
    trainer_settings,
)
from rpk.cluster import nodes
from rpk.cluster.remote import client_ssl
from rpk.config import Config, ConfigError
from rpk.config.execution import DistConfig, RolloutConfig, TrainConfig
from rpk.config.inputs import RewardConfig
from rpk.core.backoff import Backoff
from rpk.core.modes import StreamMode
from rpk.core.protocols import Lending
from rpk.core.records import Prompt
from rpk.engine.fleet import Fleet, Rest
from rpk.engine.placement import FleetPlan, replica_devices
from rpk.engine.vllm_fleet import Switch, launch_fleet
from rpk.engine.vllm_settings import VLLMSettings
from rpk.gpu.device import trainer_device
from rpk.gpu.launch import Joined, Sharding
from rpk.gpu.plan import explain
from rpk.gpu.streams import side_stream_init
from rpk.judge.pool import JudgePlan
from rpk.loop.evaluate import EvalSpec
from rpk.loop.feed import Streaming, can_borrow
from rpk.loop.trainer import AsyncTrainer
from rpk.reward import RewardStack, make_scorer, remote, resolve_rewards
from rpk.reward.canary import CanarySet
from rpk.reward.code import CodeScorer
from rpk.reward.functions import split_judge_term
from rpk.reward.group import GROUPS
from rpk.reward.hybrid import MODES, HybridSettings
from rpk.reward.judge import JudgeScorer, JudgeSettings, is_judged
from rpk.reward.rubric import check_rubric_template, criteria_of
from rpk.reward.stack import judged_stack
from rpk.sched.borrow import BorrowRule
from rpk.sched.policies import PolicyOptions, make_policy
from rpk.sched.policy import Policy, Sampling
from rpk.sched.provision import EtaBounds
from rpk.sched.tp_planner import PlannerConfig, PlannerMode
from rpk.sync.backends import BACKENDS, Backend, TrainerEnd, UnverifiableError, WeightPath, check_verifiable
from rpk.sync.cpu_ipc import share_weights
from rpk.sync.m2n_lane import TrainerShards
from rpk.sync.verify import VerifiedTransport
from rpk.train.dist import DistTrainer
from rpk.train.lora import LoraSettings, adapter_config
from rpk.train.losses import advantage_fn
from rpk.train.trainer import TorchTrainer, TrainerSettings


def build_round_policy(
    rollout: RolloutConfig, prompts: Sequence[Prompt], *, seed: int = 0, shuffle: bool = True,
    tools: ToolTiming | None = None,
) -> Policy:
    """`rollout.policy` over `prompts`, seeded by `run.seed` and shuffled per
    `data.shuffle`; `tools`: a multi-turn run's tool calls, which length_aware prices."""
    r = rollout
    if len(prompts) < r.prompts_per_step:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} but the dataset has only "
            f"{len(prompts)} prompts"
        )
    sampling = copy_fields(Sampling, r, seed=seed, drop_zero_variance=r.dynamic_sampling)
    options = PolicyOptions(
        eta_prompts=r.eta_prompts,
        eta_responses=r.eta_responses,
        shuffle=shuffle,
        lookahead_rounds=r.lookahead_rounds,
        adaptive_eta=r.adaptive_eta,
        eta_bounds=EtaBounds(
            (r.eta_prompts_min, r.eta_prompts_max), (r.eta_responses_min, r.eta_responses_max)
        ),
        concurrency=r.max_num_seqs,
        tool_latency=tools.latency if tools is not None else None,
        tool_timeout_s=tools.timeout_s if tools is not None else None,
        **_spec_options(r),
    )
    return make_policy(r.policy, prompts, sampling, options)


def _spec_options(r: RolloutConfig) -> dict[str, Any]:
    spec = speculation(r)
    if spec is None:
        return {}
    choice, rule = spec
    return {"spec_sources": choice.sources, "spec_rule": rule}


def build_scorer(
    reward: RewardConfig, judge: JudgeSettings, prompts: Sequence[Prompt], max_tokens: int,
    code: CodeScorer | None = None, seed: int = 0,
) -> RewardStack:
    """Checked before the engine starts: a missing reward, a function that veRL could not
    call, or a missing token fails in seconds. Judged rows (`judge`'s, the
    `rpk.assembly.settings.judge_settings` of `reward.judge`) need no rule reward; the
    judge's engine starts later, in `start_parts`. `max_tokens`: `rollout.max_tokens`,
    which overlong shaping reads; `code`: the run's code sandbox (None: one of its own);
    `seed`: `run.seed`, which the canaries and the hybrid draws take."""
    rw, settings = reward, reward_settings(reward)
    term, rule_terms = split_judge_term(rw.functions)
    hybrid = hybrid_settings(rw.judge, term, seed)
    judged_rows = [p for p in prompts if is_judged(p, judge.data_sources)]
    judged = {p.uid for p in judged_rows}
    scorer = None
    if term is not None and not judged:
        raise ConfigError(
            f"reward.functions {list(rw.functions)} has a judge term but no row is judged: set "
            "reward.judge.data_sources, or mark rows reward_model.style: model",
            "reward.functions",
        )
    if judged:
        if judge.model is None and reward.judge.url is None:
            some = judged_rows[0]
            raise ConfigError(
                f"{len(judged)} rows are judged (the first: {some.uid}, data_source "
                f"{some.data_source!r}, reward_model.style {some.reward_style!r}) but no judge "
                "is set", "reward.judge.model",
            )
        check_judging(judge, hybrid, judged_rows)
        scorer = JudgeScorer(judge)
    # compare_rules, and the modes that combine them: judged rows keep a rule reward too.
    both = judge.compare_rules or MODES[hybrid.mode].needs_rule
    ruled = [p for p in prompts if p.uid not in judged or both]
    canaries = CanarySet(judged_rows, judge.yes, seed) if judged and rw.judge.canaries else None
    extra: dict[str, Any] = dict(hybrid=hybrid, canaries=canaries, canary=canary_settings(rw.judge))
    if rw.url is not None:
        # The service picks the function per data source; the run cannot check it here.
        # A token variable the environment lacks is a RewardError now, not at the first call.
        service = remote.HTTPScorer(
            rw.url, token=remote.read_token(rw.token_env), timeout_s=rw.timeout_s,
            max_concurrency=rw.max_concurrency, batch_size=rw.batch_size, linger_ms=rw.linger_ms,
            retry=Backoff(limit=rw.retries, backoff_s=rw.backoff_s, max_backoff_s=max(30.0, rw.backoff_s)),
        )
        return judged_stack(
            settings, service, lambda data_source: f"the reward service {rw.url}",
            remote.FAILURE_KINDS, scorer, max_tokens=max_tokens,
            ruled=None if judge.compare_rules else frozenset(), **extra,
        )
    functions = resolve_rewards(rw.function, {p.data_source for p in ruled}, rule_terms) if ruled else {}
    return make_scorer(settings, functions, max_tokens=max_tokens, judge=scorer, code=code, **extra)


def check_judging(settings: JudgeSettings, hybrid: HybridSettings, judged: Sequence[Prompt]) -> None:
    """Before any engine starts: the rubric template, every judged row's rubric, and
    that a judge that reads no grading prompt (a reward model) judges no group and no
    rubric, nor group judging a rubric."""
    check_rubric_template(hybrid.rubric.template)
    if settings.kind.conversation and GROUPS[hybrid.group].grouped:
        raise ConfigError(f"group judging ({hybrid.group}) needs a judge that reads a prompt, not "
                          f"a {settings.verdict} reward model", "reward.judge.group")
    with_rubric = [p for p in judged if criteria_of(p)]
    if not with_rubric:
        return
    p = with_rubric[0]
    if settings.kind.conversation:
        raise ConfigError(f"{len(with_rubric)} judged rows have a rubric (the first: {p.uid}) but a "
                          "classify reward model reads no criterion", "reward.judge.verdict")
    if GROUPS[hybrid.group].grouped:
        raise ConfigError(f"{len(with_rubric)} judged rows have a rubric (the first: {p.uid}): "
                          f"group judging ({hybrid.group}) asks about whole answers, not criteria",
                          "reward.judge.group")


def model_context_length(model_dir: Path) -> int:
    hf = json.loads((model_dir / "config.json").read_text())
    return int(hf.get("max_position_embeddings") or hf.get("max_sequence_length") or 2048)


def check_lengths(rollout: RolloutConfig, model_dir: Path, prompts: Sequence[Prompt]) -> int:
    """The engine's context length, checked against the longest prompt + max_tokens."""
    limit = rollout.max_model_len or model_context_length(model_dir)
    longest = max(len(p.token_ids) for p in prompts)
    if longest + rollout.max_tokens > limit:
        raise ConfigError(
            f"rollout.max_tokens={rollout.max_tokens} plus the longest prompt "
            f"({longest} tokens) exceeds the context length {limit}"
        )
    return limit


def start_node_host(dist: DistConfig, node: int) -> nodes.NodeHost:
    """On a follower that is local rank 0 of engine node `node` > 0: its engine host,
    started from the controller's spec (`rpk.cluster.nodes`). Blocking."""
    # The spec comes once the controller has its model and prompts (minutes when it
    # builds the tiny model first); the follower would be waiting for commands anyway.
    return nodes.NodeHost.start(nodes.default_store(), node, timedelta(days=7), dist.engine_start_timeout_s)


@dataclass(frozen=True, slots=True)
class FleetStart:
    """What starting the fleet reads beside the plan's box and weight path: the
    `rollout.tp_switch`, `run.verify_sync`, a LoRA run's adapter config (which every
    sync's adapter carries), and for the other engine nodes the `dist` section, the
    run's directory (where their token file goes) and the rollout's devices."""

    switch: Switch
    verify: bool
    adapter: dict[str, Any] | None
    dist: DistConfig
    out_dir: Path
    devices: tuple[int, ...]


async def start_engine(
    model_dir: Path, parts: PartsPlan, version: int, log: Log,
    trainer: Awaitable[AsyncTrainer] | None = None, rest: Rest | None = None,
) -> Fleet:
    """The rollout fleet: every layout of the plan's fleet (one unpinned replica by
    default; on CUDA the memory plan's layouts, `rpk.assembly.box`), serving the model as
    weight version `version`; in a run over several nodes, every engine node's replicas
    (and where the plan puts the judge on the GPUs, every node's judge engines).
    `trainer`: the sharded trainer being loaded, which an m2n weight path sends from;
    `rest`: how the fleet shares its devices with the trainer (colocated)."""
    box, settings, weights, start = parts.box, parts.engine, parts.weights, parts.fleet_start
    if box.memory is not None:
        log(explain.table(box.memory))
    plan, platform = parts.placement.fleet, box.platform
    if weights.note:
        log(weights.note)
    if weights.adapter and start.adapter is not None:
        log(f"weights: LoRA rank {start.adapter['r']}, each sync a new adapter version (PEFT files)")
    shards = TrainerShards(trainer) if weights.sends_shards and trainer is not None else None
    if weights.sends_shards:
        if start.verify:
            try:
                check_verifiable(weights.local)
            except UnverifiableError as e:
                raise ConfigError(f"true: {e}", "run.verify_sync") from None
        log(f"weights: {weights.local}, every trainer rank sends its own shards")

    async def start_local() -> Fleet:
        return await launch_fleet(
            settings, plan, platform=platform, backend=weights.local, switch=start.switch,
            version=version, log=log, verify=start.verify, shards=shards, adapter=start.adapter, rest=rest,
        )

    engine_nodes = parts.placement.engine_nodes
    if engine_nodes == (0,):
        return await start_local()
    judges = parts.judge if parts.judge is not None and parts.judge.device is not None else None
    return await start_nodes(start, model_dir, settings, plan, weights.remote, version, log, engine_nodes,
                             start_local, rest, judges.to_json() if judges is not None else "")


async def start_nodes(
    start: FleetStart, model_dir: Path, settings: VLLMSettings, plan: FleetPlan, remote_backend: Backend,
    version: int, log: Log, engine_nodes: tuple[int, ...], start_local: Callable[[], Awaitable[Fleet]],
    rest: Rest | None = None, judge: str = "",
) -> Fleet:
    """The fleet over every engine node: node 0's replicas (`start_local`) and the other
    nodes' hosts, weights by the `remote_backend` (over gloo, the HTTP fallback, or a
    LoRA run's adapters uploaded to each host), the hosts' token out of the rendezvous
    store, TLS where `dist.tls_cert` is set (`rpk.cluster.nodes`); `judge`: the judge
    engines each host starts on its rollout GPUs (`JudgePlan` JSON)."""
    d = start.dist
    token, token_file = nodes.run_token(start.out_dir)
    engine = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("model", "backend")}
    spec = nodes.EngineSpec(str(model_dir), engine, plan.tp_sizes, plan.tp, start.devices,
                            version, str(token_file or ""), remote_backend, start.verify,
                            d.tls_cert, d.tls_key, judge, start.adapter)
    transport = nodes.node_transport(remote_backend, nodes.advertised_address(), start.adapter)
    log(f"weights to the other nodes' replicas: {nodes.REMOTE_PATHS[remote_backend]}")
    try:
        return await nodes.launch_nodes(
            spec, token, engine_nodes, nodes.default_store(), start_local=start_local,
            timeout_s=d.engine_start_timeout_s, log=log, tls=client_ssl(d.tls_ca) if d.tls_cert else None,
            transport=VerifiedTransport(transport) if start.verify else transport, rest=rest,
        )
    finally:
        if token_file is not None:  # every host has read it (or the start failed)
            token_file.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class TrainerPlan:
    """What a rank's torch trainer is made from: the `train` section's settings, what it
    needs of the sampler (`rollout.max_tokens`, `rollout.temperature`), `run.seed`,
    `train.device`, the memory plan's choices, a LoRA run's adapters, and the weight
    path (an unsharded CPU trainer's parameters are shared for `cpu_ipc`)."""

    settings: TrainerSettings
    max_response_tokens: int
    temperature: float
    seed: int
    device: str
    choices: TrainerChoices
    adapters: LoraSettings | None = None
    weights: WeightPath | None = None


def trainer_plan(cfg: Config, box: Box, weights: WeightPath | None = None) -> TrainerPlan:
    lora = lora_settings(cfg.model)
    return TrainerPlan(
        trainer_settings(cfg.train, lora is not None), cfg.rollout.max_tokens, cfg.rollout.temperature,
        cfg.run.seed, cfg.train.device, trainer_choices(cfg, box), lora, weights,
    )


def make_torch_trainer(plan: TrainerPlan, model_dir: Path, sharding: Sharding | None = None) -> TorchTrainer:
    """One rank's torch trainer (`sharding`: its shard; None: the only one). Blocking:
    it loads the model."""
    device, choices = trainer_device(plan.device), plan.choices
    trainer = TorchTrainer(
        model_dir, plan.settings, max_response_tokens=plan.max_response_tokens,
        temperature=plan.temperature, seed=plan.seed, device=device, sharding=sharding,
        defer_reduction=choices.defer_reduction, dtype=choices.dtype, adapters=plan.adapters,
    )
    weights = plan.weights
    if (sharding is None and device == "cpu" and weights is not None
            and BACKENDS[weights.local].trainer_end is TrainerEnd.HOST_IPC):
        # cpu_ipc then hands the replicas its parameters where they lie: one copy a sync.
        share_weights(trainer.model)
    return trainer


def build_trainer(plan: TrainerPlan, model_dir: Path, joined: Joined | None = None) -> AsyncTrainer:
    """The trainer on its own thread (and, on GPU, its own CUDA stream): the torch
    trainer, or in a multi-process run the `DistTrainer` that drives every rank's shard
    (`joined`: this rank's `rpk.gpu.launch.Joined`). Blocking: it loads the model."""
    trainer: TorchTrainer | DistTrainer
    if joined is None:
        trainer = make_torch_trainer(plan, model_dir)
    else:
        sharding = joined.sharding

        def make(directory: str) -> TorchTrainer:
            return make_torch_trainer(plan, Path(directory), sharding)

        trainer = DistTrainer(joined.channel, make, str(model_dir))
    return AsyncTrainer(trainer, thread_init=side_stream_init(trainer_device(plan.device)))


def build_streaming(
    train: TrainConfig, engine: Lending | None = None, log: Log | None = None,
    placement: Placement | None = None, box: Box | None = None,
) -> Streaming:
    """The `train` section's streaming, or the one `box`'s memory plan fits (on CUDA);
    borrow on an engine that cannot lend (one replica) falls back to thread, said once
    in `log`. Borrowing with a sharded trainer (several processes in
    `placement.layout`) trains on the lent replicas' ranks alone where they make whole
    HSDP replicate groups (`ParallelLayout.ranks_on`); elsewhere every rank computes,
    said once."""
    t = train
    mode = StreamMode(t.stream_mode)
    planned = box.stream_mode if box is not None else None
    if planned is not None and planned is not mode:
        if log is not None:
            log(f"train.stream_mode {mode.value}: the memory plan fits no training beside the "
                f"tail on these GPUs; training after each round instead")
        mode = planned
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
    engine: VLLMSettings  # what every replica starts from
    colocation: Colocation | None  # how rollout and training share the devices
    planner: PlannerConfig  # elastic TP between rounds
    advantages: Callable[[Sequence[float]], list[float]]  # the loss's
    eval_spec: EvalSpec
    weight_bucket_bytes: int
    weights: WeightPath  # how they reach the replicas, on this node and the others
    fleet_start: FleetStart
    trainer: TrainerPlan
    last_step: int  # `run.steps`: the TP planner's horizon
    judge: JudgePlan | None  # the judge's engines (None: no judge)


def plan_parts(
    cfg: Config, placement: Placement, model_dir: Path, prompts: Sequence[Prompt]
) -> PartsPlan:
    """The plan of the run's started parts. Blocking (it reads the model's config): on
    CUDA the memory plan, which reads the model's size, places the rollout and the
    trainer (`box`)."""
    r = cfg.rollout
    max_model_len = check_lengths(r, model_dir, prompts)
    box = box_for(cfg, model_dir)
    layout = placement.layout
    weights = weight_path(cfg, box, layout.world_size if layout is not None else 1)
    adapters = lora_settings(cfg.model)
    start = FleetStart(r.tp_switch, cfg.run.verify_sync,
                       adapter_config(adapters, model_dir) if adapters is not None else None,
                       cfg.dist, Path(cfg.run.out_dir), tuple(r.devices))
    return PartsPlan(
        box, dataclasses.replace(placement, fleet=box.fleet), max_model_len,
        engine_settings(cfg, str(model_dir), max_model_len, box), colocation(cfg, box),
        PlannerConfig(PlannerMode(r.tp), box.fleet.tp_sizes, box.fleet.tp),
        advantage_fn(cfg.train.loss), eval_spec(r, cfg.run), r.weight_bucket_mb * 2**20, weights, start,
        trainer_plan(cfg, box, weights), cfg.run.steps, judge_plan(cfg, box),
    )

