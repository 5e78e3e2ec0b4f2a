"""Colocated rollout and training: the fleet sleeps while the trainer trains and wakes
in two parts around the weight sync, the trainer's state waits on host during rollout,
only one layout is ever awake. Driven through the real `run_step`, `Fleet`, layouts and
elastic regroups on virtual time, with simulated GPU memory from the plan; and against
vLLM 0.32's own signatures with the device checks patched."""

from __future__ import annotations

import dataclasses
import inspect
import json
import zlib
from pathlib import Path

import pytest

from rpk.core.modes import Offload, RestLevel
from rpk.core.records import RoundKind
from rpk.gpu.plan import Knobs, ModelShape, Target, plan_memory
from rpk.loop.elastic import RolloutTP
from rpk.loop.feed import Streaming
from rpk.loop.step import run_step, while_resting
from rpk.loop.trainer import AsyncTrainer
from rpk.sched.policy import Sampling, SyncPolicy, TailPolicy
from rpk.sched.tp_planner import PlannerConfig, TPPlanner
from rpk.sim import CostModel
from rpk.sim.fleet import sim_fleet
from rpk.sim.memory import GpuMemory, OverCommit, capacity_of, watch
from rpk.sim.trainer import TrainCost, sim_trainer
from tests.fakes import LengthScorer, SignedLLM, make_prompts, mean_centred
from tests.helpers import index_of, prompt_of

MODELS = Path(__file__).parent / "fixtures" / "models"
COST = CostModel(base_s=0.01, per_seq_s=1e-4, prefill_token_s=1e-5, kv_tokens=600,
                 weight_tokens=400, tp_comm_s=0.001, sync_s=0.5, sleep_s=0.1, wake_s=0.2)


def length(r) -> int:
    return 80 + zlib.crc32(f"{prompt_of(r)}:{index_of(r)}".encode()) % 40


def policy(p0: int = 4, tail: bool = False):
    sampling = Sampling(prompts_per_step=p0, responses_per_prompt=4, max_tokens=200)
    cls = TailPolicy if tail else SyncPolicy
    return cls(make_prompts(40), sampling, shuffle=False)


class Events:
    """One log of every replica's and the trainer's calls, in order, and a check at
    each that at most one layout is awake."""

    def __init__(self, fleet) -> None:
        self.log: list[tuple[str, str]] = []
        self.fleet = fleet
        for layout in fleet.layouts.all:
            for name, r in zip(layout.names, layout.replicas):
                self._wrap(name, r)

    def _awake_layouts(self) -> int:
        return sum(any(not r.asleep for r in layout.replicas) for layout in self.fleet.layouts.all)

    def _wrap(self, name: str, r) -> None:
        sleep, wake, load = r.sleep, r.wake, r.load_weights

        async def sleeping(level: int = 2) -> None:
            await sleep(level)
            self.log.append((name, f"sleep{level}"))

        async def waking(tags=None) -> None:
            await wake(tags)
            self.log.append((name, "wake" if tags is None else "wake:" + ",".join(tags)))
            assert self._awake_layouts() <= 1, self.log

        async def loading(version: int) -> None:
            await load(version)
            self.log.append((name, f"load{version}"))

        r.sleep, r.wake, r.load_weights = sleeping, waking, loading

    def trainer(self, t: AsyncTrainer, offload: str = "all") -> None:
        accumulate, finish = t.accumulate, t.finish_step

        async def accumulating(samples):
            self.log.append(("trainer", "accumulate"))
            return await accumulate(samples)

        async def finishing():
            self.log.append(("trainer", "finish"))
            return await finish()

        async def offloading(what: Offload) -> None:
            self.log.append(("trainer", f"offload:{what.value}"))

        t.accumulate, t.finish_step, t.offload = accumulating, finishing, offloading

    def of(self, who: str) -> list[str]:
        return [e for w, e in self.log if w == who]


async def _steps(fleet, trainer, pol, n: int, between=None, streaming=Streaming(mode="none")):
    out = []
    for step in range(1, n + 1):
        out.append(await run_step(step, pol, fleet, LengthScorer(threshold=100), trainer, mean_centred,
                                  version=trainer.version, clock=fleet.clock, streaming=streaming,
                                  between=between, resting_fleet=fleet))
    return out


