"""Triton forward statistics for `rpk.kernels.logprob.token_logprobs_entropy`: one pass over the vocabulary computes
the logits tile by tile in on-chip memory (tl.dot, float32 accumulation) and folds them
into the online log-sum-exp statistics; no logits reach global memory.

The grid is (token blocks) x (vocabulary splits). With few tokens, token blocks alone
would leave most SMs idle, so the vocabulary is split as well; each program writes its
split's partial (max, sum of exp, sum of exp * shifted logit, target logit) and a few
[splits x N] torch ops merge them.

The backward is NOT a Triton kernel: it reuses the chunked torch recompute of
`rpk.kernels.chunked` (cuBLAS matmuls per [chunk_tokens x chunk_vocab] block), which is
why `chunk_tokens` and `chunk_vocab` still matter here. The forward's tile sizes are
fixed constants below, untuned on hardware.

Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (numpy), which is how the tests
exercise it without a GPU. The interpreter's tl.dot gets bf16 wrong (it has no numpy
bf16), so when interpreting tiles are upcast to float32 before the dot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rpk.kernels.chunked import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_VOCAB

BLOCK_N = 64
BLOCK_V = 128
BLOCK_H = 64


@triton.jit
def _partial_stats_kernel(
    h_ptr, w_ptr, t_ptr, out_ptr,
    n_tokens, vocab, hidden_size, stride_h, stride_w, inv_t, v_per_split,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < n_tokens
    tgt = tl.load(t_ptr + rn, mask=n_mask, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    a = tl.zeros([BLOCK_N], tl.float32)
    zt = tl.zeros([BLOCK_N], tl.float32)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, vocab)
    for v0 in range(v_begin, v_end, BLOCK_V):
        rv = v0 + tl.arange(0, BLOCK_V)
        v_mask = rv < v_end
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k0 in range(0, hidden_size, BLOCK_H):
            rk = k0 + tl.arange(0, BLOCK_H)
            k_mask = rk < hidden_size
            hb = tl.load(h_ptr + rn[:, None] * stride_h + rk[None, :],
                         mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            wb = tl.load(w_ptr + rv[:, None] * stride_w + rk[None, :],
                         mask=v_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            if IEEE:
                acc += tl.dot(hb, tl.trans(wb), input_precision="ieee")
            else:
                acc += tl.dot(hb, tl.trans(wb))
        z = tl.where(v_mask[None, :], acc * inv_t, float("-inf"))
        zt += tl.sum(tl.where(rv[None, :] == tgt[:, None], z, 0.0), axis=1)
        new_m = tl.maximum(m, tl.max(z, axis=1))
        # Before the first tile s == 0 and m == -inf: no shift, nothing to rescale.
        shift = tl.where(s > 0, m - new_m, 0.0)
        scale = tl.exp(shift)
        zs = z - new_m[:, None]
        e = tl.exp(zs)
        # Masked columns have e == 0 and zs == -inf; zero zs there so 0 * -inf gives no nan.
        a = scale * (a + s * shift) + tl.sum(e * tl.where(v_mask[None, :], zs, 0.0), axis=1)
        s = scale * s + tl.sum(e, axis=1)
        m = new_m
    base = out_ptr + pid_s * n_tokens + rn
    plane = n_splits * n_tokens
    tl.store(base, m, mask=n_mask)
    tl.store(base + plane, s, mask=n_mask)
    tl.store(base + 2 * plane, a, mask=n_mask)
    tl.store(base + 3 * plane, zt, mask=n_mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _vocab_splits(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, never an empty split."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    token_blocks = triton.cdiv(n_tokens, BLOCK_N)
    return max(1, min(triton.cdiv(vocab, BLOCK_V), triton.cdiv(4 * sms, token_blocks)))


def triton_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_vocab: int = DEFAULT_CHUNK_VOCAB,
    vocab_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp, entropy, target logit), float32 [N]; the chunk sizes are accepted
    for the shared StatsFn signature and unused (the tiles are BLOCK_*)."""
    if not hidden.is_cuda and not _interpreting():
        raise ValueError(f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {hidden.device}")
    n, vocab = hidden.shape[0], weight.shape[0]
    hidden = hidden.contiguous()
    weight = weight.contiguous()
    splits = vocab_splits or _vocab_splits(n, vocab, hidden.device)
    # Whole BLOCK_V tiles per split, so that only the last tile of the last split is ragged.
    v_per_split = triton.cdiv(triton.cdiv(vocab, splits), BLOCK_V) * BLOCK_V
    splits = triton.cdiv(vocab, v_per_split)
    partial = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    if n:
        _partial_stats_kernel[(triton.cdiv(n, BLOCK_N), splits)](
            hidden, weight, targets, partial,
            n, vocab, hidden.shape[1], hidden.stride(0), weight.stride(0), inv_t, v_per_split,
            BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
            UPCAST=_interpreting(), IEEE=_interpreting() or hidden.dtype == torch.float32,
        )
    m_i, s_i, a_i, zt_i = partial.unbind(0)
    m = m_i.amax(0)
    shift = m_i - m
    scale = shift.exp()
    s = (scale * s_i).sum(0)
    a = (scale * (a_i + s_i * shift)).sum(0)
    log_s = s.log()
    return m + log_s, log_s - a / s, zt_i.sum(0)
