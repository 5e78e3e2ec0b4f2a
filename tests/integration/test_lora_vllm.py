"""LoRA adapters into a real CPU vLLM replica (`rpk.sync.adapter`): every sync a new
adapter version under a new name and id, the old one retired, every sync verified.
Each version serves exactly what transformers + PEFT compute with those adapter
weights, a prompt whose KV the previous version cached included (vLLM keys its prefix
cache by adapter name and path: a reused name would serve the old version's KV)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rpk.sync.backends import Backend
from tests.integration.engines import buckets, greedy, prompt_ids, scaled_normal

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

LORA_RANK = 8


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with weights clearly unlike its near-zero init (whose greedy
    output repeats one token)."""
    from transformers import Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("lora-base")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, path / f.name)
    hf = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.load_state_dict(scaled_normal(hf.state_dict(), seed=3))
    hf.save_pretrained(path)
    return path


def settings():
    from rpk.train.lora import LoraSettings

    return LoraSettings(rank=LORA_RANK, alpha=16.0)


def adapted(base_dir: Path, seed: int | None):
    """transformers + PEFT: the base with adapters of `seed`'s random weights (None:
    PEFT's own init, B zero), and those weights, PEFT-named."""
    from transformers import Qwen2ForCausalLM

    from rpk.train import lora

    model = lora.add_adapters(Qwen2ForCausalLM.from_pretrained(base_dir, dtype=torch.float32), settings()).eval()
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora.is_adapter_name(name):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model, {n: t.detach().clone() for n, t in lora.adapter_tensors(model)}


def hf_greedy(model, prompt: tuple[int, ...]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(base_dir: Path):
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.sync.adapter import max_lora_rank
    from rpk.train.lora import adapter_config

    engine = VLLMSettings(
        model=base_dir, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**20,
        max_lora_rank=max_lora_rank(LORA_RANK),
    )
    plan = fleet_plan((0,), (1,), 1, elastic=False)
    fleet = await launch_fleet(
        engine, plan, platform="cpu", backend=Backend.ADAPTER, verify=True,
        adapter=adapter_config(settings(), base_dir),
    )
    try:
        yield fleet
    finally:
        await fleet.shutdown()


async def test_each_sync_is_a_new_adapter_version_serving_its_own_weights(fleet, base_dir: Path) -> None:
    from rpk.sync.verify import VerifiedTransport

    replica = fleet.replicas[0]
    assert isinstance(fleet.transport, VerifiedTransport)
    assert replica.settings.backend is Backend.ADAPTER and replica.settings.max_lora_rank == 8
    # 2 x vLLM's CPU prefix-cache block (128 tokens): the prompt's KV is cached.
    long, short = prompt_ids(300), prompt_ids(20)

    start, _ = adapted(base_dir, None)  # B = 0: version 0 is the base, no adapter needed
    got0 = [g[:16] for g in await greedy(fleet, [long, short], "v0")]
    assert got0 == [hf_greedy(start, long), hf_greedy(start, short)]

    outputs = {}
    for version, seed in ((1, 11), (2, 12)):
        model, tensors = adapted(base_dir, seed)
        await fleet.update_weights(buckets(tensors, max_bytes=20_000), version)
        assert replica.adapter.name == f"rpk-lora-v{version}" and replica.weight_version == version
        assert set(await replica.llm.list_loras()) == {replica.adapter.lora_id}  # the old one retired
        assert sorted(p.name for p in fleet.transport.inner.dirs.root.iterdir()) == [f"v{version}"]
        want = [hf_greedy(model, long), hf_greedy(model, short)]
        # Twice: the second request of the long prompt reads this version's cached KV.
        for tag in ("a", "b"):
            got = [g[:16] for g in await greedy(fleet, [long, short], f"v{version}{tag}")]
            assert got == want, (version, tag)
        outputs[version] = want
    assert outputs[1] != outputs[2] != got0  # the adapters changed what is served


async def test_the_merged_export_serves_what_the_adapter_did(fleet, base_dir: Path, tmp_path: Path) -> None:
    """`rpk.checkpoint merge`'s model (the base with the adapter merged in), loaded by
    vLLM without LoRA, generates the LoRA replica's greedy text."""
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.train.lora import merge

    _, tensors = adapted(base_dir, 21)
    await fleet.update_weights(buckets(tensors), 10)
    prompts = [prompt_ids(20), prompt_ids(40), prompt_ids(150)]
    served = await greedy(fleet, prompts, "lora-final")

    # The replica's adapter directory is a PEFT adapter naming its base, as a checkpoint's is.
    merged = merge(Path(fleet.replicas[0].adapter.path), tmp_path / "merged")
    plain = await launch_fleet(
        VLLMSettings(model=merged, max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=8 * 2**20),
        fleet_plan((0,), (1,), 1, elastic=False), platform="cpu",
    )
    try:
        assert await greedy(plain, prompts, "merged") == served
    finally:
        await plain.shutdown()


async def test_a_verified_sync_names_the_tensor_whose_files_differ(fleet, base_dir: Path) -> None:
    from rpk.sync.verify import WeightMismatchError

    _, tensors = adapted(base_dir, 13)
    corrupt = dict(tensors)
    first = next(iter(corrupt))

    async def tampered():
        async for bucket in buckets(tensors, max_bytes=1 << 30):
            yield bucket
            corrupt[first] += 1.0  # after it was hashed, before it is written

    with pytest.raises(WeightMismatchError, match=first.replace(".", r"\.")):
        await fleet.update_weights(tampered(), 11)