async def _colocated(devices: int, tp_sizes: tuple[int, ...], offload: Offload | None = None):
    """A simulated fleet resting at level 2 for a simulated trainer, every call logged."""
    fleet = await sim_fleet(length, cost=COST, devices=devices, tp_sizes=tp_sizes, tp=1, max_num_seqs=64)
    trainer = sim_trainer(fleet.layouts.awake.replicas[0].node, TrainCost(token_s=1e-5))
    events = Events(fleet)
    events.trainer(trainer)
    fleet.rest_level = RestLevel.DROP_WEIGHTS
    if offload is not None:
        fleet.before_kv = lambda: trainer.offload(offload)
    return fleet, trainer, events


async def test_a_colocated_step_sleeps_for_training_and_wakes_in_two_parts() -> None:
    fleet, trainer, events = await _colocated(2, (1,), Offload.ALL)
    try:
        await _steps(fleet, trainer, policy(), 2)
    finally:
        await fleet.shutdown()
    log = events.log
    for name in ("tp1.0", "tp1.1"):
        assert events.of(name) == ["sleep2", "wake:weights", "load1", "wake:kv_cache",
                                   "sleep2", "wake:weights", "load2", "wake:kv_cache"]
    # Per step: every replica asleep before the trainer's first micro-batch; the
    # weights woken and synced before the trainer's state leaves; the KV cache after.
    for step in (1, 2):
        sleeps = [i for i, e in enumerate(log) if e[1] == "sleep2"][2 * (step - 1): 2 * step]
        first_train = next(i for i, e in enumerate(log) if e == ("trainer", "accumulate") and i > sleeps[0])
        loads = [i for i, e in enumerate(log) if e[1] == f"load{step}"]
        offload = [i for i, e in enumerate(log) if e[0] == "trainer" and e[1].startswith("offload")][step - 1]
        kv = [i for i, e in enumerate(log) if e[1] == "wake:kv_cache"][2 * (step - 1): 2 * step]
        assert max(sleeps) < first_train < min(loads) and max(loads) < offload < min(kv)
    assert fleet.resting is None


async def test_a_step_without_an_update_syncs_the_weights_a_level_2_rest_dropped() -> None:
    fleet, trainer, events = await _colocated(1, (1,))
    # A trainer whose step changes nothing (the version stays).
    null = trainer.trainer

    def no_update() -> dict:
        null.in_step = False
        return {"stepped": 0.0}

    null.finish_step = no_update
    try:
        await _steps(fleet, trainer, policy(), 2)
        assert events.of("tp1.0")[:4] == ["sleep2", "wake:weights", "load0", "wake:kv_cache"]
        # Level 1 keeps them: waking is enough.
        fleet.rest_level = RestLevel.KEEP_WEIGHTS
        await _steps(fleet, trainer, policy(), 1)
        assert events.of("tp1.0")[-3:] == ["sleep1", "wake:weights", "wake:kv_cache"]
    finally:
        await fleet.shutdown()


async def test_elastic_regroups_while_resting_wake_only_the_target_layout_in_two_parts() -> None:
    fleet, trainer, events = await _colocated(2, (1, 2), Offload.OPTIMIZER)
    elastic = RolloutTP(TPPlanner(PlannerConfig("elastic", (1, 2), 1)), fleet, trainer, 2**20)
    try:
        outcomes = await _steps(fleet, trainer, policy(tail=True), 3, between=elastic)
    finally:
        await fleet.shutdown()
    assert outcomes[0].round.plan.kind is RoundKind.SHORT and fleet.tp == 2
    # tp1 rested after step 1 and was never slept again nor woken; tp2 woke in two parts.
    assert events.of("tp1.0")[0] == "sleep2" and "wake" not in events.of("tp1.0")[:2]
    assert events.of("tp2.0")[:4] == ["wake:weights", "load1", "wake:kv_cache", "sleep2"]
    assert events.of("trainer").count("offload:optimizer") == 3


def _shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))


