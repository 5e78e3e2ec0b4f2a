"""The rollout fleet on vLLM: every layout's replicas started on their devices, the
ones not awake put to sleep, and the weight path the config names.

Replicas are started one after another from the event loop's thread (an `AsyncLLM`
made in a thread that then ends loses its engine core). A replica of TP t gets t times
`max_num_seqs` (it is per device) and t workers, each with the per-worker KV budget, so
a larger TP holds more KV per replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from rpk.engine.fleet import Fleet, Rest
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.engine.placement import FleetPlan, Platform, device_env
from rpk.engine.vllm_engine import VLLMEngine
from rpk.engine.vllm_settings import VLLMSettings
from rpk.sync.backends import BACKENDS, Backend, for_replica
from rpk.sync.m2n_lane import ShardSenders
from rpk.sync.transport import make_transport

Switch = Literal["sleep", "restart"]


def replica_settings(
    settings: VLLMSettings, tp: int, transfer: Backend = Backend.SPOOL, devices: Sequence[int] = (),
) -> VLLMSettings:
    """A TP-`tp` replica's settings: `max_num_seqs` is per device; `transfer`: its
    backend (`for_replica`), whose vLLM engine it starts with (none for the spool's files
    and adapters); `devices`: its GPUs."""
    return dataclasses.replace(
        settings, tensor_parallel_size=tp, max_num_seqs=settings.max_num_seqs * tp,
        backend=transfer, devices=tuple(devices),
    )


def twins(settings: VLLMSettings) -> tuple[VLLMSettings, ...]:
    """The replicas one place runs: itself, or, with speculating twins, a plain replica
    first and its speculating twin (`rpk.engine.fleet.Fleet.hand_over`)."""
    spec = settings.speculative
    if spec is None or not spec.twin:
        return (settings,)
    return (dataclasses.replace(settings, speculative=None), settings)


def replica_names(name: str, settings: VLLMSettings) -> tuple[str, ...]:
    """The names of `twins(settings)` at the place `name`."""
    return (name, f"{name}+spec") if len(twins(settings)) == 2 else (name,)


async def launch_fleet(
    settings: VLLMSettings,
    plan: FleetPlan,
    *,
    platform: Platform,
    backend: Backend = Backend.SPOOL,
    verify: bool = False,
    switch: Switch = "sleep",
    version: int = 0,
    log: Callable[[str], None] = lambda line: None,
    shards: ShardSenders | None = None,
    adapter: Mapping[str, Any] | None = None,
    rest: Rest | None = None,
) -> Fleet:
    """Start the layouts of `plan` (only the awake one with restart-on-switch) serving
    the model in `settings` as weight version `version`; `verify`: every sync is
    checked against the trainer's weights (`rpk.sync.verify`); `shards`: the sharded
    trainer's ranks, for an m2n backend; `adapter`: the adapter config of
    `Backend.ADAPTER`, a LoRA run's (its replicas take adapters, `settings.max_lora_rank`);
    `rest`: how the fleet shares its devices with the trainer."""
    places = plan.layouts()
    # before any replica starts: it may refuse
    transport = make_transport(backend, verify, shards, dtype=settings.dtype, adapter=adapter)
    started: list[VLLMEngine] = []
    # The IPC handles travel pickled.
    env_extra = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if BACKENDS[backend].pickles_handles else {}

    async def launch_layout(tp: int, version: int | None = version) -> Sequence[VLLMEngine]:
        replicas = []
        for place in places[tp]:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env = {**(device_env(place, platform, visible) if plan.pinned else {}), **env_extra}
            s = replica_settings(settings, tp, for_replica(backend, place.devices), place.devices)
            for name, each in zip(replica_names(place.name, s), twins(s)):
                t0 = time.perf_counter()
                replica = await VLLMEngine.launch(each, env=env, version=version, name=name, verify=verify)
                replica.keep_cut = replica.keep_cut or each is not s  # a plain twin keeps them for its twin
                started.append(replica)
                replicas.append(replica)
                if len(places) > 1 or plan.pinned:
                    on = "device" if len(place.devices) == 1 else "devices"
                    ids = ",".join(map(str, place.devices))
                    log(f"rollout replica {name} on {on} {ids}: up in {time.perf_counter() - t0:.1f}s")
        return replicas

    # The layouts that wait start first, each put to sleep before the next starts, and
    # the awake one last: on a GPU only one layout ever holds weights and a KV cache
    # (vLLM sizes its cache from the memory free when it starts).
    order = [tp for tp in places if tp != plan.tp and switch == "sleep"] + [plan.tp]
    try:
        layouts = {tp: Layout(tp, tuple(n for p in places[tp] for n in replica_names(p.name, settings)), [],
                              LayoutState.STOPPED)
                   for tp in places}
        for tp in order:
            layouts[tp].replicas = list(await launch_layout(tp))
            layouts[tp].move(LayoutState.AWAKE)
            if tp != plan.tp:
                await asyncio.gather(*(r.sleep() for r in layouts[tp].replicas))
                layouts[tp].move(LayoutState.ASLEEP)
        # A LoRA replica started anew serves the base alone: stale until the regroup sends
        # it the adapter (the first start's replicas serve `version`: a resumed run
        # installs the checkpoint's adapter before any round).
        restart = (lambda tp: launch_layout(tp, None)) if backend is Backend.ADAPTER else launch_layout
        relaunch = restart if switch == "restart" else None
        return Fleet(Layouts(list(layouts.values()), relaunch), transport, version=version, rest=rest)
    except BaseException:
        await asyncio.gather(*(r.shutdown() for r in started), return_exceptions=True)
        raise
