"""MRTPO token-advantage reallocation over packed responses (METHOD.md sections 4-5).

Math, for response i (tokens t in [cu[i], cu[i+1]), T_i of them) and reward k:
    g_k[t]    = max(d_k[t], 0)^gamma
    mean_k    = sum_t g_k[t] / T_i
    use_k     = has_info[i, k] and mean_k >= delta and mean_k > 0   (else w_k = 1: GDPO)
    w_hat_k   = g_k / max(mean_k, delta)                   (mean 1 over the response)
      with a clip: w_hat_k = c / max(mean_t c, 1e-30),  c = clamp(w_hat_k, w_min, w_max)
    w_k[t]    = (1 - alpha) + alpha w_hat_k[t]  where use_k, else 1
    token[t]  = seq[i] + sum_{k: c_k != 0} c_k (w_k[t] - 1) / D,   c_k = lam_k A_k[i]
(seq[i] itself where D is not > 0), seq GDPO's sequence advantage and D the redistribution's
divisor (METHOD.md section 5), so sum_t token[t] = T_i x seq[i] (the mass invariant); a
weight of exactly 1 or c_k = 0 adds exactly 0 (alpha = 0 is GDPO bit for bit). The output
is final: nothing is patched after the kernel.

One program per response (a segmented kernel over cu_seqlens): pass 1 sums g over the
response's tokens for all K rewards at once ([BLOCK_K, BLOCK_T] tiles), pass 2 (only with a
clip) sums the clipped weights, pass 3 writes the allocation and the token advantages.
Memory-bound (costs: docs/kernels.md). No host synchronization: seq and D are read from device
tensors, the scalars travel in a small device tensor of the accumulation dtype (so float64
inputs keep float64 scalars; Triton scalar arguments would be fp32).

Shapes, dtypes (all contiguous; acc = float32 or float64, the same for every float input):
    per_reward (n, K) acc, lam (K,) acc, has_info (n, K) bool, relevance (K, N) acc,
    cu_seqlens (n + 1,) int64, sequence (n,) acc, divisor () acc
    -> token (N,) acc, allocation (K, N) acc.
n, N and K are run-time values; BLOCK_K = next power of two of K and BLOCK_T are tile sizes;
GAMMA_ONE and HAS_CLIP are feature flags. Offsets are int64.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting


@triton.jit
def _reallocate_kernel(
    per_reward_ptr,  # (n, K)
    lam_ptr,  # (K,)
    has_info_ptr,  # (n, K) uint8
    rel_ptr,  # (K, N)
    cu_ptr,  # (n + 1,) int64
    seq_ptr,  # (n,) GDPO sequence advantages
    div_ptr,  # () the redistribution's divisor D
    params_ptr,  # (5,) alpha, gamma, delta, clip_min, clip_max
    token_ptr,  # (N,)
    alloc_ptr,  # (K, N)
    K,
    N,
    GAMMA_ONE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    alpha = tl.load(params_ptr + 0)
    gamma = tl.load(params_ptr + 1)
    delta = tl.load(params_ptr + 2)
    clip_min = tl.load(params_ptr + 3)
    clip_max = tl.load(params_ptr + 4)
    seq = tl.load(seq_ptr + i)
    div = tl.load(div_ptr)
    moves = div > 0.0
    div = tl.where(moves, div, 1.0)

    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    info = tl.load(has_info_ptr + i * K + kk, mask=k_mask, other=0) != 0
    coef = tl.load(per_reward_ptr + i * K + kk, mask=k_mask, other=0.0)
    coef = coef * tl.load(lam_ptr + kk, mask=k_mask, other=0.0)
    rows = rel_ptr + kk.to(tl.int64)[:, None] * N
    alloc_rows = alloc_ptr + kk.to(tl.int64)[:, None] * N
    length = (end - start).to(coef.dtype)
    length = tl.maximum(length, 1.0)
    offs = tl.arange(0, BLOCK_T)

    # Pass 1: mean of g = max(d, 0)^gamma over the response, per reward.
    acc = tl.zeros((BLOCK_K, BLOCK_T), dtype=coef.dtype)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + offs
        mask = k_mask[:, None] & (t < end)[None, :]
        g = tl.maximum(tl.load(rows + t[None, :], mask=mask, other=0.0), 0.0)
        if not GAMMA_ONE:
            g = tl.exp(gamma * tl.log(g))  # g = 0 -> exp(-inf) = 0 (gamma > 0)
        acc += tl.where(mask, g, 0.0)
    mean = tl.sum(acc, axis=1) / length
    use = info & (mean >= delta) & (mean > 0.0)  # all-zero d: uniform, even at delta = 0
    mean_c = tl.maximum(mean, delta)

    # Pass 2 (clip only): the clipped weights' mean, to renormalize them to mean 1.
    renorm = tl.full((BLOCK_K,), 1.0, dtype=coef.dtype)
    if HAS_CLIP:
        acc = tl.zeros((BLOCK_K, BLOCK_T), dtype=coef.dtype)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + offs
            mask = k_mask[:, None] & (t < end)[None, :]
            g = tl.maximum(tl.load(rows + t[None, :], mask=mask, other=0.0), 0.0)
            if not GAMMA_ONE:
                g = tl.exp(gamma * tl.log(g))
            w = tl.minimum(tl.maximum(g / mean_c[:, None], clip_min), clip_max)
            acc += tl.where(mask, w, 0.0)
        renorm = tl.maximum(tl.sum(acc, axis=1) / length, 1e-30)

    # Pass 3: allocation weights and token advantages.
    for t0 in range(start, end, BLOCK_T):
        t = t0 + offs
        t_mask = t < end
        mask = k_mask[:, None] & t_mask[None, :]
        g = tl.maximum(tl.load(rows + t[None, :], mask=mask, other=0.0), 0.0)
        if not GAMMA_ONE:
            g = tl.exp(gamma * tl.log(g))
        w_hat = g / mean_c[:, None]
        if HAS_CLIP:
            w_hat = tl.minimum(tl.maximum(w_hat, clip_min), clip_max) / renorm[:, None]
        alloc = tl.where(use[:, None], (1.0 - alpha) + alpha * w_hat, 1.0)
        tl.store(alloc_rows + t[None, :], alloc, mask=mask)
        part = tl.where(coef[:, None] != 0.0, coef[:, None] * (alloc - 1.0), 0.0)
        moved = tl.sum(part, axis=0)
        tl.store(token_ptr + t, tl.where(moves, seq + moved / div, seq), mask=t_mask)


def mrtpo_token_advantages(
    per_reward,
    lam,
    has_info,
    relevance,
    cu_seqlens,
    sequence,
    divisor,
    alpha,
    gamma,
    delta,
    clip_min,
    clip_max,
):
    """METHOD.md sections 4-5 on packed tokens: returns (token (N,), allocation (K, N)) in
    relevance's dtype. Inputs validated by mrtpo_token_advantages; see the module header."""
    check_device("relevance", relevance)
    k, n_tok = relevance.shape
    n = per_reward.shape[0]
    acc = relevance.dtype
    dev = relevance.device
    token = torch.empty(n_tok, dtype=acc, device=dev)
    alloc = torch.empty((k, n_tok), dtype=acc, device=dev)
    if n == 0 or n_tok == 0:
        return token, alloc
    params = torch.tensor([alpha, gamma, delta, clip_min, clip_max], dtype=acc, device=dev)
    block_k = triton.next_power_of_2(k)
    block_t = max(16, (4096 if interpreting() else 1024) // block_k)
    _reallocate_kernel[(n,)](
        per_reward_ptr=per_reward.to(acc).contiguous(),
        lam_ptr=lam.to(acc).contiguous(),
        has_info_ptr=has_info.contiguous().view(torch.uint8),
        rel_ptr=relevance.contiguous(),
        cu_ptr=cu_seqlens.to(torch.int64).contiguous(),
        seq_ptr=sequence.to(acc).contiguous(),
        div_ptr=divisor.to(acc).reshape(()),
        params_ptr=params,
        token_ptr=token,
        alloc_ptr=alloc,
        K=k,
        N=n_tok,
        GAMMA_ONE=gamma == 1.0,
        HAS_CLIP=clip_min > 0.0 or math.isfinite(clip_max),
        BLOCK_K=block_k,
        BLOCK_T=block_t,
        num_warps=4,
    )
    return token, alloc
