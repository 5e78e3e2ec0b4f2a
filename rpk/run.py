"""`python -m rpk.run`: argv -> config -> the run (`rpk.controller`).

On a CPU machine with no arguments it builds rpk's tiny model, generates the built-in
long-tail arithmetic task, starts vLLM's async engine and trains with GRPO.

With `--dist.nproc N` (or several GPUs) it starts N ranks itself (`rpk.gpu.launch`); under
`torchrun` it is one of them: rank 0 runs everything below, the others follow its
trainer commands (`rpk.train.dist.follow`).

Ways a run ends, and the exit code each gives: done (0); an error in what the user
gave (2, one line); a node of a multi-node run lost (1, one line naming it and the
checkpoint a resume starts from); interrupted by SIGINT or SIGTERM (130 or 143: the
step in progress is abandoned, the engine, reward workers and trainer stop, and the
console says what a resume starts from; a second signal exits at once); a bug (a
traceback). Children never outlive the process, even killed with SIGKILL (`rpk.lifetime`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from rpk import assembly, checkpoint, config, controller
from rpk.assembly.dry_run import dry_run
from rpk.assembly.settings import run_settings
from rpk.assembly.start import assemble
from rpk.config import Config, ConfigError
from rpk.controller import RunSettings
from rpk.core.errors import NodeFailure, UserError
from rpk.gpu import launch, layout
from rpk.obs.progress import LiveProgress, summary_table
from rpk.train.dist import follow


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _leaves(e: BaseException) -> Iterator[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            yield from _leaves(inner)
    else:
        yield e


async def _interruptible(coro: Coroutine[Any, Any, Any], progress: LiveProgress) -> Any:
    """Run `coro` as a task that SIGINT and SIGTERM cancel; a second signal exits the
    process at once (its children follow: they die with it)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if received:
            progress.message(f"rpk: {signal.Signals(signum).name} again: exiting now")
            os._exit(128 + signum)
        received.append(signum)
        progress.message(
            f"rpk: {signal.Signals(signum).name}: stopping (abandoning the step in "
            "progress; press Ctrl-C again to exit at once)"
        )
        task.cancel()

    handled = (signal.SIGINT, signal.SIGTERM)
    for signum in handled:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if not received:
            raise
        raise Interrupted(received[0]) from None
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


