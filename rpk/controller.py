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
from typing import Any, Coroutine, Mapping

from rpk import build, checkpoint, config
from rpk.cli_config import to_dict
from rpk.cluster.remote import HostClient
from rpk.cluster.supervise import diagnose, watch_hosts
from rpk.config import Config, ConfigError, DistConfig, RunConfig
from rpk.core.errors import NodeFailure
from rpk.core.outcomes import StepOutcome
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
    cfg: Config, placement: build.Placement, progress: LiveProgress, status: RunStatus,
    joined: Any = None,
) -> RunResult:
    """The whole run: build or load everything, then step until `run.steps`.
    `placement`: where the parts go (`build.place`); `joined`: rank 0's place in a
    multi-process run (`rpk.gpu.launch.Joined`), else None."""
    resume = await asyncio.to_thread(_resume_point, cfg)
    if resume is not None:
        for damaged in resume.rejected:
            progress.message(
                f"rpk: checkpoint {damaged.checkpoint.name} fails its check: {damaged.problem}; "
                f"falling back to {resume.checkpoint.name}, the newest checkpoint that verifies"
            )
        status.run_dir, status.last_checkpoint = resume.run_dir, resume.checkpoint
        removed = await asyncio.to_thread(checkpoint.clean_partial, resume.run_dir)
        progress.message(
            f"resuming {resume.run_dir} from {resume.checkpoint.name}"
            + (f" (removed {len(removed)} half-written checkpoint(s))" if removed else "")
        )
    parts = await build.assemble(cfg, placement, progress.message, resume, joined)
    try:
        if resume is not None:
            run_dir = resume.run_dir
        else:
            run_dir = await asyncio.to_thread(_new_run_dir, cfg)
            status.run_dir = run_dir
        progress.message(f"run dir {run_dir}")
        last_ckpt = await _supervised(
            _steps(cfg, run_dir, parts, progress, status, resume), parts.hosts, cfg.dist
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


async def _supervised(
    steps: Coroutine[Any, Any, Path], hosts: Mapping[int, HostClient], d: DistConfig
) -> Path:
    """The step loop, beside a watch over the other nodes' engine hosts (when there are
    any): a lost node stops the run within seconds, naming the node, also when a trainer
    collective is what noticed it."""
    if not hosts:
        return await steps
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


def _resume_point(cfg: Config) -> checkpoint.ResumePoint | None:
    """The checkpoint to resume from, verified against its manifest and checked against
    this run's config (before anything is loaded; blocking: it reads the files)."""
    if cfg.run.resume is None:
        return None
    point = checkpoint.resume_point(Path(cfg.run.resume), cfg.run.verify_checkpoint)
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


@dataclass(slots=True)
class _Books:
    """Where a run's steps go on record: metrics (and the trackers), reward failures,
    checkpoints."""

    writer: MetricsWriter
    watch: RewardWatch
    fingerprint: dict[str, Any]
    last_ckpt: Path | None


async def _steps(
    cfg: Config,
    run_dir: Path,
    parts: build.Components,
    progress: LiveProgress,
    status: RunStatus,
    resume: checkpoint.ResumePoint | None,
) -> Path:
    run = cfg.run
    books = await _open_books(cfg, run_dir, parts, progress, resume)
    try:
        books.writer.log_config(to_dict(cfg))
        # A resumed run was validated at its checkpoint's step when that was due.
        if run.eval_before_train and resume is None:
            await _validate(parts, books.writer, progress, 0)
        for step in range(resume.step + 1 if resume is not None else 1, run.steps + 1):
            status.step = step
            outcome = await _step(step, parts, books.watch, progress)
            _write_step(run, outcome, parts, books, progress)
            books.watch.raise_if_failing()  # after the step is on record
            if _due(run.checkpoint_every, step, run.steps):
                books.last_ckpt = await _checkpoint(run, run_dir, step, parts, books.fingerprint)
                status.last_checkpoint = books.last_ckpt
                progress.message(f"checkpoint {books.last_ckpt}")
            if _due(run.eval_every, step, run.steps):
                await _validate(parts, books.writer, progress, step)
    finally:
        await asyncio.to_thread(books.writer.close)
        await books.watch.aclose()
    assert books.last_ckpt is not None, "the final step always writes a checkpoint"
    return books.last_ckpt


def _due(every: int, step: int, last: int) -> bool:
    """Every `every` steps (0: never) and after the last one."""
    return bool(every and step % every == 0) or step == last


async def _open_books(
    cfg: Config, run_dir: Path, parts: build.Components, progress: LiveProgress,
    resume: checkpoint.ResumePoint | None,
) -> _Books:
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
    last_ckpt = resume.checkpoint if resume is not None else None
    return _Books(writer, watch, checkpoint.fingerprint(cfg), last_ckpt)


async def _step(
    step: int, parts: build.Components, watch: RewardWatch, progress: LiveProgress
) -> StepOutcome:
    watch.begin_step(step)
    return await run_step(
        step, parts.policy, parts.engine, watch, parts.trainer, parts.advantages,
        version=parts.trainer.version, observer=progress, streaming=parts.streaming,
        weight_bucket_bytes=parts.weight_bucket_bytes, between=parts.elastic, lender=parts.lender,
        rester=parts.rester,
    )


def _write_step(
    run: RunConfig, outcome: StepOutcome, parts: build.Components, books: _Books,
    progress: LiveProgress,
) -> None:
    record = {**step_record(outcome), **parts.policy.metrics()}
    if parts.elastic:
        record.update(parts.elastic.record(outcome))
    record.update(parts.scorer.metrics())
    record.update(books.watch.end_step())
    books.writer.write(record)
    books.writer.write_timeline(outcome, tp=record.get("tp"), preemptions=record.get("preemptions"))
    samples = pick_samples(outcome, run.samples_per_step)
    books.writer.write_samples(samples)
    progress.step_done(record)
    if run.show_samples and samples:
        progress.sample(samples[-1])


async def _checkpoint(
    run: RunConfig, run_dir: Path, step: int, parts: build.Components, fingerprint: dict[str, Any]
) -> Path:
    state: dict[str, Any] = {
        "policy": parts.policy.state_dict(),
        "tp_planner": parts.elastic.planner.state_dict() if parts.elastic else {},
        "version": parts.trainer.version,
        "fingerprint": fingerprint,
    }
    return await checkpoint.save(run_dir, step, parts.trainer.save, state, keep=run.keep_checkpoints)


async def _validate(
    parts: build.Components, writer: MetricsWriter, progress: LiveProgress, step: int
) -> None:
    """A validation pass between steps (after the weight sync), its own phase in
    metrics.jsonl: the step records' timings never include it."""
    if not parts.val_prompts:
        return
    result = await evaluate(
        parts.val_prompts, parts.engine, parts.scorer, parts.eval_spec,
        step=step, version=parts.trainer.version,
    )
    record = val_record(result)
    writer.write(record)
    writer.log_texts(step, sample_rows(result), tag="val_samples")
    progress.validated(record)
