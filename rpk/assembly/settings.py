"""Config -> the settings records of the parts that take no config: the controller's
(`RunSettings`, defined here, with the `fingerprint` a checkpoint must match), the
trainer's (`rpk.train.trainer.TrainerSettings`), the reward stack's
(`rpk.reward.RewardSettings`, with its sandbox's) and validation's (`EvalSpec`). A
part's record holds the fields it reads, under the config's names; `rpk.assembly` and
`rpk.run` hand them on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rpk.config.cli import dump_yaml, to_dict
from rpk.config import Config
from rpk.controller import RunSettings
from rpk.reward import RewardSettings
from rpk.reward.canary import CanarySettings
from rpk.reward.functions import JudgeTermSpec
from rpk.reward.group import GroupJudging
from rpk.reward.hybrid import Hybrid, HybridSettings
from rpk.reward.judge import DEFAULT_SYSTEM, DEFAULT_TEMPLATE, JudgeSettings
from rpk.reward.rubric import RUBRIC_TEMPLATE, RubricSettings
from rpk.judge.tiny import DEFAULT as TINY_JUDGE
from rpk.judge.tiny import judge_dir
from rpk.judge.limits import RateLimits
from rpk.judge.openai import EndpointSettings
from rpk.judge.pool import Restarts
from rpk.judge.tier import TierSettings
from rpk.loop.evaluate import EvalSpec
from rpk.reward.code import SandboxSettings
from rpk.reward.pool import PoolSettings, worker_memory_mb
from rpk.tasks import task

if TYPE_CHECKING:
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


def fingerprint(cfg: Config) -> dict[str, Any]:
    """The settings a checkpoint's state only makes sense under: the policy's queue and
    the data cursor index one dataset in one seeded order; the weights belong to one
    model. Config alone, nothing loaded."""
    builtin = task(cfg.data.task)
    if cfg.model.path is not None:
        model = str(Path(cfg.model.path).resolve())
    else:
        from rpk.tasks.tiny import cache_key

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


def trainer_settings(cfg: Config) -> TrainerSettings:
    """The trainer's part of the `train` section. Imports torch (the trainer's module)."""
    from rpk.train.trainer import TrainerSettings

    lr = cfg.train.lora_lr if cfg.model.lora_rank else cfg.train.lr
    return _copy(TrainerSettings, cfg.train, lr=lr)


def lora_settings(cfg: Config) -> LoraSettings | None:
    """The LoRA adapters of `model.lora_*`, or None for full fine-tuning. Imports peft."""
    if not cfg.model.lora_rank:
        return None
    from rpk.train.lora import LoraSettings

    m = cfg.model
    return LoraSettings(rank=m.lora_rank, alpha=m.lora_alpha, targets=tuple(m.lora_targets), dropout=m.lora_dropout)


def reward_settings(cfg: Config) -> RewardSettings:
    """The reward stack's part of the `reward` section, its pool's and sandbox's included;
    `reward.worker_memory_mb` 0 is a worker's share of the machine (`worker_memory_mb`)."""
    rw = cfg.reward
    pool = PoolSettings(
        timeout_s=rw.timeout_s, min_workers=rw.min_workers, max_workers=rw.max_workers, idle_s=rw.idle_s,
        memory_mb=rw.worker_memory_mb or worker_memory_mb(rw.max_workers),
    )
    return _copy(RewardSettings, rw, pool=pool, sandbox=_copy(SandboxSettings, rw.sandbox))


def judge_settings(cfg: Config) -> JudgeSettings:
    """The judge's settings: the `reward.judge` section, its empty template and unset
    system message meaning the built-in ones. The judged built-in task always checks
    its judged rows with the rule too (their agreement is what it reports), and with no
    judge set it is judged by rpk's tiny judge (`uses_tiny_judge`), with the prompt
    that judge learnt (`rpk.judge.tiny.DEFAULT`: the reference after the
    response's tail, no system message)."""
    j = cfg.reward.judge
    given: dict[str, Any] = {"data_sources": tuple(j.data_sources)}
    given["template"] = j.template or DEFAULT_TEMPLATE
    given["system"] = DEFAULT_SYSTEM if j.system is None else j.system
    if judged_task(cfg):
        given["compare_rules"] = True
    if uses_tiny_judge(cfg):
        given["model"] = str(judge_dir(cfg.model.tiny_judge, Path(cfg.model.cache_dir)))
        given["system"] = TINY_JUDGE.system if j.system is None else j.system
        given["template"] = j.template or TINY_JUDGE.template
        given["max_response_chars"] = TINY_JUDGE.max_response_chars
    return _copy(JudgeSettings, j, **given)


def judge_tier(cfg: Config) -> TierSettings:
    """The judge tier's settings: restarts, the verdict cache, the external endpoint."""
    j = cfg.reward.judge
    endpoint = None
    if j.url is not None:
        endpoint = EndpointSettings(j.url, j.model, j.api_key_env, RateLimits(j.rpm, j.tpm), j.retries,
                                    j.backoff_s, top_logprobs=j.top_logprobs)
    return TierSettings(Restarts(j.restarts, j.restart_backoff_s, max(60.0, j.restart_backoff_s)),
                        j.cache_size if j.cache else 0, endpoint)


def hybrid_settings(cfg: Config, term: JudgeTermSpec | None) -> HybridSettings:
    """How judged rows combine the judge and the rule: weighted by the judge's term of
    `reward.functions` (`term`, `split_judge_term`'s) when there is one, else as
    `reward.judge.mode` says; the rubric requests' template and system message (none
    for a judge run without one), and the group judging."""
    j = cfg.reward.judge
    rubric = RubricSettings(template=j.rubric_template or RUBRIC_TEMPLATE)
    common = dict(rubric=rubric, group=GroupJudging(j.group), seed=cfg.run.seed)
    if term is not None:
        return HybridSettings(Hybrid.WEIGHTED, term.weight, term.first, **common)
    return HybridSettings(Hybrid(j.mode), **common)


def canary_settings(cfg: Config) -> CanarySettings:
    return CanarySettings(per_step=cfg.reward.judge.canaries, margin=cfg.reward.judge.canary_margin)


def judged_task(cfg: Config) -> bool:
    """The run trains on the judged built-in task's rows."""
    return cfg.data.task == "arith_judged" and not cfg.data.train_files


def uses_tiny_judge(cfg: Config) -> bool:
    """The judged built-in task with no judge set: rpk builds and starts its tiny judge."""
    return judged_task(cfg) and cfg.reward.judge.model is None and cfg.reward.judge.url is None


def eval_spec(cfg: Config) -> EvalSpec:
    """Validation's sampling: k responses a prompt, as the rollout samples them."""
    r = cfg.rollout
    return EvalSpec(
        k=cfg.run.eval_k, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
        seed=cfg.run.seed,
    )


def _copy(kind: type[R], section: Any, **given: Any) -> R:
    """`kind` from the config section's fields of the same names, `given` for the rest."""
    names = [f.name for f in dataclasses.fields(kind) if f.name not in given]
    return kind(**{name: getattr(section, name) for name in names}, **given)
