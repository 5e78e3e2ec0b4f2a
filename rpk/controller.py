"""The run: the step loop over the components `rpk.assembly` made, writing metrics, samples
and checkpoints as it goes. `rpk.run` sets up the process (signals, exit codes), asks
`resume` where the run starts, has `rpk.assembly` make the components and hands them to
`run`, with the run's settings (`RunSettings`, which the assembly fills): no config reaches
this module. `Components` and `RunSettings` are the controller's: the assembly fills them,
the controller never imports it.

A new run's directory is made only once everything has started, so a run that fails to
start leaves nothing behind; a resumed run goes on in its checkpoint's directory, its
files cut back to the checkpoint's step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpk import checkpoint
from rpk.agent.engine import AgentEngine
from rpk.cluster.remote import HostClient
from rpk.cluster.supervise import diagnose, watch_hosts
from rpk.core.errors import NodeFailure
from rpk.core.protocols import Engine, Lending, Resting
from rpk.core.records import Prompt
from rpk.loop.elastic import RolloutTP
from rpk.loop.evaluate import EvalSpec, evaluate
from rpk.loop.feed import Streaming
from rpk.loop.speculate import SpecTail
from rpk.loop.step import run_step, while_resting
from rpk.loop.trainer import AsyncTrainer
from rpk.obs import plot
from rpk.obs.metrics import HostCpu, keep_steps_up_to, read_records, summarize
from rpk.obs.progress import LiveProgress
from rpk.obs.recorder import StepRecorder
from rpk.obs.validation import PHASE, summarize_val
from rpk.reward import RewardStack
from rpk.reward.watch import ERRORS_FILE, ErrorLog, FailureRule, RewardWatch
from rpk.sched.policy import Policy


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What the controller reads of the config, as values: where the run's files go and
    what it resumes, its schedule (steps, checkpoints, validation), its records (samples,
    trackers, the reward failure rule) and the watch over other nodes' engine hosts."""

    steps: int
    out_dir: Path
    resume: Path | None
    verify_checkpoint: bool
    checkpoint_every: int
    keep_checkpoints: int
    eval_every: int
    eval_before_train: bool
    samples_per_step: int
    show_samples: bool
    trackers: tuple[str, ...]
    project: str
    name: str | None
    max_failure_frac: float
    max_failure_steps: int
    heartbeat_s: float
    heartbeat_misses: int
    fingerprint: Mapping[str, Any]  # what a checkpoint must have been made with
    config: Mapping[str, Any]  # the whole config, for the trackers
    config_yaml: str  # the same, as the run directory's config.yaml


@dataclass(slots=True)
class Components:
    """Everything a run steps with; `aclose` stops what was started."""

    model_dir: Path
    prompts: list[Prompt]
    policy: Policy
    scorer: RewardStack
    engine: Engine  # a Fleet, as `start_parts` starts it
    trainer: AsyncTrainer
    streaming: Streaming
    val_prompts: list[Prompt] = field(default_factory=list)
    # elastic TP between rounds (`rpk.loop.elastic`): a fleet's, as `start_parts` starts it;
    # None runs the engine as it is
    elastic: RolloutTP | None = None
    lending_fleet: Lending | None = None  # the fleet, when the trainer borrows its replicas
    resting_fleet: Resting | None = None  # the fleet, when it shares its devices with the trainer
    hosts: Mapping[int, HostClient] = field(default_factory=dict)  # other nodes' engine hosts
    spec: SpecTail | None = None  # the speculative tail's drafts around each round (the fleet's)
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


async def resume(
    settings: RunSettings, progress: LiveProgress, status: RunStatus
) -> checkpoint.ResumePoint | None:
    """Where the run starts: `settings.resume`'s checkpoint, verified and checked against
    this run's settings before anything is loaded (its run directory's half-written
    checkpoints removed), or None for a new run."""
    point = await asyncio.to_thread(_resume_point, settings)
    if point is None:
        return None
    for damaged in point.rejected:
        progress.message(
            f"rpk: checkpoint {damaged.checkpoint.name} fails its check: {damaged.problem}; "
            f"falling back to {point.checkpoint.name}, the newest checkpoint that verifies"
        )
    status.run_dir, status.last_checkpoint = point.run_dir, point.checkpoint
    removed = await asyncio.to_thread(checkpoint.clean_partial, point.run_dir)
    progress.message(
        f"resuming {point.run_dir} from {point.checkpoint.name}"
        + (f" (removed {len(removed)} half-written checkpoint(s))" if removed else "")
    )
    return point