async def _memory_run(plan, *, rest: bool, streaming: Streaming, devices: int = 8, steps: int = 2,
                      then=None):
    fleet = await sim_fleet(length, cost=COST, devices=devices, tp_sizes=plan.tp_sizes, tp=plan.tp,
                            max_num_seqs=64)
    trainer = sim_trainer(fleet.layouts.awake.replicas[0].node, TrainCost(token_s=1e-5))
    ledger = GpuMemory(capacity_of(plan), devices)
    watch(ledger, plan, fleet, trainer)
    if rest:
        fleet.rest_level = plan.rest_level
        fleet.before_kv = lambda: trainer.offload(plan.offload)
    try:
        await _steps(fleet, trainer, policy(p0=8), steps, streaming=streaming)
        if then is not None:
            await then(fleet, trainer)
    except* OverCommit as group:  # out of the step's TaskGroup: the one that failed
        raise group.exceptions[0] from None
    finally:
        await fleet.shutdown()
    return ledger, trainer


@pytest.mark.parametrize("name, response", [("7b", 8192), ("7b", 32768), ("14b", 16384), ("14b", 32768)])
async def test_paper_settings_run_colocated_within_each_gpu(name: str, response: int) -> None:
    plan = plan_memory(_shape(name), Target(1, 8, 80 * 10**9), Knobs(max_model_len=response + 1024))
    ledger, trainer = await _memory_run(plan, rest=True, streaming=Streaming(mode="none"))
    assert max(ledger.peak) <= ledger.capacity
    phases = {p for p, _, _ in ledger.log}
    assert {"rollout", "train", "sync"} <= phases
    assert trainer.offloads == [plan.offload] * 2


async def test_14b_on_four_nodes_runs_colocated() -> None:
    plan = plan_memory(_shape("14b"), Target(4, 8, 80 * 10**9), Knobs(max_model_len=16384 + 1024))
    ledger, _ = await _memory_run(plan, rest=True, streaming=Streaming(mode="none"), devices=32, steps=1)
    assert max(ledger.peak) <= ledger.capacity


async def test_training_beside_an_awake_fleet_overcommits_and_names_the_phase() -> None:
    plan = plan_memory(_shape("14b"), Target(1, 8, 80 * 10**9), Knobs(max_model_len=16384 + 1024))
    with pytest.raises(OverCommit, match=r"^stream phase, GPU 0: trainer\."):
        await _memory_run(plan, rest=False, streaming=Streaming(mode="none"))
    # Streaming while the tail generates, which the plan ruled out, fails the same way.
    with pytest.raises(OverCommit, match=r"^stream phase, GPU \d"):
        await _memory_run(plan, rest=True, streaming=Streaming(mode="thread"))


async def test_a_checkpoint_saves_while_the_fleet_rests_and_the_state_moves_out_again(tmp_path) -> None:
    """The controller's save (`while_resting`) on 14B at 16k: the trainer's whole state
    comes back for the save while vLLM sleeps at level 2, as for training, and leaves
    again before the KV cache wakes, through the same weight sync as after a step;
    saved beside the awake fleet it does not fit."""
    plan = plan_memory(_shape("14b"), Target(1, 8, 80 * 10**9), Knobs(max_model_len=16384 + 1024))
    calls: list[str] = []

    async def save(fleet, trainer) -> None:
        rest = fleet.rest

        async def resting(level: int) -> None:
            calls.append(f"rest:{level}")
            await rest(level)

        async def resync() -> None:
            calls.append("sync")
            await fleet.update_weights(trainer.weight_buckets(2**20), trainer.version)

        fleet.rest = resting
        await while_resting(fleet, lambda: trainer.save(tmp_path / "ckpt"), resync)
        assert fleet.resting is None and not any(r.asleep for r in fleet.replicas)

    ledger, trainer = await _memory_run(plan, rest=True, streaming=Streaming(mode="none"), then=save)
    assert calls == ["rest:2", "sync"] and max(ledger.peak) <= ledger.capacity
    assert ("checkpoint", "+trainer.adamw", 0) in ledger.log
    assert trainer.offloads == [plan.offload] * 3  # two steps, then after the save

    async def never() -> None:
        raise AssertionError("an awake fleet needs no sync after a save")

    async def save_awake(fleet, trainer) -> None:
        await while_resting(None, lambda: trainer.save(tmp_path / "ckpt2"), never)

    with pytest.raises(OverCommit, match=r"^checkpoint phase, GPU 0: trainer\."):
        await _memory_run(plan, rest=True, streaming=Streaming(mode="none"), then=save_awake)


