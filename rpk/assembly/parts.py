"""The run's parts from its config: the round policy, the reward scorer, the rollout
fleet (one node's replicas or every engine node's), the trainer and the streaming; and
`plan_parts`, what the started parts are made from, worked out once after the cheap
checks (`rpk.assembly.inputs`) and before the slow starts (`rpk.assembly.start`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from rpk.assembly.box import Box, Colocation, colocation, judge_plan, trainer_choices, weight_path
from rpk.assembly.inputs import Log, Placement, eval_spec
from rpk.assembly.settings import (
    canary_settings, hybrid_settings, judge_settings, lora_settings, reward_settings, trainer_settings,
)
from rpk.config import Config, ConfigError
from rpk.core.modes import StreamMode
from rpk.core.protocols import Lending
from rpk.core.records import Prompt
from rpk.engine.fleet import Fleet, Rest
from rpk.engine.placement import replica_devices
from rpk.loop.evaluate import EvalSpec
from rpk.loop.feed import Streaming, can_borrow
from rpk.loop.trainer import AsyncTrainer
from rpk.reward import RewardStack, make_scorer, resolve
from rpk.reward.code import CodeScorer
from rpk.judge.pool import JudgePlan
from rpk.reward.canary import CanarySet
from rpk.reward.functions import split_judge_term
from rpk.reward.group import GROUPS
from rpk.reward.hybrid import MODES, HybridSettings
from rpk.reward.judge import JudgeScorer, check_template, is_judged
from rpk.reward.rubric import check_rubric_template, criteria_of
from rpk.reward.stack import judged_stack
from rpk.reward import remote
from rpk.sched.borrow import BorrowRule
from rpk.sched.policy import Policy, PolicyOptions, Sampling, make_policy
from rpk.sched.provision import EtaBounds
from rpk.sched.toolwait import CallLatency
from rpk.sched.tp_planner import PlannerConfig, PlannerMode
from rpk.train.losses import advantage_fn


def build_round_policy(cfg: Config, prompts: Sequence[Prompt]) -> Policy:
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
        tool_latency=_call_latency(cfg),
        tool_timeout_s=cfg.agent.tool_timeout_s if cfg.multi_turn else None,
    )
    return make_policy(r.policy, prompts, sampling, options)


def _call_latency(cfg: Config) -> CallLatency | None:
    """The latency of the built-in task's tool (`agent.tool_latency`, its calls that
    never answer ending at agent.tool_timeout_s), which length_aware's provisioning
    prices; None for other tools and environments: their latency is learnt from the
    rounds."""
    a = cfg.agent
    if not cfg.multi_turn or a.tools or a.env is not None:
        return None
    lat = a.tool_latency
    return CallLatency.from_model(lat.median_s, lat.p99_s, lat.timeout_frac, a.tool_timeout_s)


def build_scorer(cfg: Config, prompts: Sequence[Prompt], code: CodeScorer | None = None) -> RewardStack:
    """Checked before the engine starts: a missing reward, a function that veRL could not
    call, or a missing token fails in seconds. Judged rows (`reward.judge`) need no rule
    reward; the judge's engine starts later, in `start_parts`. `code`: the run's code sandbox
    (None: one of its own)."""
    rw, settings = cfg.reward, reward_settings(cfg)
    judge_cfg = judge_settings(cfg)
    term, rule_terms = split_judge_term(rw.functions)
    hybrid = hybrid_settings(cfg, term)
    judged_rows = [p for p in prompts if is_judged(p, judge_cfg.data_sources)]
    judged = {p.uid for p in judged_rows}
    judge = None
    if term is not None and not judged:
        raise ConfigError(
            f"reward.functions {list(rw.functions)} has a judge term but no row is judged: set "
            "reward.judge.data_sources, or mark rows reward_model.style: model",
            "reward.functions",
        )
    if judged:
        if judge_cfg.model is None and cfg.reward.judge.url is None:
            some = judged_rows[0]
            raise ConfigError(
                f"{len(judged)} rows are judged (the first: {some.uid}, data_source "
                f"{some.data_source!r}, reward_model.style {some.reward_style!r}) but no judge "
                "is set", "reward.judge.model",
            )
        check_template(judge_cfg.template)
        check_rubrics(cfg, hybrid, judged_rows)
        judge = JudgeScorer(judge_cfg)
    # compare_rules, and the modes that combine them: judged rows keep a rule reward too.
    both = judge_cfg.compare_rules or MODES[hybrid.mode].needs_rule
    ruled = [p for p in prompts if p.uid not in judged or both]
    canaries = (CanarySet(judged_rows, judge_cfg.yes, cfg.run.seed)
                if judged and cfg.reward.judge.canaries else None)
    extra: dict[str, Any] = dict(hybrid=hybrid, canaries=canaries, canary=canary_settings(cfg))
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
            ruled=None if judge_cfg.compare_rules else frozenset(), **extra,
        )
    functions = resolve(rw.function, {p.data_source for p in ruled}, rule_terms) if ruled else {}
    return make_scorer(settings, functions, max_tokens=max_tokens, judge=judge, code=code, **extra)


def check_rubrics(cfg: Config, hybrid: HybridSettings, judged: Sequence[Prompt]) -> None:
    """Before any engine starts: the rubric template, every judged row's rubric, and
    that a judge that reads no prompt, or group judging, meets no rubric."""
    if cfg.reward.judge.rubric_template:
        check_rubric_template(hybrid.rubric.template)
    with_rubric = [p for p in judged if criteria_of(p)]
    if not with_rubric:
        return
    p = with_rubric[0]
    if cfg.reward.judge.verdict == "classify":
        raise ConfigError(f"{len(with_rubric)} judged rows have a rubric (the first: {p.uid}) but a "
                          "classify reward model reads no criterion", "reward.judge.verdict")
    if GROUPS[hybrid.group].grouped:
        raise ConfigError(f"{len(with_rubric)} judged rows have a rubric (the first: {p.uid}): "
                          f"group judging ({hybrid.group}) asks about whole answers, not criteria",
                          "reward.judge.group")


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
    trainer: Awaitable[AsyncTrainer] | None = None, rest: Rest | None = None,
) -> Fleet:
    """The rollout fleet: every layout of the plan's fleet (one unpinned replica by
    default; on CUDA the memory plan's layouts, `rpk.assembly.box`), serving the model as
    weight version `version`; in a run over several nodes, every engine node's replicas
    (and where the plan puts the judge on the GPUs, every node's judge engines).
    `trainer`: the sharded trainer being loaded, which an m2n weight path sends from;
    `rest`: how the fleet shares its devices with the trainer (colocated)."""
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.gpu.plan import explain
    from rpk.sync.backends import UnverifiableError, check_verifiable, sends_shards
    from rpk.sync.m2n_lane import TrainerShards

    r, box, settings = cfg.rollout, parts.box, parts.engine
    if box.memory is not None:
        log(explain.table(box.memory))
    plan, platform = parts.placement.fleet, box.platform
    layout = parts.placement.layout
    backend, fallback = weight_path(cfg, box, layout.world_size if layout is not None else 1)
    if fallback:
        log(fallback)
    adapter = lora_adapter(cfg, model_dir)
    if adapter is not None:
        log(f"weights: LoRA rank {cfg.model.lora_rank}, each sync a new adapter version (PEFT files)")
    shards = TrainerShards(trainer) if sends_shards(backend) and trainer is not None else None
    if sends_shards(backend):
        if cfg.run.verify_sync:
            try:
                check_verifiable(backend)
            except UnverifiableError as e:
                raise ConfigError(f"true: {e}", "run.verify_sync") from None
        log(f"weights: {backend}, every trainer rank sends its own shards")

    async def start_local() -> Fleet:
        return await launch_fleet(
            settings, plan, platform=platform, backend=backend, switch=r.tp_switch,
            version=version, log=log, verify=cfg.run.verify_sync, shards=shards, adapter=adapter, rest=rest,
        )

    nodes = parts.placement.engine_nodes
    if nodes == (0,):
        return await start_local()
    judges = parts.judge if parts.judge is not None and parts.judge.device is not None else None
    return await start_nodes(cfg, model_dir, settings, plan, platform, version, log, nodes, start_local,
                             adapter, rest, judges.to_json() if judges is not None else "")


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
    rest: Rest | None = None, judge: str = "",
) -> Fleet:
    """The fleet over every engine node: node 0's replicas (`start_local`) and the other
    nodes' hosts, weights over gloo (or the HTTP fallback), the hosts' token out of the
    rendezvous store, TLS where `dist.tls_cert` is set (`rpk.cluster.nodes`). `adapter`:
    a LoRA run's, whose versions are uploaded to each host (`RemoteReplica.load_adapter`);
    `judge`: the judge engines each host starts on its rollout GPUs (`JudgePlan` JSON)."""
    from rpk.cluster import nodes as n
    from rpk.cluster.remote import client_ssl
    from rpk.sync import backends
    from rpk.sync.adapter import AdapterTransport
    from rpk.sync.verify import VerifiedTransport

    d, remote = cfg.dist, backends.remote(cfg.rollout.weight_transfer, platform)
    if adapter is not None:
        remote = backends.Backend.SPOOL  # the hosts' replicas take adapters, never a weight-transfer engine
    token, token_file = n.run_token(Path(cfg.run.out_dir))
    engine = {k: v for k, v in dataclasses.asdict(settings).items() if k != "model"}
    spec = n.EngineSpec(str(model_dir), engine, plan.tp_sizes, plan.tp, tuple(cfg.rollout.devices),
                        version, str(token_file or ""), remote, cfg.run.verify_sync,
                        d.tls_cert, d.tls_key, judge)
    if adapter is not None:
        transport: Any = AdapterTransport(adapter)
        path = "LoRA adapters over HTTP"
    else:
        transport = n.node_transport(remote, n.advertised_address())
        path = "gloo" if remote is backends.Backend.GLOO else "HTTP uploads (the fallback)"
    log(f"weights to the other nodes' replicas: {path}")
    try:
        return await n.launch_nodes(
            spec, token, nodes, n.default_store(), start_local=start_local,
            timeout_s=d.engine_start_timeout_s, log=log, tls=client_ssl(d.tls_ca) if d.tls_cert else None,
            transport=VerifiedTransport(transport) if cfg.run.verify_sync else transport, rest=rest,
        )
    finally:
        if token_file is not None:  # every host has read it (or the start failed)
            token_file.unlink(missing_ok=True)


def make_torch_trainer(cfg: Config, model_dir: Path, box: Box, sharding: Any = None) -> Any:
    """One rank's torch trainer (the only one, unsharded), as `box` places it. Blocking:
    it loads the model."""
    from rpk.gpu.device import trainer_device
    from rpk.train.trainer import TorchTrainer

    device, choices = trainer_device(cfg.train.device), trainer_choices(cfg, box)
    trainer = TorchTrainer(
        model_dir,
        trainer_settings(cfg),
        max_response_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        device=device,
        sharding=sharding,
        defer_reduction=choices.defer_reduction,
        dtype=choices.dtype,
        adapters=lora_settings(cfg),
    )
    if sharding is None and device == "cpu" and not cfg.model.lora_rank:
        from rpk.engine.vllm_fleet import transfer_backend
        from rpk.sync.backends import BACKENDS, TrainerEnd

        backend = transfer_backend(cfg.rollout.weight_transfer, box.fleet, box.platform, 0)
        if BACKENDS[backend].trainer_end is TrainerEnd.SHM_IPC:
            from rpk.sync.cpu_ipc import share_weights

            # cpu_ipc then hands the replicas its parameters where they lie: one copy a sync.
            share_weights(trainer.model)
    return trainer


def build_trainer(cfg: Config, model_dir: Path, box: Box, joined: Any = None) -> AsyncTrainer:
    """The trainer on its own thread (and, on GPU, its own CUDA stream): the torch
    trainer, or in a multi-process run the `DistTrainer` that drives every rank's shard
    (`joined`: this rank's `rpk.gpu.launch.Joined`). Blocking: it loads the model."""
    from rpk.gpu.device import trainer_device
    from rpk.gpu.streams import side_stream_init

    if joined is None:
        trainer = make_torch_trainer(cfg, model_dir, box)
    else:
        from rpk.train.dist import DistTrainer

        def make(directory: str) -> Any:
            return make_torch_trainer(cfg, Path(directory), box, joined.sharding)

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
    engine: Any  # the `VLLMSettings` every replica starts from
    colocation: Colocation | None  # how rollout and training share the devices
    planner: PlannerConfig  # elastic TP between rounds
    advantages: Callable[[Sequence[float]], list[float]]  # the loss's
    eval_spec: EvalSpec
    weight_bucket_bytes: int
    judge: JudgePlan | None  # the judge's engines (None: no judge)


def plan_parts(
    cfg: Config, placement: Placement, model_dir: Path, prompts: Sequence[Prompt]
) -> PartsPlan:
    """The plan of the run's started parts. Blocking (it reads the model's config): on
    CUDA the memory plan, which reads the model's size, places the rollout and the
    trainer (`box`, handed to the trainer's builder)."""
    from rpk.assembly.box import box_for, engine_settings

    max_model_len = check_lengths(cfg, model_dir, prompts)
    box = box_for(cfg, model_dir)
    engine, colo = engine_settings(cfg, str(model_dir), max_model_len, box), colocation(cfg, box)
    return PartsPlan(
        box, dataclasses.replace(placement, fleet=box.fleet), max_model_len, engine, colo,
        PlannerConfig(PlannerMode(cfg.rollout.tp), box.fleet.tp_sizes, box.fleet.tp),
        advantage_fn(cfg.train.loss), eval_spec(cfg), cfg.rollout.weight_bucket_mb * 2**20,
        judge_plan(cfg, box),
    )