async def run(
    settings: RunSettings, parts: Components, progress: LiveProgress, status: RunStatus,
    point: checkpoint.ResumePoint | None = None,
) -> RunResult:
    """Step `parts` until `settings.steps`, on from `point` (`resume`'s answer, which
    `parts` were built from), and close them."""
    try:
        if point is not None:
            run_dir = point.run_dir
        else:
            run_dir = await asyncio.to_thread(_new_run_dir, settings)
            status.run_dir = run_dir
        progress.message(f"run dir {run_dir}")
        last_ckpt = await _supervised(
            _steps(settings, run_dir, parts, progress, status, point), parts.hosts,
            settings.heartbeat_s, settings.heartbeat_misses,
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
    steps: Coroutine[Any, Any, Path], hosts: Mapping[int, HostClient], heartbeat_s: float,
    misses: int,
) -> Path:
    """The step loop, beside a watch over the other nodes' engine hosts (when there are
    any): a lost node stops the run within seconds, naming the node, also when a trainer
    collective is what noticed it."""
    if not hosts:
        return await steps
    try:
        async with asyncio.TaskGroup() as tg:
            watch = tg.create_task(
                watch_hosts(hosts, interval_s=heartbeat_s, misses=misses, timeout_s=heartbeat_s * 2),
                name="watch-engine-hosts",
            )
            run = tg.create_task(steps, name="steps")
            await asyncio.wait([run])
            watch.cancel()
    except BaseExceptionGroup as group:
        if group.subgroup(NodeFailure) is not None:
            raise
        if (lost := await diagnose(hosts, timeout_s=heartbeat_s * 2)) is not None:
            raise lost from group
        raise
    return run.result()


def _resume_point(settings: RunSettings) -> checkpoint.ResumePoint | None:
    """The checkpoint to resume from, verified against its manifest and checked against
    this run's settings (blocking: it reads the files)."""
    if settings.resume is None:
        return None
    point = checkpoint.resume_point(settings.resume, settings.verify_checkpoint)
    if point.step >= settings.steps:
        raise checkpoint.CheckpointError(
            f"run.steps={settings.steps}: the checkpoint {point.checkpoint} is already at "
            f"step {point.step}; raise run.steps to continue"
        )
    checkpoint.check_compatible(point.state.fingerprint, settings.fingerprint, point.checkpoint)
    return point


def _new_run_dir(settings: RunSettings) -> Path:
    run_dir = checkpoint.new_run_dir(settings.out_dir)
    (run_dir / "config.yaml").write_text(settings.config_yaml)
    return run_dir


@dataclass(slots=True)
class _Books:
    """Where a run's steps go on record: metrics (and the trackers, the display), reward
    failures, checkpoints."""

    recorder: StepRecorder
    watch: RewardWatch
    last_ckpt: Path | None
    cpu: HostCpu = field(default_factory=HostCpu)


async def _steps(
    settings: RunSettings,
    run_dir: Path,
    parts: Components,
    progress: LiveProgress,
    status: RunStatus,
    resume: checkpoint.ResumePoint | None,
) -> Path:
    books = await _open_books(settings, run_dir, parts, progress, resume)
    try:
        await asyncio.to_thread(books.recorder.config, settings.config)
        # A resumed run was validated at its checkpoint's step when that was due.
        if settings.eval_before_train and resume is None:
            await _validate(parts, books.recorder, 0)
        for step in range(resume.step + 1 if resume is not None else 1, settings.steps + 1):
            status.step = step
            await _step(step, parts, books, progress)
            books.watch.raise_if_failing()  # after the step is on record
            if _due(settings.checkpoint_every, step, settings.steps):
                books.last_ckpt = await _checkpoint(settings, run_dir, step, parts)
                status.last_checkpoint = books.last_ckpt
                progress.message(f"checkpoint {books.last_ckpt}")
            if _due(settings.eval_every, step, settings.steps):
                await _validate(parts, books.recorder, step)
    finally:
        await asyncio.to_thread(books.recorder.close)
        await books.watch.aclose()
    assert books.last_ckpt is not None, "the final step always writes a checkpoint"
    return books.last_ckpt


