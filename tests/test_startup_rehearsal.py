"""The start-up sequence, rehearsed on simulated GPUs: the real `start_parts` (the judge
first, then the trainer's load and move out, then `launch_fleet`'s layouts, the waiting
ones started and put to sleep before the awake one) and then a colocated step's rest,
training, two-part wake around the sync, the judge's wake and an elastic regroup, each
call booked on a ledger of every GPU's memory.

Each vLLM engine's start books its context (NCCL's buffers included) and then meets
vLLM's own start-up check (`vllm/v1/worker/utils.py`, `request_memory`): the memory free
on each of its GPUs at least `gpu_memory_utilization` x total; its KV cache, what that
budget leaves once its weights and reserve are in, holds at least one sequence of its
`max_model_len` (vLLM refuses to start otherwise). Asleep it leaves rpk's priced residue
behind (context, and its CUDA-graph pool unless eager); the trainer holds the plan's
bytes. Every booking is checked against the GPU's physical memory. Only the sizes are
rpk's prices: the calls, their order and the engine arguments are the code's own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rpk import assembly
from rpk.assembly import box
from rpk.config import from_argv
from rpk.core.modes import Offload
from rpk.core.records import Prompt
from rpk.gpu.plan import MemoryPlan, Phase, judge, pricing
from rpk.gpu.plan.pricing import offloaded_names, state_residents, vllm_fixed
from rpk.judge.cache import unwrap
from tests.fakes import SignedLLM, make_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MODELS = Path(__file__).parent / "fixtures" / "models"
GPUS, GPU_BYTES = 8, 80 * 10**9
GiB = 2**30


class StartRefused(RuntimeError):
    """vLLM would refuse to start this engine (its free-memory or KV-cache check)."""


class OutOfMemory(RuntimeError):
    """A booking past a GPU's physical memory."""


class Ledger:
    """Each GPU's bytes, by holder."""

    def __init__(self, gpus: int, total: int) -> None:
        self.total = total
        self.held: list[dict[str, int]] = [{} for _ in range(gpus)]
        self.log: list[str] = []

    def free(self, gpu: int) -> int:
        return self.total - sum(self.held[gpu].values())

    def book(self, who: str, nbytes: int, gpus: Sequence[int], moment: str) -> None:
        for g in gpus:
            self.held[g][who] = self.held[g].get(who, 0) + nbytes
            if self.free(g) < 0:
                top = sorted(self.held[g].items(), key=lambda kv: -kv[1])[:4]
                raise OutOfMemory(f"{moment}: GPU {g} over by {-self.free(g) / GiB:.2f} GiB "
                                  f"({', '.join(f'{k} {v / GiB:.1f}' for k, v in top)} GiB)")
        self.log.append(f"{moment}: +{who} {nbytes / GiB:.2f} GiB on {list(gpus)}")

    def drop(self, who: str, gpus: Sequence[int], keep: int = 0) -> None:
        for g in gpus:
            if keep:
                self.held[g][who] = keep
            else:
                self.held[g].pop(who, None)


