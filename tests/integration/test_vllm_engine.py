"""The vLLM engine against a real tiny model: streaming, abort, cancel, weight sync."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

from rpk.core.records import GenDelta, GenRequest
from rpk.sync.spool import SpoolTransport
from tests.integration.engines import buckets, hf_greedy, prompt_ids, scaled_normal, tokens_of


async def load(engine: object, buckets: object, version: int) -> None:
    """Weights into one replica as a run's spool sync sends them."""
    await SpoolTransport().push(buckets, [engine], version)  # type: ignore[arg-type, list-item]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.asyncio(loop_scope="session"),
]

EOS_ID = 2  # rpk.tasks.tiny's <|im_end|>


async def stream_of(engine, request: GenRequest):
    return (await engine.start([request]))[request.request_id]


async def _collect(engine, request: GenRequest) -> list[GenDelta]:
    return [delta async for delta in await stream_of(engine, request)]


async def _greedy(engine, prompt: tuple[int, ...], request_id: str) -> list[int]:
    return tokens_of(await _collect(engine, GenRequest(request_id, prompt, 16, temperature=0.0)))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    """The reference implementation; tests load whatever weights they compare against."""
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def original_weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights named as in `Qwen2ForCausalLM.state_dict()`, which (unlike the
    checkpoint file) lists the tied `lm_head.weight` as the embedding itself."""
    from safetensors.torch import load_file

    weights = load_file(tiny_model_dir / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


async def test_concurrent_requests_finish_with_one_logprob_per_token(vllm_engine) -> None:
    budgets = (4, 8, 16, 24, 32, 48)
    requests = [
        GenRequest(f"conc-{i}", prompt_ids(20 + i), max_tokens=n, temperature=1.0, seed=i)
        for i, n in enumerate(budgets)
    ]
    streams = await asyncio.gather(*(_collect(vllm_engine, r) for r in requests))
    for request, deltas in zip(requests, streams):
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert all(d.request_id == request.request_id for d in deltas)
        tokens = tokens_of(deltas)
        logprobs = [lp for d in deltas for lp in d.logprobs]
        assert 0 < len(tokens) <= request.max_tokens
        assert len(logprobs) == len(tokens)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
        reason = deltas[-1].finish_reason
        assert reason in ("stop", "length")
        if reason == "length":
            assert len(tokens) == request.max_tokens
        else:
            assert tokens[-1] == EOS_ID  # the stop token is part of the response


async def test_logprobs_are_those_of_the_tempered_sampling_distribution(
    vllm_engine, hf_model, original_weights
) -> None:
    # The behaviour policy of the PPO ratio: log-softmax of logits / temperature, as a
    # trainer recomputes it. Scaled weights give a spread-out distribution to check.
    weights = scaled_normal(original_weights, seed=3)
    await load(vllm_engine, buckets(weights), 0)
    try:
        prompt = prompt_ids(12)
        request = GenRequest("lp", prompt, max_tokens=24, temperature=0.7, seed=5)
        deltas = await _collect(vllm_engine, request)
    finally:
        await load(vllm_engine, buckets(original_weights), 0)
    tokens = tokens_of(deltas)
    assert tokens
    engine_logprobs = torch.tensor([lp for d in deltas for lp in d.logprobs])
    hf_model.load_state_dict(weights)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tuple(tokens)])).logits[0]
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.7, dim=-1)
    reference = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(engine_logprobs, reference, atol=1e-3, rtol=1e-3)


async def _running(engine) -> None:
    """Until the engine has decoded a few steps of what it was given."""
    await asyncio.sleep(0.2)


async def test_abort_mid_stream_ends_the_stream_while_a_sibling_finishes(vllm_engine) -> None:
    # The victim ignores EOS: it would run to its budget if the abort did not stop it.
    victim = GenRequest("abort-victim", prompt_ids(30), max_tokens=400, temperature=0.0, ignore_eos=True)
    sibling = GenRequest("abort-sibling", prompt_ids(31), max_tokens=24, temperature=1.0, seed=7)
    streams = await vllm_engine.start([victim, sibling])

    async def abort_later() -> list[GenDelta]:
        await _running(vllm_engine)
        await vllm_engine.abort(victim.request_id)
        return [d async for d in streams[victim.request_id]]

    victim_deltas, sibling_deltas = await asyncio.gather(
        abort_later(), _drain(streams[sibling.request_id])
    )
    # One output per request, at its end, with every token it generated.
    assert len(victim_deltas) == 1 and victim_deltas[0].finish_reason == "abort"
    assert 0 < len(tokens_of(victim_deltas)) < victim.max_tokens
    assert len(victim_deltas[0].logprobs) == len(tokens_of(victim_deltas))
    assert len(sibling_deltas) == 1 and sibling_deltas[0].finish_reason in ("stop", "length")
    # Aborting a finished or unknown request is a no-op.
    await vllm_engine.abort(victim.request_id)
    await vllm_engine.abort("never-sent")


async def _drain(stream) -> list[GenDelta]:
    return [d async for d in stream]


async def test_a_request_that_asks_for_progress_streams_its_tokens_as_they_come(
    vllm_engine,
) -> None:
    quiet = GenRequest("progress-off", prompt_ids(40), max_tokens=32, temperature=1.0, seed=3)
    loud = GenRequest("progress-on", prompt_ids(40), max_tokens=32, temperature=1.0, seed=3,
                      progress=True)
    quiet_deltas, loud_deltas = await asyncio.gather(
        _collect(vllm_engine, quiet), _collect(vllm_engine, loud)
    )
    assert len(quiet_deltas) == 1
    assert len(loud_deltas) > 1 and [d.finished for d in loud_deltas][-1]
    assert tokens_of(loud_deltas) == tokens_of(quiet_deltas)  # same seed, same tokens


async def test_abort_before_iteration_ends_the_stream_as_aborted(vllm_engine) -> None:
    request = GenRequest("abort-early", prompt_ids(10), max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = await stream_of(vllm_engine, request)
    await vllm_engine.abort(request.request_id)
    deltas = [d async for d in stream]
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in deltas) < request.max_tokens


async def test_requests_started_together_finish_in_length_order(vllm_engine) -> None:
    """Started as one batch, greedy requests of equal prompts decode in lockstep: the
    one with the smaller budget finishes first, every time, whatever the submit order."""
    requests = [GenRequest(f"lock-{n}", prompt_ids(12), max_tokens=n, temperature=0.0)
                for n in (24, 8, 16)]
    streams = await vllm_engine.start(requests)
    order: list[str] = []

    async def consume(rid: str) -> None:
        async for delta in streams[rid]:
            if delta.finished:
                assert delta.finish_reason == "length"  # the same prompt, greedy: no EOS
                order.append(rid)

    async with asyncio.TaskGroup() as tg:
        for rid in streams:
            tg.create_task(consume(rid))
    assert order == ["lock-8", "lock-16", "lock-24"]


async def test_cancelling_the_consumer_aborts_the_request(vllm_engine) -> None:
    request = GenRequest("cancel-me", prompt_ids(40), max_tokens=400, temperature=0.0)
    stream = await stream_of(vllm_engine, request)
    task = asyncio.create_task(_drain(stream))
    await _running(vllm_engine)
    assert vllm_engine._llm.get_num_unfinished_requests() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # vLLM itself must have dropped the request, not just our stream.
    assert vllm_engine._llm.get_num_unfinished_requests() == 0
    # And the id is free again.
    again = await _collect(vllm_engine, GenRequest("cancel-me", prompt_ids(40), max_tokens=4))
    assert again[-1].finished


async def test_update_weights_changes_output_and_resets_the_prefix_cache(
    vllm_engine, hf_model, original_weights
) -> None:
    # Longer than one 128-token KV block (the CPU block size), so the prompt's first block
    # is cached and a stale one would be reused after an update without a cache reset.
    prompt = prompt_ids(160)
    original = original_weights
    spooled_before = set(Path("/dev/shm").glob("rpk-weights-*"))

    before = await _greedy(vllm_engine, prompt, "w-before")
    assert before == hf_greedy(hf_model, original, prompt)

    first = scaled_normal(original, seed=1)
    await load(vllm_engine, buckets(first), 1)
    after_first = await _greedy(vllm_engine, prompt, "w-first")
    assert after_first != before
    assert after_first == hf_greedy(hf_model, first, prompt)
    assert vllm_engine.weight_version == 1 and vllm_engine.last_sync_s > 0

    second = scaled_normal(original, seed=2)
    await load(vllm_engine, buckets(second), 2)
    after_second = await _greedy(vllm_engine, prompt, "w-second")
    assert after_second != after_first
    assert after_second == hf_greedy(hf_model, second, prompt)

    await load(vllm_engine, buckets(original), 3)
    assert await _greedy(vllm_engine, prompt, "w-restored") == before
    assert set(Path("/dev/shm").glob("rpk-weights-*")) <= spooled_before  # files deleted


async def test_update_weights_is_refused_while_a_request_runs(
    vllm_engine, original_weights
) -> None:
    request = GenRequest("busy", prompt_ids(30), max_tokens=400, temperature=0.0)
    stream = await stream_of(vllm_engine, request)
    await _running(vllm_engine)
    with pytest.raises(RuntimeError, match="running"):
        await load(vllm_engine, buckets(original_weights), 9)
    assert vllm_engine.weight_version != 9
    await vllm_engine.abort(request.request_id)
    rest = [d async for d in stream]
    assert rest[-1].finish_reason == "abort"


async def test_main_process_keeps_its_torch_threads_and_environment(vllm_engine) -> None:
    # vLLM's CPU worker turns torch.set_num_threads into a no-op where it runs; that must
    # be the engine-core process, never the trainer's.
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # vLLM's LD_PRELOAD for the engine process stays out of the environment that rpk's
    # own child processes inherit.
    assert "libgomp" not in os.environ.get("LD_PRELOAD", "")


async def test_start_fails_cleanly_on_a_bad_model_dir(tmp_path: Path) -> None:
    from rpk.engine.vllm_engine import EngineStartError, VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings

    missing = tmp_path / "missing"
    with pytest.raises(EngineStartError, match="missing"):
        await VLLMEngine.launch(VLLMSettings(model=missing))

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    with pytest.raises(EngineStartError, match="broken"):
        await VLLMEngine.launch(VLLMSettings(model=broken))


async def test_shutdown_ends_live_streams_and_is_idempotent(tiny_model_dir: Path) -> None:
    # Its own engine (the session's must outlive this test): ~10 s more.
    from rpk.engine.vllm_engine import VLLMEngine
    from rpk.engine.vllm_settings import VLLMSettings

    async with await VLLMEngine.launch(
        VLLMSettings(model=tiny_model_dir, max_num_seqs=2)
    ) as engine:
        stream = await stream_of(engine, GenRequest("live", prompt_ids(30), 400, temperature=0.0))
        await _running(engine)
        await engine.shutdown()
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort" and len(tokens_of(rest)) < 400
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.start([GenRequest("late", prompt_ids(30), 4)])
    await engine.shutdown()
