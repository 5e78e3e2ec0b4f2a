"""`rollout.weight_transfer m2n` on this CPU: a sharded trainer's ranks each send their
own shards (gloo standing in for NCCL) into real vLLM replicas started with rpk's
`gloo_m2n` engine (`rpk.sync.worker.gloo_m2n`).

- Two gloo trainer ranks (this process and a follower, `tests.dist_harness`) sync into
  two TP-1 replicas, then, after a regroup, into a TP-2 replica's two workers, every
  sync verified: every worker received exactly the trainer's tensors (sha256 per HF
  name), and each replica serves what transformers computes with the trainer's weights.
- `python -m rpk.run --dist.nproc 2 --rollout.weight_transfer m2n --run.verify_sync true`
  runs end to end, every sync verified (the slow tier).
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from rpk.run import main as run_main
from rpk.sync.backends import Backend
from tests.integration.engines import greedy, hf_greedy, prompt_ids
from tests.integration.runs import LIFECYCLE, finish, metrics, start

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def trainer_model_dir(tiny_model_dir: Path, weights: dict[str, torch.Tensor],
                      tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with other weights: what the trainer loads, and the replicas
    (started from `tiny_model_dir`) serve only once a sync has reached them."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("m2n-trainer")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    save_file({n: t.contiguous() for n, t in weights.items() if n != "lm_head.weight"},
              str(path / "model.safetensors"))
    return path


@pytest.mark.asyncio(loop_scope="session")
async def test_two_trainer_ranks_send_their_shards_into_real_replicas(
    tiny_model_dir: Path, trainer_model_dir: Path, weights: dict[str, torch.Tensor],
) -> None:
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.loop.trainer import AsyncTrainer
    from rpk.sync.m2n_lane import TrainerShards
    from rpk.train.dist import DistTrainer
    from tests.dist_harness import make, two_ranks

    settings = VLLMSettings(model=tiny_model_dir, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=2**20)
    loaded = asyncio.get_running_loop().create_future()
    # The replicas start before the trainer's ranks: the harness sets MASTER_PORT here.
    fleet = await launch_fleet(settings, fleet_plan((0, 1), (1, 2), 1, elastic=True), platform="cpu",
                               backend=Backend.GLOO_M2N, shards=TrainerShards(loaded), verify=True)
    stopped = False
    try:
        replicas = [r for layout in fleet.layouts.all for r in layout.replicas]
        assert {r.settings.backend for r in replicas} == {Backend.GLOO_M2N}
        with two_ranks() as joined:
            driven = AsyncTrainer(DistTrainer(joined.channel, lambda d: make(d, joined.sharding),
                                              str(trainer_model_dir)))
            loaded.set_result(driven)
            try:
                await _sync_and_check(fleet, driven, weights, tiny_model_dir)
            finally:
                # The lanes close first (every rank leaves its groups), then the
                # harness stops the follower.
                stopped = True
                await fleet.shutdown()
                driven.compute.close()
    finally:
        if not stopped:
            await fleet.shutdown()


async def _sync_and_check(fleet, driven, weights, tiny_model_dir: Path) -> None:
    from transformers import Qwen2ForCausalLM

    from rpk.sync.verify import digest

    # Every sync is verified (`run.verify_sync`: the trainer's ranks gather to hash whole
    # tensors); here also against the weights the trainer loaded, in its float64.
    sent = {n: digest(t.to(torch.float64)) for n, t in weights.items() if n != "lm_head.weight"}
    hf = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [prompt_ids(8), prompt_ids(30)]
    want = [hf_greedy(hf, weights, p) for p in prompts]

    await asyncio.wait_for(fleet.update_weights(driven.weight_buckets(40_000), version=1), 120)
    assert fleet.versions() == {"tp1.0": 1, "tp1.1": 1, "tp2.0": None}
    lane = fleet.transport.inner._lanes["gloo_m2n"]
    for r in fleet.replicas:
        (got,) = await r.llm.collective_rpc("rpk_weight_digests")
        assert got == sent, r.name
    assert [g[:16] for g in await greedy(fleet, prompts, "m2n-1")] == want

    # A regroup: the TP-2 replica's two workers join a group of their own with both ranks.
    await fleet.regroup(2, lambda: driven.weight_buckets(40_000))
    assert fleet.transport.inner._lanes["gloo_m2n"] is not lane
    (tp2,) = fleet.replicas
    assert tp2.weight_version == 1
    for worker in await tp2.llm.collective_rpc("rpk_weight_digests"):
        assert worker == sent
    assert [g[:16] for g in await greedy(fleet, prompts, "m2n-2")] == want


@pytest.mark.slow
def test_a_two_rank_run_syncs_over_m2n_end_to_end(tmp_path: Path, rpk_cache: Path) -> None:
    code, err = finish(start(tmp_path, rpk_cache, "--dist.nproc", "2", "--rollout.weight_transfer", "m2n",
                             "--run.verify_sync", "true", "--run.steps", "2"), timeout_s=400)
    assert code == 0, err[-4000:]
    assert "trainer mesh 2 (FSDP)" in err and "weights: gloo_m2n, every trainer rank sends its own shards" in err
    recs = metrics((tmp_path / "runs" / "latest").resolve())
    assert [r["version"] for r in recs] == [1, 2]
    assert all(r["sync_bytes"] > 0 for r in recs)


def test_m2n_without_a_sharded_trainer_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything starts: in process, as `python -m rpk.run` would."""
    code = run_main([*LIFECYCLE, "--run.out_dir", str(tmp_path / "runs"), "--rollout.weight_transfer", "m2n",
                     "--run.steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "rollout.weight_transfer" in err and "sharded trainer" in err, err[-2000:]
    assert not (tmp_path / "runs").exists()
