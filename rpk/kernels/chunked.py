"""The plain-torch implementation of the fused log-prob head and its naive reference.

Per-token log-prob and entropy straight from hidden states and the LM head weight,
without ever holding the [tokens x vocab] logits.

Why chunk: with Qwen2.5's 152,064-token vocabulary the logits of 4,096 response tokens
are 2.5 GB in float32, and the naive log_softmax -> gather -> entropy chain keeps several
such tensors alive for backward. Here the tokens are cut into chunks of `chunk_tokens`
and the vocabulary into chunks of `chunk_vocab`; one [chunk_tokens x chunk_vocab] block of
logits exists at a time. An online log-sum-exp walks the vocabulary chunks keeping, per
token, the running max m, the sum s = sum exp(z - m) and a = sum exp(z - m) * (z - m)
(kept relative to m, so the entropy log(s) - a / s does not come from subtracting two
large numbers), plus the target's logit.

What is saved and what is recomputed: forward saves only hidden, weight, targets and two
float32 numbers per token (log-sum-exp and entropy). Backward recomputes each block of
logits from hidden and weight (one extra matmul over the vocabulary) and turns it into
the gradient of the logits at once:

    d logp_t / dz_v = [v == t] - p_v
    d H / dz_v      = p_v * (E_p[z] - z_v),   E_p[z] = lse - H

then folds that block into d hidden and d weight, vocabulary chunk by vocabulary chunk,
so that d weight is accumulated in float32 one chunk at a time.

bf16 inputs are upcast chunk by chunk: every matmul, exp and sum is float32, and the
outputs are float32 for any of bf16, fp16 and fp32 inputs (float64 stays float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_CHUNK_VOCAB = 4096

# (hidden, weight, targets, 1 / temperature, chunk_tokens, chunk_vocab)
#   -> (log-sum-exp, entropy, target logit), each float32 [N]
StatsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, int, int],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]


def validate_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    chunk_tokens: int, chunk_vocab: int) -> None:
    """Shape, dtype and range checks shared by every implementation, none of which waits
    for the device: an out-of-range target id would give a silently wrong log-prob, so
    on CUDA its check is queued as a device-side assertion (it fails the next sync)
    instead of reading the ids back, which would stall the trainer's stream per call."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}"
        )
    if targets.shape != (hidden.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 [{hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}"
        )
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"devices differ: hidden {hidden.device}, weight {weight.device}, "
            f"targets {targets.device}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(
            f"chunk sizes must be >= 1, got chunk_tokens={chunk_tokens}, chunk_vocab={chunk_vocab}"
        )
    if not targets.numel():
        return
    vocab = weight.shape[0]
    if targets.is_cuda:
        torch._assert_async(((targets >= 0) & (targets < vocab)).all())
        return
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"target ids must lie in [0, {vocab}), got {lo}..{hi}")


