"""Config -> the settings records of the parts, one section (or the few fields a part
reads) at a time: the controller's (`rpk.controller.RunSettings`, with the
`fingerprint` a checkpoint must match), the trainer's (`rpk.train.trainer.
TrainerSettings`, `rpk.train.lora.LoraSettings`), the reward stack's
(`rpk.reward.RewardSettings`, with its sandbox's), the judge's and its tier's
(`rpk.judge.tier.TierSettings`), validation's
(`rpk.loop.evaluate.EvalSpec`), the tools' timing (`ToolTiming`) and where the prompts come
from (`PromptSource`), the last three with the judge's once in `PartsSettings`. A
part's record holds the fields it reads, under the config's names; the builders of
`rpk.assembly` take these records, never the whole `Config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rpk.config import Config
from rpk.config.cli import dump_yaml, to_dict
from rpk.config.execution import RolloutConfig, RunConfig, TrainConfig
from rpk.config.inputs import AgentConfig, DataConfig, JudgeConfig, ModelConfig, RewardConfig
from rpk.controller import RunSettings
from rpk.core.backoff import Backoff
from rpk.core.drafts import SPECULATIVE, SpecChoice, Speculative
from rpk.judge.limits import RateLimits
from rpk.judge.openai import EndpointSettings
from rpk.judge.tier import TierSettings
from rpk.judge.tiny import DEFAULT as TINY_JUDGE
from rpk.judge.tiny_recipe import judge_dir
from rpk.loop.evaluate import EvalSpec
from rpk.reward import RewardSettings
from rpk.reward.canary import CanarySettings
from rpk.reward.code import SandboxSettings
from rpk.reward.functions import JudgeTermSpec
from rpk.reward.group import GroupJudging
from rpk.reward.hybrid import Hybrid, HybridSettings
from rpk.reward.judge import DEFAULT_SYSTEM, DEFAULT_TEMPLATE, JudgeSettings
from rpk.reward.pool import PoolSettings, worker_memory_mb
from rpk.reward.rubric import RUBRIC_TEMPLATE, RubricSettings
from rpk.reward.sandbox import Limits
from rpk.reward.verdict import Verdict
from rpk.sched.speculate import SpecRule
from rpk.sched.toolwait import LatencyModel
from rpk.tasks import Task, task
from rpk.tasks.specs import ArithSpec
from rpk.tasks.tiny import cache_key
from rpk.train.lora import LoraSettings
from rpk.train.trainer import TrainerSettings

R = TypeVar("R")


def run_settings(cfg: Config) -> RunSettings:
    r = cfg.run
    return RunSettings(
        steps=r.steps, out_dir=Path(r.out_dir), resume=None if r.resume is None else Path(r.resume),
        verify_checkpoint=r.verify_checkpoint, checkpoint_every=r.checkpoint_every,
        keep_checkpoints=r.keep_checkpoints, eval_every=r.eval_every,
        eval_before_train=r.eval_before_train, samples_per_step=r.samples_per_step,
        show_samples=r.show_samples, trackers=r.trackers, project=r.project, name=r.name,
        max_failure_frac=cfg.reward.max_failure_frac, max_failure_steps=cfg.reward.max_failure_steps,
        heartbeat_s=cfg.dist.heartbeat_s, heartbeat_misses=cfg.dist.heartbeat_misses,
        fingerprint=fingerprint(cfg), config=to_dict(cfg), config_yaml=dump_yaml(cfg),
    )


def speculation(r: RolloutConfig) -> tuple[SpecChoice, SpecRule] | None:
    """`rollout.speculative`'s row and how it plans, None when off."""
    choice = SPECULATIVE[Speculative(r.speculative)]
    if choice.method is None:
        return None
    return choice, SpecRule(max_k=r.spec_max_k, min_gain=r.spec_min_gain, adaptive=r.spec_adaptive)


def fingerprint(cfg: Config) -> dict[str, Any]:
    """The settings a checkpoint's state only makes sense under: the policy's queue and
    the data cursor index one dataset in one seeded order; the weights belong to one
    model. Config alone, nothing loaded."""
    builtin = task(cfg.data.task)
    if cfg.model.path is not None:
        model = str(Path(cfg.model.path).resolve())
    else:
        model = f"tiny-{cache_key(builtin.tiny_spec(cfg.model), builtin.tiny_recipe())}"
    data = (
        ",".join(str(Path(f).resolve()) for f in cfg.data.train_files)
        if cfg.data.train_files
        else f"{builtin.fingerprint_words}, {cfg.data.builtin_size} prompts"
    )
    m = cfg.model
    # A LoRA checkpoint holds an adapter, a full one a model: neither resumes the other.
    lora = f"rank {m.lora_rank}, alpha {m.lora_alpha}, targets {','.join(m.lora_targets)}" if m.lora_rank else "off"
    return {
        "model.lora": lora,
        "rollout.policy": cfg.rollout.policy,
        "rollout.prompts_per_step": cfg.rollout.prompts_per_step,
        "rollout.responses_per_prompt": cfg.rollout.responses_per_prompt,
        "data.train_files": data,
        "data.shuffle": cfg.data.shuffle,
        "run.seed": cfg.run.seed,
        "model": model,
    }


