"""The run: components from `rpk.build`, then the step loop, writing metrics and
checkpoints as it goes. `rpk.run` sets up the process and calls `run`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpk import build, checkpoint
from rpk.cli_config import to_dict
from rpk.config import Config, ConfigError
from rpk.core.records import Prompt
from rpk.loop.evaluate import evaluate
from rpk.loop.step import run_step
from rpk.obs import plot
from rpk.obs.metrics import MetricsWriter, read_records, step_record, summarize
from rpk.obs.progress import LiveProgress
from rpk.obs.trackers import Tracker, close_all, open_trackers
from rpk.obs.validation import PHASE, sample_rows, summarize_val, val_record
from rpk.train.losses import advantage_fn


@dataclass(frozen=True, slots=True)
class RunResult:
    run_dir: Path
    last_checkpoint: Path
    summary: dict[str, float]


async def run(cfg: Config, run_dir: Path, progress: LiveProgress) -> RunResult:
    """The whole run: build or load everything, then step until `run.steps`."""
    resume_from = checkpoint.find(Path(cfg.run.resume)) if cfg.run.resume else None
    resume_state = checkpoint.load_state(resume_from) if resume_from is not None else None
    if resume_from is not None and resume_state is not None:
        if resume_state["step"] >= cfg.run.steps:
            raise ConfigError(
                f"run.steps={cfg.run.steps}: the checkpoint {resume_from} is already at "
                f"step {resume_state['step']}; raise run.steps to continue"
            )
        model_dir = resume_from
        progress.message(f"resuming from {resume_from}")
    else:
        model_dir = await asyncio.to_thread(build.resolve_model, cfg, progress.message)
    prompts = await asyncio.to_thread(build.load_prompts, cfg, model_dir)
    val_prompts = await asyncio.to_thread(build.load_val_prompts, cfg, model_dir)
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    progress.message(
        f"model {model_dir}; {len(prompts)} prompts; {_describe_val(prompts, val_prompts)}; "
        f"run dir {run_dir}; event loop {loop_kind}"
    )
    trackers = await asyncio.to_thread(
        open_trackers, cfg.run.trackers, run_dir, cfg.run.project, cfg.run.name or run_dir.name,
        progress.message,
    )
    try:
        parts = await build.build(cfg, model_dir, prompts, progress.message, val_prompts)
    except BaseException:
        await asyncio.to_thread(close_all, trackers, progress.message)
        raise
    try:
        first_step = 1
        if resume_from is not None and resume_state is not None:
            await parts.trainer.load(resume_from)
            parts.policy.load_state_dict(resume_state["policy"])
            first_step = int(resume_state["step"]) + 1
        last_ckpt = await _steps(cfg, run_dir, parts, progress, first_step, resume_from, trackers)
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


def _describe_val(prompts: list[Prompt], val_prompts: list[Prompt]) -> str:
    if not val_prompts:
        return "no validation"
    trained = {p.token_ids for p in prompts}
    shared = sum(1 for p in val_prompts if p.token_ids in trained)
    return f"{len(val_prompts)} validation prompts" + (
        f" ({shared} of them also training prompts)" if shared else ""
    )


async def _steps(
    cfg: Config,
    run_dir: Path,
    parts: build.Components,
    progress: LiveProgress,
    first_step: int,
    last_ckpt: Path | None,
    trackers: list[Tracker],
) -> Path:
    advantages = advantage_fn(cfg.train.loss)
    capacity = parts.engine.max_concurrency
    writer = MetricsWriter(run_dir, trackers, note=progress.message)
    try:
        writer.log_config(to_dict(cfg))
        if cfg.run.eval_before_train:
            await _validate(cfg, parts, writer, progress, first_step - 1)
        for step in range(first_step, cfg.run.steps + 1):
            outcome = await run_step(
                step,
                parts.policy,
                parts.engine,
                parts.scorer,
                parts.trainer,
                advantages,
                version=parts.trainer.version,
                observer=progress,
                streaming=parts.streaming,
            )
            record = {**step_record(outcome, capacity), **parts.policy.metrics()}
            record.update(parts.scorer.metrics())
            writer.write(record)
            writer.write_timeline(outcome, capacity)
            progress.step_done(record)
            every = cfg.run.checkpoint_every
            if (every and step % every == 0) or step == cfg.run.steps:
                last_ckpt = await _checkpoint(run_dir, step, parts)
                progress.message(f"checkpoint {last_ckpt}")
            if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == cfg.run.steps:
                await _validate(cfg, parts, writer, progress, step)
    finally:
        await asyncio.to_thread(writer.close)
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


async def _checkpoint(run_dir: Path, step: int, parts: build.Components) -> Path:
    state: dict[str, Any] = {"policy": parts.policy.state_dict(), "version": parts.trainer.version}
    return await checkpoint.save(run_dir, step, parts.trainer.save, state)
