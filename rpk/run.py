"""`python -m rpk.run`: config -> components -> the step loop.

On a CPU machine with no arguments it builds rpk's tiny model, generates the built-in
long-tail arithmetic task, starts vLLM's async engine and trains with GRPO.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from rpk import checkpoint, config, plot
from rpk.config import Config, ConfigError
from rpk.data import DataError, load_files, to_prompts
from rpk.engine.vllm_engine import EngineStartError, VLLMEngine, VLLMSettings
from rpk.loop.policy import (
    OversamplePolicy,
    PartialPolicy,
    Sampling,
    SyncPolicy,
    TailPolicy,
)
from rpk.loop.records import Prompt
from rpk.loop.step import Policy, Streaming, TrainerThread, run_step
from rpk.gpu.device import trainer_device
from rpk.gpu.streams import side_stream_init
from rpk.metrics import MetricsWriter, read_records, step_record, summarize
from rpk.progress import LiveProgress, summary_table
from rpk.reward import MeteredScorer, RewardError, make_scorer, resolve, with_shaping
from rpk.reward import code
from rpk.reward.pool import RewardPoolError
from rpk.reward.remote import HTTPScorer
from rpk.reward.sandbox import SandboxUnavailable
from rpk.tasks import arith


USER_ERRORS = (
    ConfigError, DataError, RewardError, RewardPoolError, SandboxUnavailable,
    checkpoint.CheckpointError, EngineStartError,
)


@dataclass(frozen=True, slots=True)
class RunResult:
    run_dir: Path
    last_checkpoint: Path
    summary: dict[str, float]


SPECULATIVE = {"tail": TailPolicy, "oversample": OversamplePolicy, "partial": PartialPolicy}


def make_policy(cfg: Config, prompts: Sequence[Prompt]) -> Policy:
    r = cfg.rollout
    sampling = Sampling(
        prompts_per_step=r.prompts_per_step,
        responses_per_prompt=r.responses_per_prompt,
        max_tokens=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=cfg.run.seed,
        drop_zero_variance=r.dynamic_sampling,
    )
    if len(prompts) < r.prompts_per_step:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} but the dataset has only "
            f"{len(prompts)} prompts"
        )
    if r.policy in SPECULATIVE:
        return SPECULATIVE[r.policy](
            prompts, sampling, eta_prompts=r.eta_prompts, eta_responses=r.eta_responses,
            shuffle=cfg.data.shuffle,
        )
    return SyncPolicy(prompts, sampling, shuffle=cfg.data.shuffle)


def resolve_model(cfg: Config, log: Any) -> Path:
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path={cfg.model.path!r}: no HF model (config.json) there")
        return path
    from rpk.tiny import build_tiny_model

    return build_tiny_model(cfg.model.tiny, Path(cfg.model.cache_dir), log=log)


def load_prompts(cfg: Config, model_dir: Path) -> list[Prompt]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if cfg.data.train_files:
        return load_files(cfg.data.train_files, tokenizer, cfg.data.max_prompt_tokens)
    # Offset from the warm-up's seed so RL prompts are fresh draws, not the SFT set.
    rows = arith.make_rows(cfg.data.builtin_size, seed=10_000 + cfg.run.seed, spec=cfg.model.tiny.task)
    return to_prompts(rows, "builtin:rpk/arith", tokenizer, cfg.data.max_prompt_tokens)


def build_trainer(cfg: Config, model_dir: Path) -> Any:
    from rpk.gpu.device import trainer_device
    from rpk.train.trainer import TorchTrainer

    t = cfg.train
    return TorchTrainer(
        model_dir,
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        weight_decay=t.weight_decay,
        grad_clip=t.grad_clip,
        loss=t.loss,
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        overlong_filter=t.overlong_filter,
        kl_coef=t.kl_coef,
        entropy_coef=t.entropy_coef,
        max_response_tokens=cfg.rollout.max_tokens,
        micro_batch_tokens=t.micro_batch_tokens,
        temperature=cfg.rollout.temperature,
        seed=cfg.run.seed,
        device=trainer_device(t.device),
        torch_threads=t.torch_threads or None,
    )


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


async def start_engine(cfg: Config, model_dir: Path, max_model_len: int) -> Any:
    from rpk.gpu.device import engine_dtype

    r = cfg.rollout
    settings = VLLMSettings(
        model=str(model_dir),
        dtype=engine_dtype(r.dtype),
        max_model_len=max_model_len,
        max_num_seqs=r.max_num_seqs,
        stream_interval=r.stream_interval,
        kv_cache_memory_bytes=r.kv_cache_mb * 2**20,
        seed=cfg.run.seed,
        gpu_memory_utilization=r.gpu_memory_utilization,
    )
    return await VLLMEngine.start(settings)


def build_scorer(cfg: Config, prompts: Sequence[Prompt]) -> MeteredScorer:
    """Checked before the engine starts: a missing reward or token fails in seconds."""
    if cfg.reward.url is not None:
        # The service picks the function per data source; the run cannot check it here.
        return with_shaping(
            cfg.reward, HTTPScorer.from_config(cfg.reward), max_tokens=cfg.rollout.max_tokens
        )
    functions = resolve(cfg.reward.function, {p.data_source for p in prompts}, cfg.reward.functions)
    return make_scorer(cfg.reward, functions, max_tokens=cfg.rollout.max_tokens)


async def train(cfg: Config, run_dir: Path, progress: LiveProgress) -> RunResult:
    """The whole run: build or load everything, then step until `run.steps`."""
    from rpk.train.losses import advantage_fn

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
        model_dir = await asyncio.to_thread(resolve_model, cfg, progress.message)
    prompts = await asyncio.to_thread(load_prompts, cfg, model_dir)
    scorer = build_scorer(cfg, prompts)
    # build_scorer configured the sandbox if any data source scores code: probe it now,
    # so a machine that cannot isolate programs fails in one line, not per sample.
    if (sandbox := code.configured()) is not None:
        progress.message(f"code sandbox: {await sandbox.probe()}")
    max_model_len = check_lengths(cfg, model_dir, prompts)
    loop_kind = type(asyncio.get_running_loop()).__module__.split(".")[0]
    progress.message(
        f"model {model_dir}; {len(prompts)} prompts; run dir {run_dir}; event loop {loop_kind}"
    )

    policy = make_policy(cfg, prompts)
    async with asyncio.TaskGroup() as tg:
        engine_task = tg.create_task(start_engine(cfg, model_dir, max_model_len), name="start-engine")
        trainer_task = tg.create_task(
            asyncio.to_thread(build_trainer, cfg, model_dir), name="load-trainer"
        )
    engine, trainer = engine_task.result(), trainer_task.result()
    trainer_thread = TrainerThread(trainer, thread_init=side_stream_init(trainer_device(cfg.train.device)))
    streaming = Streaming(
        enabled=cfg.train.streaming,
        start_frac=cfg.train.stream_start_frac,
        chunk_tokens=cfg.train.stream_chunk_tokens,
    )
    first_step = 1
    if resume_from is not None and resume_state is not None:
        await trainer_thread.call(trainer.load_state, resume_from)
        policy.load_state_dict(resume_state["policy"])
        first_step = int(resume_state["step"]) + 1

    writer = MetricsWriter(run_dir)
    last_ckpt = resume_from
    step = first_step - 1
    try:
        for step in range(first_step, cfg.run.steps + 1):
            outcome = await run_step(
                step,
                policy,
                engine,
                scorer,
                trainer_thread,
                advantage_fn(cfg.train.loss),
                version=trainer.version,
                observer=progress,
                streaming=streaming,
            )
            record = {**step_record(outcome, engine.max_concurrency), **policy.metrics()}
            record.update(scorer.metrics())
            writer.write(record)
            writer.write_timeline(outcome, engine.max_concurrency)
            progress.step_done(record)
            every = cfg.run.checkpoint_every
            if (every and step % every == 0) or step == cfg.run.steps:
                last_ckpt = await _checkpoint(run_dir, step, trainer_thread, policy)
                progress.message(f"checkpoint {last_ckpt}")
    finally:
        writer.close()
        await engine.shutdown()
        await scorer.aclose()
        trainer_thread.close()
    assert last_ckpt is not None, "the final step always writes a checkpoint"
    try:
        written = await asyncio.to_thread(plot.write_plots, run_dir, note=progress.message)
        progress.message(f"plots: {written[0].parent}" if written else "no plots written")
    except Exception as e:  # the run is done and saved: a plot failure must not fail it
        progress.message(f"plots skipped: {type(e).__name__}: {e}")
    summary = summarize(read_records(run_dir / "metrics.jsonl"))
    return RunResult(run_dir, last_ckpt, summary)


async def _checkpoint(run_dir: Path, step: int, trainer: TrainerThread, policy: Any) -> Path:
    state = {"policy": policy.state_dict(), "version": trainer.trainer.version}
    return await trainer.call(checkpoint.save, run_dir, step, trainer.trainer.save, state)


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            yield from _leaves(inner)
    else:
        yield e


def run_async(cfg: Config, coro: Any) -> Any:
    if cfg.run.uvloop:
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    return asyncio.run(coro)


def quiet_libraries() -> None:
    """vLLM logs every weight reload and transformers draws a bar per load and save;
    rpk shows its own progress. VLLM_LOGGING_LEVEL=INFO brings vLLM's logs back."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config.from_argv(args)
    except ConfigError as e:
        print(f"rpk: config error: {e}", file=sys.stderr)
        return 2
    quiet_libraries()
    run_dir = checkpoint.new_run_dir(Path(cfg.run.out_dir))
    (run_dir / "config.yaml").write_text(config.dump_yaml(cfg))
    progress = LiveProgress(cfg.run.steps, live=cfg.run.progress)
    try:
        with progress:
            result = run_async(cfg, train(cfg, run_dir, progress))
    except Exception as e:
        # Errors in what the user gave (config, data, model, reward) get one clear line
        # each, also when they come out of a TaskGroup; anything else is a bug: traceback.
        leaves = list(_leaves(e))
        if not all(isinstance(x, USER_ERRORS) for x in leaves):
            raise
        for x in leaves:
            progress.console.print(f"rpk: {x}", style="red", markup=False)
        return 2
    progress.console.print(summary_table(result.summary, str(run_dir)))
    progress.console.print(f"final checkpoint: {result.last_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