def trainer_settings(train: TrainConfig, lora: bool) -> TrainerSettings:
    """The trainer's part of the `train` section (`lora`: LoRA's learning rate)."""
    return copy_fields(TrainerSettings, train, lr=train.lora_lr if lora else train.lr)


def lora_settings(model: ModelConfig) -> LoraSettings | None:
    """The LoRA adapters of `model.lora_*`, or None for full fine-tuning."""
    if not model.lora_rank:
        return None
    return LoraSettings(rank=model.lora_rank, alpha=model.lora_alpha, targets=tuple(model.lora_targets),
                        dropout=model.lora_dropout)


def reward_settings(reward: RewardConfig) -> RewardSettings:
    """The reward stack's part of the `reward` section, its pool's and sandbox's included;
    `reward.worker_memory_mb` 0 is a worker's share of the machine (`worker_memory_mb`)."""
    pool = PoolSettings(
        timeout_s=reward.timeout_s, min_workers=reward.min_workers, max_workers=reward.max_workers,
        idle_s=reward.idle_s, memory_mb=reward.worker_memory_mb or worker_memory_mb(reward.max_workers),
    )
    return copy_fields(RewardSettings, reward, pool=pool, sandbox=copy_fields(
        SandboxSettings, reward.sandbox, limits=copy_fields(Limits, reward.sandbox)))


def judge_settings(judge: JudgeConfig, judged: bool = False, tiny_dir: Path | None = None) -> JudgeSettings:
    """The judge's settings: the `reward.judge` section, its empty template and unset
    system message meaning the built-in ones. `judged`: the run trains on the judged
    built-in task, which always checks its judged rows with the rule too (their
    agreement is what it reports); `tiny_dir`: rpk's tiny judge, which judges it when no
    judge is set, with the prompt that judge learnt
    (`rpk.judge.tiny.DEFAULT`: the response from its final answer line on, then the
    reference; no system message; the reason verdict with its scratchpad's length and
    marker, whatever `reward.judge.verdict` says)."""
    given: dict[str, Any] = {"data_sources": tuple(judge.data_sources), "verdict": Verdict(judge.verdict)}
    given["template"] = judge.template or DEFAULT_TEMPLATE
    given["system"] = DEFAULT_SYSTEM if judge.system is None else judge.system
    if judged:
        given["compare_rules"] = True
    if tiny_dir is not None:
        given["model"] = str(tiny_dir)
        given["system"] = TINY_JUDGE.system if judge.system is None else judge.system
        given["template"] = judge.template or TINY_JUDGE.template
        given["max_response_chars"] = TINY_JUDGE.max_response_chars
        given["response_after"] = TINY_JUDGE.response_after
        # It writes a scratchpad, then the marker and its verdict word: only the reason
        # verdict reads it where it learnt to answer (its first token is a scratchpad's),
        # with the budget its longest scratchpad needs (more would run past its context).
        given["verdict"] = TINY_JUDGE.verdict
        given["reason_tokens"] = TINY_JUDGE.reason_tokens
        given["verdict_marker"] = TINY_JUDGE.verdict_marker
    return copy_fields(JudgeSettings, judge, **given)


def judge_tier(j: JudgeConfig) -> TierSettings:
    """The judge tier's settings (`reward.judge`): restarts, the verdict cache, the
    external endpoint."""
    endpoint = None
    if j.url is not None:
        retry = Backoff(j.retries, j.backoff_s, max(30.0, j.backoff_s))
        endpoint = EndpointSettings(j.url, j.model, j.api_key_env, RateLimits(j.rpm, j.tpm), retry,
                                    top_logprobs=j.top_logprobs)
    return TierSettings(Backoff(j.restarts, j.restart_backoff_s, max(60.0, j.restart_backoff_s)),
                        j.cache_size if j.cache else 0, endpoint)


def hybrid_settings(judge: JudgeConfig, term: JudgeTermSpec | None, seed: int = 0) -> HybridSettings:
    """How judged rows combine the judge and the rule: weighted by the judge's term of
    `reward.functions` (`term`, `split_judge_term`'s) when there is one, else as
    `reward.judge.mode` says; the rubric requests' template and system message (none
    for a judge run without one), and the group judging; `seed`: `run.seed`."""
    rubric = RubricSettings(template=judge.rubric_template or RUBRIC_TEMPLATE)
    common = dict(rubric=rubric, group=GroupJudging(judge.group), seed=seed)
    if term is not None:
        return HybridSettings(Hybrid.WEIGHTED, term.weight, term.first, **common)
    return HybridSettings(Hybrid(judge.mode), **common)