@dataclasses.dataclass
class Rehearsal:
    ledger: Ledger
    plan: MemoryPlan | None = None
    starts: list[tuple[str, tuple[int, ...], float]] = dataclasses.field(default_factory=list)
    lines: list[str] = dataclasses.field(default_factory=list)  # what the start logged

    def engine_bytes(self, settings: Any) -> tuple[int, int, int]:
        """(weights, reserve and other non-KV bytes, KV bytes a token) of an engine per
        GPU, by the plan's prices: a rollout replica or a judge engine."""
        assert self.plan is not None
        k, tp = self.plan.knobs, settings.tensor_parallel_size
        if settings.prefetch_offload is not None or settings.enforce_eager:  # the judge
            assert k.judge is not None and self.plan.judge is not None
            j = k.judge
            awake = {r.name: r.bytes for r in judge.awake(j, self.plan.judge)}
            return (awake["weights"], awake.get("prefetch_buffers", 0) + awake["reserve"],
                    j.shape.kv_bytes_per_token(k.kv_bytes))
        fixed = {r.name: r.bytes for r in vllm_fixed(self.plan.shape, k, tp)}
        return (fixed["weights"], fixed["reserve"] + fixed.get("lora_slot", 0),
                self.plan.shape.kv_bytes_per_token(k.kv_bytes) // tp)


class LedgerLLM(SignedLLM):
    """An AsyncLLM whose every call is bound to vLLM 0.32's signature and whose sleep and
    wake move its bytes on the ledger: its budget (`gpu_memory_utilization` x total)
    while awake; asleep, its context and CUDA-graph pool (rpk's priced residue); at
    level 1 its weights wait on host, at level 2 they are dropped."""

    def __init__(self, r: Rehearsal, name: str, devices: tuple[int, ...], budget: int, weights: int,
                 graphs: int) -> None:
        super().__init__([])
        self.r, self.name, self.devices = r, name, devices
        self.budget, self.weights, self.graphs = budget, weights, graphs
        self.held = budget  # its bytes beside its context, per GPU

    def _set(self, nbytes: int, moment: str) -> None:
        self.r.ledger.drop(self.name, self.devices)
        self.held = nbytes
        self.r.ledger.book(self.name, nbytes, self.devices, moment)

    async def sleep(self, *a: Any, **k: Any) -> None:
        await super().sleep(*a, **k)
        self._set(self.graphs, f"{self.name} asleep")

    async def wake_up(self, *a: Any, **k: Any) -> bool:
        await super().wake_up(*a, **k)
        tags = k.get("tags")
        if tags == ["weights"]:
            self._set(self.graphs + self.weights, f"{self.name} wakes its weights")
        else:  # the KV cache after the weights, or all of it at once: the whole budget again
            self._set(self.budget, f"{self.name} wakes")
        return True


def _launcher(r: Rehearsal) -> Any:
    """`VLLMEngine.launch` on the ledger: vLLM's start-up checks, then an engine whose
    llm books its memory."""
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_stats import ReplicaCounters

    async def launch(settings: Any, *, env: Any = None, version: int = 0, name: str = "replica",
                     verify: bool = False, in_thread: bool = False) -> Any:
        visible = (env or {}).get("CUDA_VISIBLE_DEVICES")
        assert visible, f"{name} would start unpinned: on CUDA it lands on GPU 0 with rank 0's mask"
        devices = tuple(int(d) for d in visible.split(","))
        assert len(devices) == settings.tensor_parallel_size, (name, visible)
        who = f"{name}@{','.join(map(str, devices))}"
        ledger = r.ledger
        ledger.book(f"{who}.context", pricing.PROCESS_BYTES, devices, f"{who} starts")
        budget = math.ceil(GPU_BYTES * settings.gpu_memory_utilization)
        for g in devices:  # vllm/v1/worker/utils.py, request_memory
            if ledger.free(g) < budget:
                raise StartRefused(
                    f"{who}: free memory on GPU {g} ({ledger.free(g) / GiB:.2f} GiB) is less than desired GPU "
                    f"memory utilization ({settings.gpu_memory_utilization}, {budget / GiB:.2f} GiB)")
        weights, other, per_token = r.engine_bytes(settings)
        kv = budget - weights - other
        if kv < per_token * (settings.max_model_len or 0):
            raise StartRefused(f"{who}: a KV cache of {kv / GiB:.2f} GiB holds less than one sequence of "
                               f"{settings.max_model_len} tokens")
        graphs = 0 if settings.enforce_eager else pricing.CUDA_GRAPH_BYTES
        llm = LedgerLLM(r, who, devices, budget, weights, graphs)
        ledger.book(who, budget, devices, f"{who} starts")
        r.starts.append((who, devices, settings.gpu_memory_utilization))
        return VLLMEngine(llm, settings, ReplicaCounters(), version, name)  # type: ignore[arg-type]

    return launch


class Trainer:
    """The trainer's ranks on every GPU, holding the plan's bytes: its shards after the
    load, what its offloads move out, a step's whole row while it trains."""

    version = 0

    def __init__(self, r: Rehearsal) -> None:
        self.r = r
        self.gpus = range(GPUS)
        self.offloads: list[Offload] = []

    def _plan(self) -> MemoryPlan:
        assert self.r.plan is not None
        return self.r.plan

    def loaded(self) -> None:
        p = self._plan()
        self.r.ledger.book("trainer.context", pricing.PROCESS_BYTES, self.gpus, "trainer loads")
        # The load holds the parameter shards; AdamW's moments come with the first step.
        state = sum(x.bytes for x in state_residents(p.shape, p.knobs, p.fsdp) if "adamw" not in x.name)
        self.r.ledger.book("trainer.state", state, self.gpus, "trainer loads")

    async def offload(self, what: Offload) -> None:
        p = self._plan()
        self.offloads.append(what)
        moved = offloaded_names(p.knobs, what)
        kept = sum(x.bytes for x in state_residents(p.shape, p.knobs, p.fsdp)
                   if x.name not in moved and (self.stepped or "adamw" not in x.name))
        self.r.ledger.drop("trainer.state", self.gpus)
        self.r.ledger.drop("trainer.step", self.gpus)
        self.r.ledger.book("trainer.state", kept, self.gpus, f"trainer offload {what.value}")

    stepped = False

    def train(self) -> None:
        """A step's micro-batch and optimizer step: the plan's train row (its context aside)."""
        p = self._plan()
        row = next(x for x in p.phases if x.phase is Phase.TRAIN)
        nbytes = sum(x.bytes for x in row.residents if x.owner == "trainer" and x.name != "context")
        self.r.ledger.drop("trainer.state", self.gpus)
        self.r.ledger.book("trainer.step", nbytes, self.gpus, "train")
        self.stepped = True
        # The step's end: state kept, gradients and activations freed (before the sync).
        state = sum(x.bytes for x in state_residents(p.shape, p.knobs, p.fsdp))
        self.r.ledger.drop("trainer.step", self.gpus)
        self.r.ledger.book("trainer.state", state, self.gpus, "step ends")

    async def load(self, directory: Path) -> None:
        pass

    async def aclose(self) -> None:
        pass


class Transport:
    """The weight sync's bytes: two buckets on every GPU (each rank's gathered copies),
    and rank 0's IPC lane's copy on the other GPUs of a replica holding GPU 0, which
    leaves rank 0's context there."""

    def __init__(self, r: Rehearsal) -> None:
        self.r = r
        self.peers: set[int] = set()

    async def push(self, buckets: Any, replicas: Sequence[Any], version: int) -> None:
        async for _ in buckets:
            pass
        p = self.r.plan
        assert p is not None
        bucket = pricing.sync_bucket(p.shape, p.knobs)
        for rep in replicas:
            devices = tuple(rep.settings.devices)
            if 0 in devices and len(devices) > 1 and not self.peers >= set(devices[1:]):
                new = sorted(set(devices[1:]) - self.peers)
                self.r.ledger.book("trainer.peer_context", pricing.PEER_CONTEXT_BYTES, new, "IPC lane")
                self.peers |= set(new)
        copy = math.ceil(bucket * p.knobs.engine_bytes / p.knobs.master_bytes)
        self.r.ledger.book("sync.buckets", 2 * bucket, range(GPUS), f"sync {version}")
        self.r.ledger.book("sync.peer_copy", copy, sorted(self.peers), f"sync {version}")
        self.r.ledger.drop("sync.buckets", range(GPUS))
        self.r.ledger.drop("sync.peer_copy", range(GPUS))
        for rep in replicas:
            await rep.weights_loaded(version, 0.0)

    async def close(self) -> None:
        pass


class Tokenizer:
    """A chat tokenizer with no special tokens: a judge's requests go through its chat
    template (`rpk.judge.prompt.ChatTokens`), every word is one token."""

    added_tokens_decoder: dict[int, Any] = {}

    def __call__(self, text: str, add_special_tokens: bool = False,
                 split_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [sum(map(ord, text)) % 1000]}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [str(i) for i in ids]

    def apply_chat_template(self, messages: Sequence[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str:
        said = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return said + ("assistant: " if add_generation_prompt else "")


async def rehearse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: Sequence[str],
                   model: str = "qwen2.5-14b") -> Rehearsal:
    """The start and two colocated steps of the run `argv` on 8 simulated 80 GB GPUs; an
    engine that vLLM would not start raises `StartRefused`, a booking past a GPU
    `OutOfMemory`."""
    from rpk.engine import vllm_fleet
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.judge import vllm as judge_vllm

    r = Rehearsal(Ledger(GPUS, GPU_BYTES))
    trainer = Trainer(r)
    plan_parts = assembly.start.plan_parts

    def planned(*a: Any, **k: Any) -> Any:
        parts = plan_parts(*a, **k)
        r.plan = parts.box.memory
        return parts

    def build_trainer(plan: Any, model_dir: Path, joined: Any = None) -> Trainer:
        trainer.loaded()
        return trainer

    async def no_build(*a: Any, **k: Any) -> None:
        pass

    monkeypatch.setattr(box, "_cuda_seen", lambda: (GPUS, GPU_BYTES))
    monkeypatch.setattr(box, "host_memory", lambda: 2 * 10**12)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no MPS daemon
    monkeypatch.setattr(assembly.start, "plan_parts", planned)
    monkeypatch.setattr(assembly.start, "build_trainer", build_trainer)
    monkeypatch.setattr(assembly.start.tiny_build, "build", no_build)
    monkeypatch.setattr(assembly.parts, "check_lengths", lambda rollout, d, p: rollout.max_tokens + 1024)
    monkeypatch.setattr(VLLMEngine, "launch", staticmethod(_launcher(r)))
    monkeypatch.setattr(vllm_fleet, "make_transport", lambda *a, **k: Transport(r))
    monkeypatch.setattr(judge_vllm, "model_dir", lambda model, hub_cache=None: Path(model))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tokenizer())

    cfg = from_argv(["--rollout.prompts_per_step", "2", "--model.cache_dir", str(tmp_path), *argv])
    judged = "arith_judged" in argv or "--reward.judge.model" in argv
    prompts: list[Prompt] = [dataclasses.replace(p, data_source="rpk/arith_judged" if judged else "rpk/arith",
                                                 reward_style="model" if judged else p.reward_style)
                             for p in make_prompts(4)]
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), MODELS / model, prompts, r.lines.append)
    try:
        fleet, rester = parts.engine, parts.resting_fleet
        assert rester is not None and fleet.rest_level is not None
        # The pool behind the verdict cache.
        judges = list(getattr(unwrap(parts.scorer.judge.engine), "engines", [])) if parts.scorer.judge else []

        async def buckets() -> Any:
            yield []

        for step, target in ((1, None), (2, max(fleet.layouts.sizes))):
            await rester.rest(fleet.rest_level)
            trainer.train()
            if target is None or target == fleet.tp:
                await fleet.update_weights(buckets(), step)
            else:  # the sync goes straight into the next round's layout
                await fleet.regroup(target, buckets, version=step)
            for j in judges:  # each wakes at its first verdict, after the fleet's KV cache
                await j.rest.wake()
    finally:
        await parts.aclose()
    return r


