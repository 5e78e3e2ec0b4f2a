"""Weights over rpk's gloo weight-transfer engine into real CPU vLLM replicas, checked by
`run.verify_sync` after every sync: two TP-1 replicas and an asleep TP-2 replica (two
workers), started once for the module with the `gloo` backend."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rpk.sync.backends import Backend
from tests.integration.engines import buckets, greedy, hf_greedy, prompt_ids, scaled_normal

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(tiny_model_dir: Path):
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings

    settings = VLLMSettings(
        model=tiny_model_dir, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=2**20,
    )
    plan = fleet_plan((0, 1), (1, 2), 1, elastic=True)
    fleet = await launch_fleet(settings, plan, platform="cpu", backend=Backend.GLOO, verify=True)
    try:
        yield fleet
    finally:
        await fleet.shutdown()


async def test_every_gloo_sync_is_verified_and_serves_the_trainers_weights(
    fleet, weights, tiny_model_dir: Path
) -> None:
    from transformers import Qwen2ForCausalLM

    from rpk.sync.verify import VerifiedTransport

    assert isinstance(fleet.transport, VerifiedTransport)
    assert {r.settings.backend for r in fleet.layouts.all[0].replicas} == {Backend.GLOO}
    prompt = prompt_ids(20)
    await fleet.update_weights(buckets(weights), version=1)
    assert fleet.versions() == {"tp1.0": 1, "tp1.1": 1, "tp2.0": None}
    hf = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want = hf_greedy(hf, weights, prompt)
    got = await greedy(fleet, [prompt, prompt], "gloo-1")
    assert [g[:16] for g in got] == [want, want]

    second = scaled_normal(weights, seed=6)
    await fleet.update_weights(buckets(second), version=2)
    assert (await greedy(fleet, [prompt], "gloo-2"))[0][:16] == hf_greedy(hf, second, prompt)


async def test_a_regroup_forms_a_group_of_the_new_layout_and_back(fleet, weights) -> None:
    """The TP-2 replica's two workers join a group sized for them (world 3), verified;
    back at TP 1 the two replicas get a group of their own again."""
    lanes = fleet.transport.inner._lanes
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)
    tp1_group = lanes["gloo"]
    assert tp1_group.world_size == 3 and len(tp1_group.replicas) == 2
    prompts = [prompt_ids(8), prompt_ids(40)]
    at_tp1 = await greedy(fleet, prompts, "rg1")

    await fleet.regroup(2, lambda: buckets(weights))
    tp2_group = lanes["gloo"]
    assert tp2_group is not tp1_group and tp2_group.replicas == fleet.layouts.all[1].replicas
    assert tp2_group.world_size == 3  # the trainer and the TP-2 replica's two workers
    assert await greedy(fleet, prompts, "rg2") == at_tp1
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)  # the same group
    assert lanes["gloo"] is tp2_group

    await fleet.regroup(1, lambda: buckets(weights))
    assert lanes["gloo"] is not tp2_group and lanes["gloo"].replicas == fleet.replicas
    assert await greedy(fleet, prompts, "rg3") == at_tp1


async def test_a_sync_that_loads_other_bytes_fails_naming_the_replica_and_tensor(
    fleet, weights
) -> None:
    from rpk.sync.verify import VerifiedTransport, WeightMismatchError

    victim = "model.layers.0.mlp.down_proj.weight"

    async def corrupted():
        async for bucket in buckets(weights):
            yield [(n, t + 1 if n == victim else t) for n, t in bucket]

    class Corrupting:
        """Sends other bytes than the trainer hashed, as a broken path would."""

        async def push(self, _buckets, replicas, version):
            async for _ in _buckets:
                pass
            await fleet.transport.inner.push(corrupted(), replicas, version)

    check = VerifiedTransport(Corrupting())
    with pytest.raises(WeightMismatchError, match=rf"replica tp1\.0 .*{victim}"):
        await check.push(buckets(weights), fleet.replicas, fleet.version + 1)
    assert fleet.replicas[0].weight_version is None
    await fleet.update_weights(buckets(weights), version=fleet.version + 1)


async def test_a_replica_dying_mid_transfer_fails_the_sync_naming_it(fleet, weights) -> None:
    """Runs last: it kills replica tp1.1's engine core after the first bucket."""
    from rpk.sync.lanes import WeightSyncError

    before = fleet.version
    victim = fleet.replicas[1]
    procs = victim.llm.engine_core.resources.engine_manager.processes

    async def dying():
        n = 0
        async for bucket in buckets(weights):
            yield bucket
            n += 1
            if n == 1:
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                await asyncio.sleep(1.0)

    with pytest.raises(WeightSyncError, match=r"replica tp1\.1"):
        await asyncio.wait_for(fleet.update_weights(dying(), version=before + 1), 120)
    assert fleet.version == before
    assert fleet.versions()["tp1.0"] == before and fleet.versions()["tp1.1"] == before


