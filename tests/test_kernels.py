"""The chunked log-prob/entropy kernels against the naive full-logits reference: values
and gradients (hidden and weight, through both outputs), ragged chunking, temperature,
bf16, extreme logits, what autograd saves; the Triton forward under the interpreter in a
subprocess (TRITON_INTERPRET must be set before triton is imported, and must not leak
into other tests) and on CUDA when there is one."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rpk.kernels import reference_token_logprobs_entropy, token_logprobs_entropy

chunked_token_logprobs_entropy = functools.partial(token_logprobs_entropy, impl="torch")

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _inputs(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=gen) * scale).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, g_lp, g_ent


def _run(fn, hidden, weight, targets, g_lp, g_ent, use=("logp", "entropy"), **kw):
    """Values and the gradients of sum(g_lp * logp + g_ent * entropy)."""
    hidden.grad = weight.grad = None
    logp, entropy = fn(hidden, weight, targets, **kw)
    loss = torch.zeros((), dtype=torch.float64)
    if "logp" in use:
        loss = loss + (logp.double() * g_lp).sum()
    if "entropy" in use:
        loss = loss + (entropy.double() * g_ent).sum()
    loss.backward()
    return logp.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


def _assert_match(got, want, rtol: float, atol: float) -> None:
    for name, g, w in zip(("logp", "entropy", "d_hidden", "d_weight"), got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "n, v, h, chunk_tokens, chunk_vocab, temperature",
    [
        (37, 301, 24, 10, 64, 1.0),  # neither chunk divides
        (64, 256, 16, 32, 128, 1.0),  # both divide
        (5, 1000, 8, 3, 7, 0.7),  # many tiny vocab chunks
        (3, 17, 4, 8, 100, 1.3),  # chunks larger than the tensors
    ],
)
def test_chunked_matches_reference_float64(n, v, h, chunk_tokens, chunk_vocab, temperature) -> None:
    args = _inputs(n, v, h, torch.float64)
    want = _run(reference_token_logprobs_entropy, *args, temperature=temperature)
    got = _run(chunked_token_logprobs_entropy, *args, temperature=temperature,
               chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    _assert_match(got, want, rtol=1e-10, atol=1e-10)
    assert bool((got[0] <= 0).all()) and bool((got[1] >= 0).all())


def test_chunked_float32_and_each_output_alone() -> None:
    args = _inputs(29, 211, 32, torch.float32, seed=1)
    for use in (("logp", "entropy"), ("logp",), ("entropy",)):
        want = _run(reference_token_logprobs_entropy, *args, use=use, temperature=0.8)
        got = _run(chunked_token_logprobs_entropy, *args, use=use, temperature=0.8,
                   chunk_tokens=8, chunk_vocab=50)
        assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32
        _assert_match(got, want, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32() -> None:
    hidden, weight, targets, g_lp, g_ent = _inputs(33, 300, 64, torch.bfloat16, seed=2)
    got = _run(chunked_token_logprobs_entropy, hidden, weight, targets, g_lp, g_ent,
               temperature=0.9, chunk_tokens=16, chunk_vocab=70)
    assert got[0].dtype == torch.float32
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    # Same bf16 values, exact float32 arithmetic: only the bf16 rounding of the
    # returned gradients differs.
    exact = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    want32 = _run(reference_token_logprobs_entropy, exact[0], exact[1], targets, g_lp, g_ent,
                  temperature=0.9)
    torch.testing.assert_close(got[0], want32[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], want32[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[2].float(), want32[2], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[3].float(), want32[3], rtol=1e-2, atol=1e-2)
    # The naive bf16 reference rounds its logits to bf16: only loosely equal.
    want16 = _run(reference_token_logprobs_entropy, hidden, weight, targets, g_lp, g_ent,
                  temperature=0.9)
    _assert_match(got, want16, rtol=5e-2, atol=1e-1)


def test_extreme_logits_stay_finite() -> None:
    # Logits of several hundred: a non-online softmax over a chunk would overflow exp.
    args = _inputs(9, 500, 16, torch.float64, seed=3, scale=40.0)
    want = _run(reference_token_logprobs_entropy, *args)
    got = _run(chunked_token_logprobs_entropy, *args, chunk_tokens=4, chunk_vocab=37)
    assert all(bool(torch.isfinite(t).all()) for t in got)
    _assert_match(got, want, rtol=1e-9, atol=1e-9)


def test_backward_saves_no_logits() -> None:
    n, v, h = 40, 1000, 8
    hidden, weight, targets, _, _ = _inputs(n, v, h, torch.float32)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_token_logprobs_entropy(hidden, weight, targets, chunk_tokens=16, chunk_vocab=100)
    assert saved and max(saved) == v * h  # the weight itself, nothing of size n * v
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        reference_token_logprobs_entropy(hidden, weight, targets)
    assert max(saved) == n * v  # the hook does see logits when they are kept


def test_empty_input() -> None:
    hidden, weight, targets, _, _ = _inputs(0, 50, 8, torch.float32)
    logp, entropy = chunked_token_logprobs_entropy(hidden, weight, targets)
    assert logp.shape == entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert weight.grad is not None and not bool(weight.grad.any())


def test_invalid_inputs_name_the_values() -> None:
    hidden, weight, targets, _, _ = _inputs(4, 10, 8, torch.float32)
    with pytest.raises(ValueError, match=r"\[0, 10\), got .*\.\.10"):
        chunked_token_logprobs_entropy(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match=r"\(4, 8\) vs weight \(10, 7\)"):
        chunked_token_logprobs_entropy(hidden, weight[:, :7], targets)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0.0"):
        chunked_token_logprobs_entropy(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_vocab=0"):
        chunked_token_logprobs_entropy(hidden, weight, targets, chunk_vocab=0)
    with pytest.raises(ValueError, match="int64"):
        chunked_token_logprobs_entropy(hidden, weight, targets.int())


def test_dispatcher_on_cpu_is_the_chunked_path() -> None:
    args = _inputs(11, 90, 8, torch.float64, seed=4)
    got = _run(token_logprobs_entropy, *args, temperature=1.1, chunk_tokens=4, chunk_vocab=16)
    want = _run(reference_token_logprobs_entropy, *args, temperature=1.1)
    _assert_match(got, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 24),
    v=st.integers(2, 120),
    h=st.integers(1, 12),
    chunk_tokens=st.integers(1, 30),
    chunk_vocab=st.integers(1, 130),
    temperature=st.floats(0.25, 2.0),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_reference_property(n, v, h, chunk_tokens, chunk_vocab, temperature, seed) -> None:
    args = _inputs(n, v, h, torch.float64, seed=seed, scale=2.0)
    want = _run(reference_token_logprobs_entropy, *args, temperature=temperature)
    got = _run(chunked_token_logprobs_entropy, *args, temperature=temperature,
               chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    _assert_match(got, want, rtol=1e-9, atol=1e-9)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from rpk.kernels.logprob import token_logprobs_entropy
    from rpk.kernels.triton_stats import triton_stats
    from rpk.kernels.chunked import reference_token_logprobs_entropy as ref

    torch.manual_seed(0)
    # 70 tokens: two token blocks, the second ragged; 301 vocab: a ragged last tile;
    # 40 hidden: a ragged k tile.
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(70, 40).to(dtype)
        weight = torch.randn(301, 40).to(dtype)
        targets = torch.randint(0, 301, (70,))
        want_lp, want_ent = ref(hidden.float(), weight.float(), targets, 0.7)
        for splits in (1, 3, None):
            lse, ent, zt = triton_stats(hidden, weight, targets, 1 / 0.7, vocab_splits=splits)
            torch.testing.assert_close(zt - lse, want_lp, rtol=1e-5, atol=2e-5)
            torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=2e-5)
    hidden = torch.randn(20, 16, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(130, 16).requires_grad_()
    targets = torch.randint(0, 130, (20,))
    grads = []
    for fn in (lambda *a: token_logprobs_entropy(*a, impl="triton"), ref):
        hidden.grad = weight.grad = None
        lp, ent = fn(hidden, weight, targets, 1.2)
        (lp.sum() - 0.3 * ent.sum()).backward()
        grads.append((lp.detach(), hidden.grad, weight.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    print("interpreter ok")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_forward_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "interpreter ok" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype, grad_tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_triton_on_cuda_matches_reference(dtype, grad_tol) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, v, h = 777, 32_003, 896
    hidden = (torch.randn(n, h, device="cuda", generator=gen) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    results = []
    for fn, h_in, w_in in (
        (token_logprobs_entropy, hidden, weight),
        # the same bf16 values in exact float32: the kernel accumulates in float32 too
        (reference_token_logprobs_entropy, hidden.detach().float().requires_grad_(),
         weight.detach().float().requires_grad_()),
    ):
        lp, ent = fn(h_in, w_in, targets, 0.8)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), h_in.grad.float(), w_in.grad.float()))
    # Values are float32 either way; gradients come back in the input dtype, so bf16
    # rounding (2^-9 relative) bounds how close they can be.
    for name, got, want, tol in zip(("logp", "entropy", "d_hidden", "d_weight"), *results,
                                    (1e-5, 1e-5, grad_tol, grad_tol)):
        rel = float((got - want).norm() / want.norm())
        assert rel < tol, f"{name}: relative error {rel:.2e} >= {tol}"