ELASTIC_14B = ["--rollout.max_tokens", "16384", "--rollout.tp", "elastic"]


@pytest.mark.parametrize("argv", [
    pytest.param(ELASTIC_14B, id="14b-16k-elastic"),
    pytest.param([*ELASTIC_14B, "--data.task", "arith_judged"], id="14b-16k-elastic-tiny-judge"),
    pytest.param([*ELASTIC_14B, "--reward.judge.model", str(MODELS / "qwen2.5-7b")], id="14b-16k-elastic-7b-judge"),
    pytest.param(["--rollout.max_tokens", "32768", "--model.lora_rank", "8"], id="14b-32k-lora"),
    pytest.param(["--rollout.max_tokens", "8192", "--rollout.tp_size", "2"], id="14b-8k-tp2"),
])
async def test_every_engine_meets_vllms_start_check_in_the_codes_order(monkeypatch, tmp_path, argv) -> None:
    r = await rehearse(monkeypatch, tmp_path, argv)
    assert r.plan is not None
    names = [s[0] for s in r.starts]
    judged = any("judge" in a for a in argv)
    if judged:
        # The judges first, one pinned to each GPU; then the rollout's layouts.
        assert [n.split("@")[1] for n in names[:GPUS]] == [str(g) for g in range(GPUS)]
        assert all(n.startswith("judge@") for n in names[:GPUS])
        assert any(line.startswith("judge: CUDA MPS is off") for line in r.lines)
    rollout = [s for s in r.starts if not s[0].startswith("judge@")]
    sizes = r.plan.tp_sizes
    # Waiting layouts first, the awake one last, every GPU covered by each.
    awake = [s for s in rollout if s[0].startswith(f"tp{r.plan.tp}.")]
    assert rollout[-len(awake):] == awake and len({s[0].split(".")[0] for s in rollout}) == len(sizes)
    # The steps ran: the second's sync went into the largest layout, which woke in two
    # parts; each judge woke after it.
    woke = [i for i, line in enumerate(r.ledger.log) if line.startswith(f"tp{max(sizes)}.0@") and "wakes" in line]
    assert woke and "weights" in r.ledger.log[woke[0]]
    if judged:
        last_judge = max(i for i, line in enumerate(r.ledger.log) if line.startswith("judge@") and "wakes" in line)
        assert last_judge > woke[-1]