def canary_settings(judge: JudgeConfig) -> CanarySettings:
    return CanarySettings(per_step=judge.canaries, margin=judge.canary_margin)


def tiny_judge_dir(model: ModelConfig) -> Path:
    """Where rpk's tiny judge of `model.tiny_judge` is built, in the model cache."""
    return judge_dir(model.tiny_judge, Path(model.cache_dir))


def eval_spec(rollout: RolloutConfig, run: RunConfig) -> EvalSpec:
    """Validation's sampling: `run.eval_k` responses a prompt, as the rollout samples them."""
    return EvalSpec(k=run.eval_k, max_tokens=rollout.max_tokens, temperature=rollout.temperature,
                    top_p=rollout.top_p, seed=run.seed)


def uses_task_tools(agent: AgentConfig, builtin: Task) -> bool:
    """The run's tools are the built-in task's: a multi-turn task, and neither
    `agent.tools` nor `agent.env` set."""
    return not agent.tools and agent.env is None and builtin.multi_turn


def task_tool_latency(agent: AgentConfig, builtin: Task) -> LatencyModel | None:
    """The latency the built-in task's tool answers after (`agent.tool_latency`), which
    length_aware's provisioning prices too; None where the run's tools are not the
    task's (their latency is learnt from the rounds) or `median_s` is 0 (they answer
    at once)."""
    lat = agent.tool_latency
    if not uses_task_tools(agent, builtin) or lat.median_s == 0:
        return None
    return LatencyModel(lat.median_s, lat.p99_s, lat.timeout_frac)


@dataclass(frozen=True, slots=True)
class ToolTiming:
    """What length_aware's provisioning knows of a multi-turn run's tool calls: the
    timeout that ends one (`agent.tool_timeout_s`) and, for the built-in task's tool,
    its latency (other tools' is learnt from the rounds)."""

    timeout_s: float
    latency: LatencyModel | None = None


@dataclass(frozen=True, slots=True)
class PromptSource:
    """Where a run's prompts come from: the `data` section's files, else its built-in
    task's rows (`task`), drawn as its tiny model learnt them (`problems`) from the run's
    `seed`."""

    data: DataConfig
    task: Task
    problems: ArithSpec
    seed: int


@dataclass(frozen=True, slots=True)
class PartsSettings:
    """The records that span sections, made from the config once (`parts_settings`) for
    the builders that take them: where the prompts come from (its `task` the built-in
    task's record), the judge's settings and whether it is rpk's tiny judge, and a
    multi-turn run's tool timing (None: single-turn)."""

    prompts: PromptSource
    judge: JudgeSettings
    tiny_judge: bool
    tools: ToolTiming | None

    @property
    def task(self) -> Task:
        return self.prompts.task


def parts_settings(cfg: Config) -> PartsSettings:
    builtin = task(cfg.data.task)
    return PartsSettings(
        PromptSource(cfg.data, builtin, builtin.tiny_spec(cfg.model).task, cfg.run.seed),
        run_judge_settings(cfg), uses_tiny_judge(cfg),
        ToolTiming(cfg.agent.tool_timeout_s, task_tool_latency(cfg.agent, builtin)) if cfg.multi_turn else None,
    )


def judged_task(cfg: Config) -> bool:
    """The run trains on the judged built-in task's rows."""
    return task(cfg.data.task).judged and not cfg.data.train_files


def uses_tiny_judge(cfg: Config) -> bool:
    """The judged built-in task with no judge set: rpk builds and starts its tiny judge."""
    return judged_task(cfg) and cfg.reward.judge.model is None and cfg.reward.judge.url is None


def prompt_source(cfg: Config) -> PromptSource:
    return parts_settings(cfg).prompts


def run_judge_settings(cfg: Config) -> JudgeSettings:
    """The run's judge: `judge_settings` for its `reward.judge` section, its task and,
    where it uses rpk's tiny judge, that judge's directory in the model cache."""
    tiny = tiny_judge_dir(cfg.model) if uses_tiny_judge(cfg) else None
    return judge_settings(cfg.reward.judge, judged_task(cfg), tiny)


def tool_timing(cfg: Config) -> ToolTiming | None:
    """The run's `ToolTiming`; None for a single-turn run."""
    return parts_settings(cfg).tools


def copy_fields(kind: type[R], section: Any, **given: Any) -> R:
    """`kind` from the config section's fields of the same names, `given` for the rest."""
    names = [f.name for f in dataclasses.fields(kind) if f.name not in given]
    return kind(**{name: getattr(section, name) for name in names}, **given)