def _due(every: int, step: int, last: int) -> bool:
    """Every `every` steps (0: never) and after the last one."""
    return bool(every and step % every == 0) or step == last


async def _open_books(
    settings: RunSettings, run_dir: Path, parts: Components, progress: LiveProgress,
    resume: checkpoint.ResumePoint | None,
) -> _Books:
    resume_after = resume.step if resume is not None else None
    recorder = await asyncio.to_thread(
        StepRecorder.open, run_dir, progress, trackers=settings.trackers, project=settings.project,
        name=settings.name or run_dir.name, samples_per_step=settings.samples_per_step,
        show_samples=settings.show_samples, resume_after=resume_after,
    )
    if resume is not None:
        keep_steps_up_to(run_dir / ERRORS_FILE, resume.step)
    rule = FailureRule(settings.max_failure_frac, settings.max_failure_steps)
    watch = RewardWatch(parts.scorer, ErrorLog(run_dir / ERRORS_FILE), rule, steps=settings.steps,
                        note=progress.message)
    return _Books(recorder, watch, resume.checkpoint if resume is not None else None)


async def _step(step: int, parts: Components, books: _Books, progress: LiveProgress) -> None:
    """One step, put on record with what the parts add to it: the policy's, the elastic
    TP's, the scorer's and the reward watch's columns (which close its failure count)."""
    books.watch.begin_step(step)
    books.cpu.lap()  # a step's own share: not validation's or a checkpoint's
    if isinstance(parts.engine, AgentEngine):
        parts.engine.lap()  # likewise: validation's trajectories are not the step's
    watch = books.watch
    outcome = await run_step(
        step, parts.policy, parts.engine, watch, parts.trainer, parts.advantages,
        version=parts.trainer.version, observer=progress, streaming=parts.streaming,
        weight_bucket_bytes=parts.weight_bucket_bytes, between=parts.elastic, lending_fleet=parts.lending_fleet,
        resting_fleet=parts.resting_fleet, groups=watch if watch.groups else None,
        beside_round=watch.ask_canaries if watch.canaries is not None else None, spec=parts.spec,
    )
    columns = dict(parts.policy.metrics())
    if isinstance(parts.engine, AgentEngine):
        columns.update(parts.engine.lap())  # wall clocks: not a sum over trajectories
    if parts.elastic:
        columns.update(parts.elastic.record(outcome))
    if parts.spec:
        columns.update(parts.spec.record())
    columns.update(parts.scorer.metrics())
    columns.update(books.watch.end_step())
    columns.update(books.cpu.lap())
    await asyncio.to_thread(books.recorder.step, outcome, columns)  # trackers may call out over HTTP


async def _checkpoint(settings: RunSettings, run_dir: Path, step: int, parts: Components) -> Path:
    state = checkpoint.RunState(
        step, parts.policy.state_dict(), version=parts.trainer.version,
        tp_planner=parts.elastic.planner.state_dict() if parts.elastic else {},
        fingerprint=dict(settings.fingerprint),
    )
    return await while_resting(
        parts.resting_fleet,
        lambda: checkpoint.save(run_dir, state, parts.trainer.save, keep=settings.keep_checkpoints),
        lambda: parts.engine.update_weights(
            parts.trainer.weight_buckets(parts.weight_bucket_bytes), parts.trainer.version
        ),
    )


async def _validate(parts: Components, recorder: StepRecorder, step: int) -> None:
    """A validation pass between steps (after the weight sync), its own phase in
    metrics.jsonl: the step records' timings never include it."""
    if not parts.val_prompts:
        return
    run = await evaluate(
        parts.val_prompts, parts.engine, parts.scorer, parts.eval_spec,
        step=step, version=parts.trainer.version,
    )
    await asyncio.to_thread(recorder.validated, run)