async def test_an_elastic_plan_that_leaves_out_the_asleep_layouts_fails_the_awake_layouts_start(
        monkeypatch, tmp_path) -> None:
    """c808bb2's plan for default elastic TP counted no asleep layout (H3): the awake one,
    started last beside three asleep ones, then fails vLLM's free-memory check."""
    monkeypatch.setattr(pricing, "ASLEEP_LAYOUT_BYTES", 0)  # the plan as it priced them
    with pytest.raises(ExceptionGroup) as failed:  # the fleet's start, in start_parts' task group
        await rehearse(monkeypatch, tmp_path, ELASTIC_14B)
    assert failed.group_contains(StartRefused, match=r"tp1\.0@0: free memory on GPU 0 .* less than desired")


async def test_a_judge_outside_the_plan_takes_gpu_0_and_the_rollout_cannot_start(monkeypatch, tmp_path) -> None:
    """c808bb2's tiny judge on a GPU box (H2): no judge in the plan, so one engine at
    vLLM's defaults (0.9 of a GPU, no sleep mode), started unpinned: on GPU 0."""
    from rpk.judge.pool import JudgePlan

    def unplanned(cfg: Any, b: Any) -> JudgePlan:
        return JudgePlan(assembly.settings.run_judge_settings(cfg))

    monkeypatch.setattr(assembly.parts, "judge_plan", unplanned)
    with pytest.raises(AssertionError, match="judge would start unpinned"):
        await rehearse(monkeypatch, tmp_path, [*ELASTIC_14B, "--data.task", "arith_judged"])
