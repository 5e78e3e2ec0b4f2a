"""Speculative decoding on the real CPU engine with rpk's proposer (`custom_class`): draft
texts in through `collective_rpc`, drafts verified and counted, the schedule re-planned
per round without a restart, greedy output unchanged by drafts, and each request's
accepted drafts reported on its last delta."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from rpk.core.drafts import Draft, DraftSource, PromptDrafts, SpecMethod
from rpk.core.records import GenDelta, GenRequest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

ALL = list(DraftSource)


def _prompt(seed: int, length: int = 12, vocab_size: int = 259) -> tuple[int, ...]:
    return tuple(3 + (37 * i + 11 * seed) % (vocab_size - 3) for i in range(length))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def spec_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import SpecSettings, VLLMSettings

    settings = VLLMSettings(model=tiny_model_dir, max_num_seqs=16,
                            speculative=SpecSettings(SpecMethod.RPK, max_k=4))
    engine = await VLLMEngine.launch(settings)
    try:
        yield engine
    finally:
        await engine.shutdown()


async def _run(engine, requests: list[GenRequest]) -> dict[str, list[GenDelta]]:
    streams = await engine.start(requests)

    async def one(stream) -> list[GenDelta]:
        return [d async for d in stream]

    got = await asyncio.gather(*(one(s) for s in streams.values()))
    return dict(zip(streams, got))


def _tokens(deltas: list[GenDelta]) -> tuple[int, ...]:
    return tuple(t for d in deltas for t in d.token_ids)


async def test_sibling_drafts_are_accepted_counted_and_reported_per_request(spec_engine) -> None:
    # Greedy: every response of the prompt is the same, so a finished one drafts the
    # others exactly (a random-init model samples near-uniformly at temperature 1).
    prompt = _prompt(1)
    first = await _run(spec_engine, [GenRequest("a0", prompt, 24, temperature=0.0)])
    await spec_engine.take_spec_stats()
    drafts = PromptDrafts(prompt, (Draft(DraftSource.SIBLING, _tokens(first["a0"])),))
    await spec_engine.set_drafts([(1, 16, 4)], ALL, [drafts])
    second = await _run(spec_engine, [GenRequest(f"b{j}", prompt, 24, temperature=0.0) for j in range(4)])
    stats = await spec_engine.take_spec_stats()
    assert stats.drafts > 0 and stats.accepted > 0, stats
    assert stats.spec_steps > 0 and stats.tokens_per_verify > 2.0
    assert sum(stats.accepted_by_pos) == stats.accepted
    sibling = stats.by_source[DraftSource.SIBLING]
    assert sibling.drafts > 0 and 0 < sibling.accepted <= sibling.tokens
    # Each request's last delta carries its accepted drafts; together, vLLM's count.
    assert sum(d[-1].accepted for d in second.values()) == stats.accepted
    for deltas in second.values():
        assert _tokens(deltas) == _tokens(first["a0"])
        assert len(_tokens(deltas)) == sum(len(d.logprobs) for d in deltas)


async def test_sampled_log_probs_under_verification_are_the_tempered_policys(spec_engine, tiny_model_dir) -> None:
    """Requests that draft are sampled by the rejection sampler at temperature 0.7: its
    tokens' log-probs are log-softmax(logits / 0.7), as the trainer recomputes them.
    vLLM 0.32's CPU fallback left those temperatures uninitialised (`rpk.sync.worker.spec`).
    The drafts: the same requests' responses of a first pass that drafted nothing (a row
    drafts once its first sampled token is in some text, which a random model's is rarely
    otherwise)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = _prompt(5)
    requests = [GenRequest(f"t{j}", prompt, 16, temperature=0.7, seed=j) for j in range(6)]
    await spec_engine.set_drafts([(1, 16, 0)], ALL, [])
    first = await _run(spec_engine, requests)
    texts = tuple(Draft(DraftSource.PARTIAL, _tokens(d)) for d in first.values())
    await spec_engine.set_drafts([(1, 16, 4)], ALL, [PromptDrafts(prompt, texts)])
    await spec_engine.take_spec_stats()
    got = await _run(spec_engine, [dataclasses.replace(r, request_id=f"u{j}") for j, r in enumerate(requests)])
    stats = await spec_engine.take_spec_stats()
    assert stats.drafts > 0 and stats.spec_steps > 0, stats
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for deltas in got.values():
        tokens = _tokens(deltas)
        engine = torch.tensor([lp for d in deltas for lp in d.logprobs])
        assert torch.isfinite(engine).all()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
        want = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(engine, want, atol=1e-3, rtol=1e-3)


async def test_a_round_planned_at_k_0_drafts_nothing(spec_engine) -> None:
    prompt = _prompt(2)
    first = await _run(spec_engine, [GenRequest("c0", prompt, 24, seed=1)])
    drafts = PromptDrafts(prompt, (Draft(DraftSource.SIBLING, _tokens(first["c0"])),))
    await spec_engine.set_drafts([(1, 16, 0)], ALL, [drafts])
    await spec_engine.take_spec_stats()
    await _run(spec_engine, [GenRequest(f"d{j}", prompt, 24, seed=j) for j in range(2)])
    stats = await spec_engine.take_spec_stats()
    assert stats.drafts == 0 and stats.steps > 0


async def test_drafts_never_change_greedy_output(spec_engine) -> None:
    prompt = _prompt(3)
    await spec_engine.set_drafts([(1, 16, 0)], ALL, [])
    plain = _tokens((await _run(spec_engine, [GenRequest("g0", prompt, 32, temperature=0.0)]))["g0"])
    # Drafts that agree with it for a while, then go astray.
    wrong = plain[:10] + tuple((t + 1) % 250 + 3 for t in plain[10:])
    await spec_engine.set_drafts([(1, 16, 4)], ALL, [PromptDrafts(prompt, (Draft(DraftSource.PARTIAL, wrong),))])
    await spec_engine.take_spec_stats()
    drafted = _tokens((await _run(spec_engine, [GenRequest("g1", prompt, 32, temperature=0.0)]))["g1"])
    assert drafted == plain
    assert (await spec_engine.take_spec_stats()).drafts > 0


async def test_unknown_prompts_draft_nothing(spec_engine) -> None:
    await spec_engine.set_drafts([(1, 16, 4)], [DraftSource.SIBLING], [])
    await spec_engine.take_spec_stats()
    await _run(spec_engine, [GenRequest("u0", _prompt(4), 16, seed=3)])
    assert (await spec_engine.take_spec_stats()).drafts == 0


async def test_the_engine_says_how_its_cpu_expand_kernel_was_corrected(spec_engine) -> None:
    """On vLLM's CPU platform (no Triton) a speculating engine's workers correct the
    expand kernel before the first request: through vLLM's registry, or rebound by rpk
    where the registry's module scan raises (docs/speculative.md says which is seen)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        assert spec_engine.cpu_kernel_fix == ""
    else:
        print(f"cpu_kernel_fix={spec_engine.cpu_kernel_fix}")
        assert spec_engine.cpu_kernel_fix in ("registry", "rebound")
