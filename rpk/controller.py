"""The run: components from `rpk.build`, then the step loop, writing metrics, samples and
checkpoints as it goes. `rpk.run` sets up the process (signals, exit codes) and calls
`run`.

A new run's directory is made only once everything has started, so a run that fails to
start leaves nothing behind; a resumed run goes on in its checkpoint's directory, its
files cut back to the checkpoint's step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine

from rpk import build, checkpoint, config
from rpk.cli_config import to_dict
from rpk.config import Config, ConfigError
from rpk.core.errors import NodeFailure
from rpk.core.records import Prompt
from rpk.engine.fleet import Fleet
from rpk.engine.nodes import remote_hosts
from rpk.engine.supervise import diagnose, watch_hosts
from rpk.loop.elastic import RolloutTP
from rpk.loop.evaluate import evaluate
from rpk.loop.step import run_step
from rpk.obs import plot
from rpk.obs.metrics import (
    MetricsWriter, keep_steps_up_to, pick_samples, read_records, step_record, summarize,
)
from rpk.obs.progress import LiveProgress
from rpk.obs.trackers import open_trackers
from rpk.obs.validation import PHASE, sample_rows, summarize_val, val_record
from rpk.reward.watch import ERRORS_FILE, ErrorLog, FailureRule, RewardWatch
from rpk.train.losses import advantage_fn


@dataclass(frozen=True, slots=True)
class RunResult:
    run_dir: Path
    last_checkpoint: Path
    summary: dict[str, float]


@dataclass(slots=True)
class RunStatus:
    """Where a run stands, for whoever must say so if it is interrupted."""

    run_dir: Path | None = None
    step: int = 0  # the step in progress, or the last one done
    last_checkpoint: Path | None = None  # what a resume would start from


async def run(
    cfg: Config, progress: LiveProgress, status: RunStatus, joined: Any = None
) -> RunResult:
    """The whole run: build or load everything, then step until `run.steps`. `joined`:
    rank 0's place in a multi-process run (`rpk.gpu.launch.Joined`), else None."""
    resume = _resume_point(cfg)
    if resume is not None:
        model_dir = resume.checkpoint
        status.run_dir, status.last_checkpoint = resume.run_dir, resume.checkpoint
        removed = await asyncio.to_thread(checkpoint.clean_partial, resume.run_dir)
        progress.message(
            f"resuming {resume.run_dir} from {resume.checkpoint.name}"
            + (f" (removed {len(removed)} half-written checkpoint(s))" if removed else "")
        )
    else:
        model_dir = await asyncio.to_thread(build.resolve_model, cfg, progress.message)
    prompts = await asyncio.to_thread(build.load_prompts, cfg, model_dir)
    val_prompts = await asyncio.to_thread(build.load_val_prompts, cfg, model_dir)
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    progress.message(
        f"model {model_dir}; {len(prompts)} prompts; {_describe_val(prompts, val_prompts)}; "
        f"event loop {loop_kind}"
    )
    version = resume.state.get("version", 0) if resume is not None else 0
    parts = await build.build(
        cfg, model_dir, prompts, progress.message, joined, val_prompts, version
    )
    try:
        if resume is not None:
            await parts.trainer.load(resume.checkpoint)
            parts.policy.load_state_dict(resume.state["policy"])
            run_dir = resume.run_dir
        else:
            run_dir = await asyncio.to_thread(_new_run_dir, cfg)
            status.run_dir = run_dir
        progress.message(f"run dir {run_dir}")
        last_ckpt = await _supervised(
            _steps(cfg, run_dir, parts, progress, status, resume), parts.engine, cfg
        )
    finally:
        await parts.aclose()
    try:
        written = await asyncio.to_thread(plot.write_plots, run_dir, note=progress.message)
        progress.message(f"plots: {written[0].parent}" if written else "no plots written")
    except Exception as e:  # the run is done and saved: a plot failure must not fail it
        progress.message(f"plots skipped: {type(e).__name__}: {e}")
    metrics = run_dir / "metrics.jsonl"
    summary = {**summarize(read_records(metrics)), **summarize_val(read_records(metrics, PHASE))}
    return RunResult(run_dir, last_ckpt, summary)


async def _supervised(steps: Coroutine[Any, Any, Path], engine: Any, cfg: Config) -> Path:
    """The step loop, beside a watch over the other nodes' engine hosts (when there are
    any): a lost node stops the run within seconds, naming the node, also when a trainer
    collective is what noticed it."""
    hosts = remote_hosts(engine) if isinstance(engine, Fleet) else {}
    if not hosts:
        return await steps
    d = cfg.dist
    try:
        async with asyncio.TaskGroup() as tg:
            watch = tg.create_task(
                watch_hosts(hosts, interval_s=d.heartbeat_s, misses=d.heartbeat_misses,
                            timeout_s=d.heartbeat_s * 2),
                name="watch-engine-hosts",
            )
            run = tg.create_task(steps, name="steps")
            await asyncio.wait([run])
            watch.cancel()
    except BaseExceptionGroup as group:
        if group.subgroup(NodeFailure) is not None:
            raise
        if (lost := await diagnose(hosts, timeout_s=d.heartbeat_s * 2)) is not None:
            raise lost from group
        raise
    return run.result()