async def test_cpu_ipc_syncs_from_shared_memory_are_verified_and_exact(
    tiny_model_dir: Path, weights
) -> None:
    """One replica on `cpu_ipc`, fed by a trainer model whose parameters are in shared
    memory (`share_weights`, as a CPU run's): two syncs that copy nothing on the trainer's
    side, each verified and serving exactly the trainer's weights, and the replica keeps
    serving them when the trainer's parameters then change (it holds no view of them);
    then weights outside shared memory, through the staging files."""
    from transformers import Qwen2ForCausalLM

    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.sync.cpu_ipc import share_weights

    settings = VLLMSettings(
        model=tiny_model_dir, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=2**20,
    )
    fleet = await launch_fleet(settings, fleet_plan((), (), 1, False), platform="cpu",
                               backend=Backend.CPU_IPC, verify=True)
    try:
        hf = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        trainer = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        assert share_weights(trainer) is not None
        prompt = prompt_ids(24)
        for version, seed in ((1, 21), (2, 22)):
            new = scaled_normal(weights, seed=seed)
            with torch.no_grad():  # a step: the trainer's parameters change in place
                for name, t in trainer.state_dict().items():
                    t.copy_(new[name])
            await fleet.update_weights(buckets(trainer.state_dict()), version=version)
            assert fleet.versions() == {"tp1.0": version}
            assert fleet.transport.inner._staging.copied_bytes == 0
            want = hf_greedy(hf, new, prompt)
            assert (await greedy(fleet, [prompt], f"ipc-{version}"))[0][:16] == want
        with torch.no_grad():
            for t in trainer.parameters():
                t.mul_(-1.0)
        assert (await greedy(fleet, [prompt], "ipc-after"))[0][:16] == want
        new = scaled_normal(weights, seed=23)
        await fleet.update_weights(buckets(new), version=3)
        assert (await greedy(fleet, [prompt], "ipc-3"))[0][:16] == hf_greedy(hf, new, prompt)
        assert fleet.transport.inner._staging.copied_bytes > 0
        staging = fleet.transport.inner._staging._files
        assert len(staging) > 1 and all(Path(p).exists() for p, _, _ in staging)
    finally:
        await fleet.shutdown()
    assert not any(Path(p).exists() for p, _, _ in staging)


@pytest.mark.parametrize("transfer", ["auto", "cpu_ipc", "gloo"])
async def test_a_cpu_trainer_built_for_cpu_ipc_keeps_its_weights_in_shared_memory(
    tiny_model_dir: Path, transfer: str
) -> None:
    """The trainer a CPU run builds hands every tensor of its buckets over where it lies
    when its weights go by `cpu_ipc` (`auto` on CPU), and moves nothing otherwise."""
    import dataclasses

    from rpk.assembly import box_for, make_torch_trainer, trainer_plan
    from rpk.assembly.box import weight_path
    from rpk.config import Config
    from rpk.sync.cpu_ipc import shared_handle

    cfg = Config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, weight_transfer=transfer))
    box = box_for(cfg, tiny_model_dir)
    trainer = make_torch_trainer(trainer_plan(cfg, box, weight_path(cfg, box, 1)), tiny_model_dir)
    tensors = [t for bucket in trainer.weight_buckets(2**20) for _, t in bucket]
    handed = [shared_handle(t) is not None for t in tensors]
    assert tensors and handed == [transfer != "gloo"] * len(tensors)