async def test_a_small_model_streams_beside_the_tail_within_each_gpu() -> None:
    plan = plan_memory(_shape("0.5b"), Target(1, 8, 80 * 10**9), Knobs(max_model_len=4096))
    ledger, _ = await _memory_run(plan, rest=True, streaming=Streaming(mode="thread"))
    assert "stream" in {p for p, _, _ in ledger.log} and max(ledger.peak) <= ledger.capacity


# -- against vLLM 0.32's signatures, device checks patched -------------------------------


def _replica(log: list, version: int = 0):
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.engine.vllm_stats import ReplicaCounters

    return VLLMEngine(SignedLLM(log), VLLMSettings(model="m"), ReplicaCounters(), version)


async def test_the_vllm_calls_of_a_colocated_sync_match_vllms_signatures() -> None:
    import torch

    from rpk.engine.fleet import Fleet
    from rpk.engine.layouts import Layout, Layouts, LayoutState
    from rpk.sync.spool import SpoolTransport

    log: list = []
    replicas = [_replica(log), _replica(log)]
    fleet = Fleet(Layouts([Layout(1, ("tp1.0", "tp1.1"), replicas, LayoutState.AWAKE)]),
                  SpoolTransport(), version=0)
    fleet.rest_level = RestLevel.DROP_WEIGHTS

    async def before_kv() -> None:
        log.append(("trainer.offload", (), {}))

    fleet.before_kv = before_kv

    async def buckets():
        yield [("model.norm.weight", torch.ones(4))]

    await fleet.rest(RestLevel.DROP_WEIGHTS)
    assert all(r.weight_version is None for r in replicas)
    await fleet.update_weights(buckets(), 1)
    names = [(n, a, k) for n, a, k in log]
    assert names[:2] == [("sleep", (), {"level": 2})] * 2
    assert names[2:4] == [("wake_up", (), {"tags": ["weights"]})] * 2
    loads = [i for i, e in enumerate(names) if e[0] == "collective_rpc"]
    offload = names.index(("trainer.offload", (), {}))
    kv = [i for i, e in enumerate(names) if e == ("wake_up", (), {"tags": ["kv_cache"]})]
    assert len(loads) == 2 and len(kv) == 2 and max(loads) < offload < min(kv)
    assert fleet.version == 1 and all(r.weight_version == 1 for r in replicas)


async def test_cuda_fleet_starts_the_waiting_layouts_asleep_and_one_awake(monkeypatch) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rpk.engine import vllm_fleet
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings, engine_kwargs

    log: list = []
    started: list = []

    async def launch(settings, *, env=None, version=0, name="", verify=False):
        # Every other layout started so far is asleep.
        tp = settings.tensor_parallel_size
        assert all(r.asleep for r in started if r.tp != tp), "a layout started while another was awake"
        r = _replica(log, version)
        r.tp = tp
        r.asleep = False
        r.env = env
        started.append(r)
        kwargs = engine_kwargs(settings, cuda=True)
        inspect.signature(AsyncEngineArgs).bind(**kwargs)
        assert kwargs["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in kwargs
        return r

    async def sleep(self, level: int = 2) -> None:
        await self.llm.sleep(level=level)
        self.asleep = True

    monkeypatch.setattr(VLLMEngine, "launch", staticmethod(launch))
    monkeypatch.setattr(VLLMEngine, "sleep", sleep)
    settings = VLLMSettings(model="m", kv_cache_memory_bytes=None, enable_sleep_mode=True,
                            gpu_memory_utilization=0.9)
    plan = fleet_plan(tuple(range(4)), (1, 2, 4), 1, True)
    fleet = await vllm_fleet.launch_fleet(settings, plan, platform="cuda")
    assert [layout.state.value for layout in fleet.layouts.all] == ["awake", "asleep", "asleep"]
    assert [r for r in started if not r.asleep] == list(fleet.layouts.awake.replicas)
    assert started[-4:] == list(fleet.layouts.awake.replicas)  # the awake layout last
    assert [r.env for r in fleet.layouts.awake.replicas] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]