def _describe_val(prompts: list[Prompt], val_prompts: list[Prompt]) -> str:
    if not val_prompts:
        return "no validation"
    trained = {p.token_ids for p in prompts}
    shared = sum(1 for p in val_prompts if p.token_ids in trained)
    return f"{len(val_prompts)} validation prompts" + (
        f" ({shared} of them also training prompts)" if shared else ""
    )


def _resume_point(cfg: Config) -> checkpoint.ResumePoint | None:
    """The checkpoint to resume from, checked against this run's config (cheap: nothing
    is loaded yet)."""
    if cfg.run.resume is None:
        return None
    point = checkpoint.resume_point(Path(cfg.run.resume))
    if point.step >= cfg.run.steps:
        raise ConfigError(
            f"run.steps={cfg.run.steps}: the checkpoint {point.checkpoint} is already at "
            f"step {point.step}; raise run.steps to continue"
        )
    checkpoint.check_compatible(
        point.state.get("fingerprint", {}), checkpoint.fingerprint(cfg), point.checkpoint
    )
    return point


def _new_run_dir(cfg: Config) -> Path:
    run_dir = checkpoint.new_run_dir(Path(cfg.run.out_dir))
    (run_dir / "config.yaml").write_text(config.dump_yaml(cfg))
    return run_dir


async def _steps(
    cfg: Config,
    run_dir: Path,
    parts: build.Components,
    progress: LiveProgress,
    status: RunStatus,
    resume: checkpoint.ResumePoint | None,
) -> Path:
    advantages = advantage_fn(cfg.train.loss)
    bucket_bytes = cfg.rollout.weight_bucket_mb * 2**20
    # A fleet (what `build` starts) has layouts and per-replica statistics; any other
    # Engine runs as it is.
    elastic = None
    if isinstance(parts.engine, Fleet):
        elastic = RolloutTP(
            build.build_tp_planner(cfg, parts.model_dir), parts.engine, parts.trainer, bucket_bytes, progress.message,
            last_step=cfg.run.steps,
        )
        if resume is not None:
            elastic.planner.load_state_dict(resume.state.get("tp_planner", {}))
    first_step = resume.step + 1 if resume is not None else 1
    last_ckpt = resume.checkpoint if resume is not None else None
    resume_after = resume.step if resume is not None else None
    trackers = await asyncio.to_thread(
        open_trackers, cfg.run.trackers, run_dir, cfg.run.project, cfg.run.name or run_dir.name,
        progress.message, resume_after,
    )
    writer = MetricsWriter(run_dir, trackers, progress.message, resume_after)
    if resume is not None:
        keep_steps_up_to(run_dir / ERRORS_FILE, resume.step)
    rule = FailureRule(cfg.reward.max_failure_frac, cfg.reward.max_failure_steps)
    watch = RewardWatch(parts.scorer, ErrorLog(run_dir / ERRORS_FILE), rule)
    fingerprint = checkpoint.fingerprint(cfg)
    try:
        writer.log_config(to_dict(cfg))
        # A resumed run was validated at its checkpoint's step when that was due.
        if cfg.run.eval_before_train and resume is None:
            await _validate(cfg, parts, writer, progress, 0)
        for step in range(first_step, cfg.run.steps + 1):
            status.step = step
            watch.begin_step(step)
            outcome = await run_step(
                step,
                parts.policy,
                parts.engine,
                watch,
                parts.trainer,
                advantages,
                version=parts.trainer.version,
                observer=progress,
                streaming=parts.streaming,
                weight_bucket_bytes=bucket_bytes,
                between=elastic,
            )
            record = {**step_record(outcome), **parts.policy.metrics()}
            if elastic:
                record.update(elastic.record(outcome))
            record.update(parts.scorer.metrics())
            record.update(watch.end_step())
            writer.write(record)
            writer.write_timeline(
                outcome, tp=record.get("tp"), preemptions=record.get("preemptions")
            )
            samples = pick_samples(outcome, cfg.run.samples_per_step)
            writer.write_samples(samples)
            progress.step_done(record)
            if cfg.run.show_samples and samples:
                progress.sample(samples[-1])
            watch.raise_if_failing()  # after the step is on record
            every = cfg.run.checkpoint_every
            if (every and step % every == 0) or step == cfg.run.steps:
                state: dict[str, Any] = {
                    "policy": parts.policy.state_dict(),
                    "tp_planner": elastic.planner.state_dict() if elastic else {},
                    "version": parts.trainer.version,
                    "fingerprint": fingerprint,
                }
                last_ckpt = await checkpoint.save(
                    run_dir, step, parts.trainer.save, state, keep=cfg.run.keep_checkpoints
                )
                status.last_checkpoint = last_ckpt
                progress.message(f"checkpoint {last_ckpt}")
            if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == cfg.run.steps:
                await _validate(cfg, parts, writer, progress, step)
    finally:
        await asyncio.to_thread(writer.close)
        await watch.aclose()
    assert last_ckpt is not None, "the final step always writes a checkpoint"
    return last_ckpt


async def _validate(
    cfg: Config, parts: build.Components, writer: MetricsWriter, progress: LiveProgress, step: int
) -> None:
    """A validation pass between steps (after the weight sync), its own phase in
    metrics.jsonl: the step records' timings never include it."""
    if not parts.val_prompts:
        return
    result = await evaluate(
        parts.val_prompts, parts.engine, parts.scorer, build.eval_spec(cfg),
        step=step, version=parts.trainer.version,
    )
    record = val_record(result)
    writer.write(record)
    writer.log_texts(step, sample_rows(result), tag="val_samples")
    progress.validated(record)