def run_async(coro: Coroutine[Any, Any, Any], use_uvloop: bool = True) -> Any:
    """Run `coro` to the end on uvloop's event loop where it is installed (and wanted),
    else on asyncio's."""
    factory = None
    if use_uvloop:
        try:
            from uvloop import new_event_loop as factory
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def quiet_libraries() -> None:
    """vLLM logs every weight reload and transformers draws a bar per load and save;
    rpk shows its own progress. VLLM_LOGGING_LEVEL=INFO brings vLLM's logs back."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _stopped_message(what: str, status: controller.RunStatus, anywhere: bool = False) -> str:
    """`what` stopped the run: where it was, and what a resume starts from."""
    where = f"during step {status.step}" if status.step else "before the first step"
    # The disk, not only the status: a checkpoint renamed into place just before the
    # failure is on disk before the status hears of it.
    on_disk = checkpoint.newest(status.run_dir) if status.run_dir is not None else None
    last = on_disk or status.last_checkpoint
    if last is None:
        return f"rpk: {what} {where}; no checkpoint yet, nothing to resume"
    return (
        f"rpk: {what} {where}; `--run.resume {status.run_dir}` continues from "
        f"{last.name}" + (", on this many nodes or another" if anywhere else "")
    )


@launch.record
def _follower(cfg: Config, place: layout.ParallelLayout) -> int:
    joined = launch.join(place, cfg.dist.timeout_s)
    host = None
    try:
        if place.hosts_engines and place.node != 0:
            host = assembly.start_node_host(cfg.dist, place.node)
        follow(joined.channel, lambda d: assembly.make_torch_trainer(
            assembly.trainer_plan(cfg, assembly.box_for(cfg, Path(d))), Path(d), joined.sharding))
    except NodeFailure as e:
        print(f"rpk: {e}", file=sys.stderr)
        return 1
    finally:
        if host is not None:
            host.stop()
        joined.close()
    return 0


def _ranks_wanted(cfg: Config) -> int:
    """`dist.nproc`, else a rank on each of the trainer's GPUs (`dist.trainer_gpus`, or
    every GPU where there are several), else one."""
    gpus = launch.cuda_devices()
    return cfg.dist.nproc or cfg.dist.trainer_gpus or (gpus if gpus > 1 else 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config.from_argv(args)
        if cfg.run.dry_run:
            return _dry_run(cfg)
        if cfg.dist.gpus or cfg.dist.gpu_mem_gb or cfg.dist.host_mem_gb or cfg.dist.nodes != 1:
            raise ConfigError("dist.gpus, dist.gpu_mem_gb, dist.host_mem_gb and dist.nodes are a dry "
                              "run's target: add --run.dry_run true")
        if not layout.launched_by_torchrun() and (n := _ranks_wanted(cfg)) > 1:
            return launch.relaunch(args, n)
        place = layout.from_env(dp_replicate=cfg.dist.dp_replicate, engine_nodes=cfg.dist.engine_nodes)
        placement = assembly.place(cfg.rollout, place)
    except UserError as e:
        print(f"rpk: config error: {e}", file=sys.stderr)
        return 2
    if not place.is_controller:
        return _follower(cfg, place)
    return _controller(cfg, placement)


def _dry_run(cfg: Config) -> int:
    """Print what the run would start (layout, memory plan, engine arguments) as JSON."""
    model_dir = assembly.model_config_dir(cfg.model) if cfg.model.path is not None else None
    print(json.dumps(dry_run(cfg, model_dir), indent=2))
    return 0


async def _run(
    cfg: Config, placement: assembly.Placement, settings: RunSettings, progress: LiveProgress,
    status: controller.RunStatus, joined: launch.Joined | None = None,
) -> controller.RunResult:
    """Config flows one way: where the run starts (`controller.resume`), the components
    built for it (`assembly.assemble`), then the steps (`controller.run`), which get only
    components and settings. `joined`: rank 0's place in a multi-process run
    (`rpk.gpu.launch.Joined`), else None."""
    point = await controller.resume(settings, progress, status)
    parts = await assemble(cfg, placement, progress.message, point, joined)
    return await controller.run(settings, parts, progress, status, point)


@launch.record
def _controller(cfg: Config, placement: assembly.Placement) -> int:
    place = placement.layout
    assert place is not None
    quiet_libraries()
    settings = run_settings(cfg)
    progress = LiveProgress(settings.steps, live=cfg.run.progress)
    status = controller.RunStatus()
    joined = launch.join(place, cfg.dist.timeout_s) if place.distributed else None
    if joined is not None:
        progress.message(f"rpk: {place.describe()}")
    try:
        with progress:
            result = run_async(
                _interruptible(_run(cfg, placement, settings, progress, status, joined), progress),
                use_uvloop=cfg.run.uvloop,
            )
    except Interrupted as e:
        progress.console.print(_stopped_message(f"interrupted by {e}", status), style="yellow", markup=False)
        return e.exit_code
    except Exception as e:
        # Errors in what the user gave (config, data, model, reward) get one clear line
        # each, also when they come out of a TaskGroup; anything else is a bug: traceback.
        leaves = list(_leaves(e))
        if lost := next((x for x in leaves if isinstance(x, NodeFailure)), None):
            progress.console.print(_stopped_message(f"{lost};", status, anywhere=True), style="red", markup=False)
            return 1
        if not all(isinstance(x, UserError) for x in leaves):
            raise
        for x in leaves:
            progress.console.print(f"rpk: {x}", style="red", markup=False)
        return 2
    finally:
        if joined is not None:
            joined.close()
    progress.console.print(summary_table(result.summary, str(result.run_dir)))
    progress.console.print(f"final checkpoint: {result.last_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