@pytest.mark.parametrize("resumed", [False, True])
async def test_a_cuda_build_loads_the_trainer_and_moves_it_out_before_vllm_starts(
    monkeypatch, tmp_path, resumed: bool
) -> None:
    """Resumed, the trainer's state is restored before it moves out: restored after
    vLLM started, it would come back beside the KV cache."""
    import shutil

    from rpk import assembly
    from rpk.assembly import box
    from rpk.config import from_argv

    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-7b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)  # such a box's RAM
    order: list[str] = []

    class Trainer:
        version = 0

        async def offload(self, what: Offload) -> None:
            order.append(f"offload:{what.value}")

        async def load(self, directory: Path) -> None:
            order.append(f"load:{directory.name}")

        async def aclose(self) -> None:
            pass

    def build_trainer(plan, model_dir, joined=None):
        order.append("trainer")
        return Trainer()

    async def start_engine(model_dir, plan, version, log, trainer=None, rest=None, judges=None):
        from rpk.engine.fleet import Fleet
        from rpk.engine.layouts import Layout, Layouts, LayoutState

        order.append("engine")
        settings = plan.engine
        assert settings.enable_sleep_mode and settings.kv_cache_memory_bytes is None
        return Fleet(Layouts([Layout(1, ("tp1.0",), [_replica([])], LayoutState.AWAKE)]), None, version=0, rest=rest)

    monkeypatch.setattr(assembly.start, "build_trainer", build_trainer)
    monkeypatch.setattr(assembly.start, "start_engine", start_engine)
    monkeypatch.setattr(assembly.parts, "check_lengths", lambda rollout, d, p: 32768)
    cfg = from_argv(["--rollout.max_tokens", "8192", "--rollout.prompts_per_step", "2"])
    prompts = [dataclasses.replace(p, data_source="rpk/arith") for p in make_prompts(4)]
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), model, prompts, lambda line: None,
                              state_from=tmp_path / "step_000004" if resumed else None)
    assert order == ["trainer", *(["load:step_000004"] if resumed else []), "offload:all", "engine"]
    assert parts.engine.rest_level == 2 and parts.engine.before_kv is not None
    assert parts.resting_fleet is parts.engine
    await parts.engine.before_kv()
    assert order[-1] == "offload:all"
    await parts.scorer.aclose()


async def test_a_cuda_build_runs_before_kv_when_nothing_is_offloaded(monkeypatch, tmp_path) -> None:
    """`offload none` still drops the gradients and hands the trainer's cache back before
    the KV cache wakes: vLLM's KV was sized beside the trainer's state alone."""
    import shutil

    from rpk import assembly
    from rpk.assembly import box
    from rpk.config import from_argv

    model = tmp_path / "m"
    shutil.copytree(MODELS / "qwen2.5-0.5b", model)
    monkeypatch.setattr(box, "_cuda_seen", lambda: (8, 80 * 10**9))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)
    offloads: list[Offload] = []

    class Trainer:
        version = 0

        async def offload(self, what: Offload) -> None:
            offloads.append(what)

        async def aclose(self) -> None:
            pass

    async def start_engine(model_dir, plan, version, log, trainer=None, rest=None, judges=None):
        from rpk.engine.fleet import Fleet
        from rpk.engine.layouts import Layout, Layouts, LayoutState

        return Fleet(Layouts([Layout(1, ("tp1.0",), [_replica([])], LayoutState.AWAKE)]), None, version=0, rest=rest)

    monkeypatch.setattr(assembly.start, "build_trainer", lambda plan, model_dir, joined=None: Trainer())
    monkeypatch.setattr(assembly.start, "start_engine", start_engine)
    monkeypatch.setattr(assembly.parts, "check_lengths", lambda rollout, d, p: 32768)
    cfg = from_argv(["--rollout.max_tokens", "1024", "--rollout.prompts_per_step", "2",
                     "--train.offload", "none"])
    prompts = [dataclasses.replace(p, data_source="rpk/arith") for p in make_prompts(4)]
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), model, prompts, lambda line: None)
    assert parts.engine.before_kv is not None
    await parts.engine.before_kv()
    assert offloads == [Offload.NONE] * 2, offloads
    await parts.scorer.aclose()