def _acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs; float64 stays float64 (exactness tests)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def chunked_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    chunk_tokens: int,
    chunk_vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward statistics in plain torch: (log-sum-exp, entropy, target logit), float32."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden)
    # Scaling the [N, H] hidden states instead of every block of logits saves a pass.
    scaled = hidden.to(acc) * inv_t
    out = torch.empty(3, n, dtype=acc, device=hidden.device)
    for t0 in range(0, n, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n)
        h = scaled[t0:t1]
        tgt = targets[t0:t1]
        m = torch.full((t1 - t0,), float("-inf"), dtype=acc, device=h.device)
        s = torch.zeros_like(m)
        a = torch.zeros_like(m)
        zt = torch.zeros_like(m)
        for v0 in range(0, vocab, chunk_vocab):
            v1 = min(v0 + chunk_vocab, vocab)
            z = h @ weight[v0:v1].to(acc).T
            local = tgt - v0
            inside = (local >= 0) & (local < v1 - v0)
            picked = z.gather(1, local.clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            zt += torch.where(inside, picked, 0.0)
            new_m = torch.maximum(m, z.amax(1))
            # Before the first chunk s == 0 and m == -inf: no shift, nothing to rescale.
            shift = torch.where(s > 0, m - new_m, 0.0)
            scale = shift.exp()
            z.sub_(new_m.unsqueeze(1))
            e = z.exp()
            a = scale * (a + s * shift) + (e * z).sum(1)
            s = scale * s + e.sum(1)
            m = new_m
        log_s = s.log()
        out[0, t0:t1] = m + log_s
        out[1, t0:t1] = log_s - a / s
        out[2, t0:t1] = zt
    return out[0], out[1], out[2]


def chunked_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_t: float,
    chunk_tokens: int,
    chunk_vocab: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients w.r.t. hidden and weight, recomputing each block of logits."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden)
    # z = (hidden * inv_t) @ weight.T, so d weight = dz.T @ scaled and
    # d hidden = (dz @ weight) * inv_t: one multiply by inv_t on [N, H], none per block.
    scaled = hidden.to(acc) * inv_t
    d_hidden = torch.zeros(n, hidden.shape[1], dtype=acc, device=hidden.device)
    d_weight = torch.empty_like(weight) if need_weight else None
    g_lp = grad_logp.to(acc).unsqueeze(1) if grad_logp is not None else None
    g_ent = grad_entropy.to(acc).unsqueeze(1) if grad_entropy is not None else None
    if g_ent is not None:
        # dz = p * (g_ent * (E[z] - z) - g_lp) = p * (offset - g_ent * z)
        offset = g_ent * (lse - entropy).unsqueeze(1)
        if g_lp is not None:
            offset = offset - g_lp
        neg_g_ent = -g_ent
    for v0 in range(0, vocab, chunk_vocab):
        v1 = min(v0 + chunk_vocab, vocab)
        w = weight[v0:v1].to(acc)
        dw = torch.zeros_like(w) if need_weight else None
        for t0 in range(0, n, chunk_tokens):
            t1 = min(t0 + chunk_tokens, n)
            h = scaled[t0:t1]
            z = h @ w.T
            dz = torch.sub(z, lse[t0:t1].unsqueeze(1)).exp_()
            if g_ent is not None:
                dz.mul_(z.mul_(neg_g_ent[t0:t1]).add_(offset[t0:t1]))
            else:
                dz.mul_(-g_lp[t0:t1])
            if g_lp is not None:
                # scatter_add, not boolean indexing: no host sync on CUDA
                local = targets[t0:t1] - v0
                inside = ((local >= 0) & (local < v1 - v0)).unsqueeze(1)
                index = local.clamp(0, v1 - v0 - 1).unsqueeze(1)
                dz.scatter_add_(1, index, torch.where(inside, g_lp[t0:t1], 0.0))
            if need_hidden:
                d_hidden[t0:t1].addmm_(dz, w)
            if dw is not None:
                dw.addmm_(dz.T, h)
        if d_weight is not None:
            d_weight[v0:v1] = dw
    return (d_hidden.mul_(inv_t).to(hidden.dtype) if need_hidden else None), d_weight


class LogprobEntropyFunction(torch.autograd.Function):
    """autograd glue: forward statistics from `stats_fn` (torch or Triton), backward
    always by the chunked torch recompute."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_tokens: int,
        chunk_vocab: int,
        stats_fn: StatsFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t = 1.0 / temperature
        lse, entropy, target_logit = stats_fn(hidden, weight, targets, inv_t, chunk_tokens, chunk_vocab)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_t = inv_t
        ctx.chunks = (chunk_tokens, chunk_vocab)
        return target_logit - lse, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        d_hidden, d_weight = chunked_backward(
            hidden, weight, targets, lse, entropy, grad_logp, grad_entropy,
            ctx.inv_t, *ctx.chunks, need_hidden, need_weight,
        )
        return d_hidden, d_weight, None, None, None, None, None


def reference_token_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive version the chunked ones are tested and benchmarked against: full
    logits in the input dtype (as an lm_head would produce them), log_softmax in at least
    float32, gather, entropy = -(p * logp).sum."""
    validate_inputs(hidden, weight, targets, temperature, 1, 1)
    logits = hidden @ weight.T
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(wide, dim=-1)
    logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
