"""Triton kernels: per-token log-probs and entropy, fused with the LM head or from logits.

Math (per token n, z = (h_n W^T + b) / tau, or z = logits_n / tau; all in fp32):
    lse_n = log sum_v exp(z_v)          logp_n = z_y - lse_n        (0 where y = ignore)
    H_n   = lse_n - sum_v p_v z_v       p_v = exp(z_v - lse_n)      (0 where y = ignore)
Backward, upstream gradients g (of logp) and e (of H), both 0 on ignored tokens:
    dz_v      = g ([v == y] - p_v) - e p_v (log p_v + H)           (and dlogits = dz / tau)
    dh_n      = sum_v dlogits_nv W_v     dW_v = sum_n dlogits_nv h_n     db_v = sum_n dlogits_nv

Shapes and dtypes: hidden (N, d) and weight (V, d) fp32/bf16/fp16, same dtype, contiguous
rows (the row stride is passed, the last stride must be 1); bias (V,); labels (N,) int64;
logits (N, V) any float dtype. N, V and d are run-time arguments (RL batches vary); only
tile sizes and feature flags are constexpr. Offsets are int64. Outputs logp, entropy, lse
are fp32 (N,); lse (of z, i.e. after the temperature) is what the backward needs, together
with the entropy when there is an entropy gradient. grad_hidden in hidden's dtype,
grad_weight and grad_bias fp32, grad_logits in logits' dtype. float64 inputs never
reach these kernels (Triton dots have no fp64 path): the dispatcher sends them to the
"torch" backend, which computes in float64.

Forward (``_stats_partial_kernel`` + ``_stats_combine_kernel``): a program owns BLOCK_N
tokens and one contiguous range ("split") of the vocabulary; for each BLOCK_V block it
accumulates the raw logits h W^T with tl.dot over BLOCK_D slices of d in fp32 registers,
then folds the block into an online log-sum-exp shifted by the raw running max m before the
temperature (README "Numerics"): x = (z/2 - m/2)(2/tau), s = sum exp(x) and, for the
entropy, t = sum exp(x) x (kept relative to m, so H = log s - t / s has no cancellation when
|z| is large, and no finite logit overflows through z / tau); when m grows, s and t are
rescaled by exp of the shift and t shifted by s times it. The raw target logit is picked
when y falls in the block; logp = (z_y/2 - M/2)(2/tau) - log s, never z_y / tau - lse.
Logits never reach global memory. Splits (several per token tile, launched in grouped
order) fill the GPU when N is small and keep the tiles that run together in L2; the combine
kernel merges the (m, s, t, z_y) partials of the S splits the same way and writes lse
(= M / tau + log s, one fma) and the norm (M, log s) the backward uses. Max identity is
-inf; exp(-inf - -inf) is avoided by exponentiating against 0 while the max is still -inf.

Backward decomposition, chosen by counting. One fused kernel cannot produce dh and dW: for
d = 4096 the dh accumulator of one token tile is BLOCK_N x d fp32 (2 MiB at BLOCK_N = 128),
far beyond registers and shared memory, so "loop over V and accumulate dh online" would
recompute the logits d / BLOCK_D times; fp32 atomics for both dh and dW would issue
N d V / BLOCK_V + V d N / BLOCK_N ~ 1.6e11 atomics at the target shape, several times the
GEMM time. So the vocabulary is walked in chunks of C columns (C from MRTPO_CHUNK_BYTES,
default 256 MiB of gradient-of-logits; C = 8192 at N = 16384 in bf16):
    1. ``_dlogits_kernel``: recompute the (N, C) logits tile by tile (GEMM 1), turn them
       into dlogits in registers with log p = (z/2 - M/2)(2/tau) - log s from the forward's
       norm (and the entropy) and store them in hidden's dtype into the chunk buffer G
       (N, C); db by fp32 atomics of column sums. Not z / tau - lse: the fp32 lse is
       ulp(lse) / 2 off (5e-4 at |z / tau| ~ 1e4, where the row's p then sum to 1 +- 5e-4
       and dh = G W loses everything to cancellation) and overflows past float max. The
       norm reaches the backward as the forward's ``saved`` output (see "saved norms");
       without it (an lse from elsewhere) the lse alone is used.
    2. dW[chunk] = G^T hidden  (GEMM 2, ``_matmul_kernel``): each row of dW is finished in
       one chunk, accumulated in fp32 over all N in registers, written once (no
       read-modify-write, no bf16 accumulation across chunks).
    3. dh32 += G W[chunk]      (GEMM 3): an fp32 (N, d) accumulator, read and written once
       per chunk (2 N d 4 bytes x V / C: 10 GB at the target shape, ~2 ms).
Chunking the vocabulary rather than the tokens is what makes dW single-pass: the saved norm
is known before the backward starts, so any vocabulary chunk can be finished on its own.

Extra device memory: G (<= MRTPO_CHUNK_BYTES), dh32 (4 N d bytes, none for fp32 hidden),
the (4, S, N) fp32 partials. Costs at the target shape: docs/kernels.md.

Tiles (fixed, not autotuned; see docs/kernels.md): bf16/fp16 dots
BLOCK_N = BLOCK_V = 128, BLOCK_D = 64, 8 warps, 3 stages; fp32 dots 64/64/32, 4 warps,
2 stages; the GEMMs 128 x 128 x 64 (fp32: 64 x 64 x 32), GROUP_M = 8. Under the
interpreter the tiles are chosen for few program launches. fp32 dots use IEEE fp32 unless
torch's float32 matmul precision allows TF32 (then TF32, as torch would). G is stored in
hidden's dtype: in fp16 entries below ~6e-8 flush to zero (bf16 keeps fp32's range).
UPCAST_DOT is an interpreter-only workaround (its bf16 tl.dot is wrong; see _common).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    cdiv,
    check_device,
    chunk_bytes,
    dot_precision,
    grouped_pid,
    interpreter_upcast,
    interpreting,
)
from ._common import num_sms as _num_sms

__all__ = [
    "linear_logprobs_fwd",
    "linear_logprobs_bwd",
    "logprobs_from_logits_fwd",
    "logprobs_from_logits_bwd",
]

# --------------------------------------------------------------------------- device code


@triton.jit
def _logits_tile(
    src_ptr,
    w_ptr,
    b_ptr,
    rows64,
    row_mask,
    cols,
    col_mask,
    D,
    stride_src,
    stride_w,
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Raw logits h W^T + b of a (BLOCK_N, BLOCK_V) tile in fp32 (fp32 accumulator of the
    dot), or the tile of the (N, V) logits src upcast to fp32 with FROM_LOGITS."""
    cols64 = cols.to(tl.int64)
    if FROM_LOGITS:
        ptrs = src_ptr + rows64[:, None] * stride_src + cols64[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        z = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            k_mask = ks < D
            h = tl.load(
                src_ptr + rows64[:, None] * stride_src + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols64[None, :] * stride_w + ks[:, None],
                mask=col_mask[None, :] & k_mask[:, None],
                other=0.0,
            )
            if UPCAST_DOT:  # interpreter only, see _common.interpreter_upcast
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            z = tl.dot(h, w, z, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols64, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _lse(m, log_s, inv_t):
    """The saved lse = M / tau + log s, one rounding (fma): the backward recomputes it from
    the filed (M, log s) bit for bit to tell that they belong to the lse it was given."""
    return tl.fma(m, inv_t, log_s)


@triton.jit(do_not_specialize=["N"])
def _stats_partial_kernel(
    src_ptr,
    w_ptr,
    b_ptr,
    labels_ptr,
    part_ptr,  # (4, S, N) fp32: raw running max m, s, t, raw target logit
    store_ptr,  # (N, V) fp32 raw logits, written with STORE_LOGITS
    N,
    V,
    D,
    stride_src,
    stride_w,
    stride_store,
    inv_t,
    num_splits,
    blocks_per_split,
    STORE_LOGITS: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WITH_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    num_tiles = tl.cdiv(N, BLOCK_N)
    pid_n, split = grouped_pid(tl.program_id(0), num_tiles, num_splits, GROUP)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    y = tl.load(labels_ptr + rows64, mask=row_mask, other=-1)

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    tgt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    two_inv_t = 2.0 * inv_t
    v_begin = split * blocks_per_split * BLOCK_V
    v_end = tl.minimum(V, v_begin + blocks_per_split * BLOCK_V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        raw = _logits_tile(
            src_ptr, w_ptr, b_ptr, rows64, row_mask, cols, col_mask, D, stride_src,
            stride_w, FROM_LOGITS, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION,
            UPCAST_DOT,
        )  # fmt: skip
        if STORE_LOGITS:  # keep the raw fp32 logits for a second use (policy loss, (a))
            keep = store_ptr + rows64[:, None] * stride_store + cols.to(tl.int64)[None, :]
            tl.store(keep, raw, mask=row_mask[:, None] & col_mask[None, :])
        z = tl.where(col_mask[None, :], raw, float("-inf"))  # raw: shifted before 1/tau
        m_new = tl.maximum(m, tl.max(z, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp against 0 while all -inf
        shift = (m * 0.5 - base * 0.5) * two_inv_t  # -inf while m is -inf
        alpha = tl.exp(shift)
        x = (z * 0.5 - base[:, None] * 0.5) * two_inv_t
        e = tl.exp(x)
        if WITH_ENT:
            shift0 = tl.where(m == float("-inf"), 0.0, shift)
            ez = tl.where(e > 0.0, e * x, 0.0)
            # alpha = 0 (the old entries underflow; shift may be -inf): 0, never 0 * -inf
            t = tl.where(alpha > 0.0, alpha * (t + s * shift0), 0.0) + tl.sum(ez, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        tgt += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        m = m_new

    plane = N.to(tl.int64) * num_splits
    out = split.to(tl.int64) * N + rows64
    tl.store(part_ptr + out, m, mask=row_mask)
    tl.store(part_ptr + plane + out, s, mask=row_mask)
    if WITH_ENT:
        tl.store(part_ptr + 2 * plane + out, t, mask=row_mask)
    tl.store(part_ptr + 3 * plane + out, tgt, mask=row_mask)


@triton.jit(do_not_specialize=["N"])
def _stats_combine_kernel(
    part_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,  # (2, N) fp32 out: the raw row max M and log s
    N,
    V,
    num_splits,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    rows64 = rows.to(tl.int64)
    n64 = N.to(tl.int64)
    plane = n64 * num_splits
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for i in range(0, num_splits):
        m = tl.maximum(m, tl.load(part_ptr + i * n64 + rows64, mask=mask, other=0.0))
    base = tl.where(m == float("-inf"), 0.0, m)
    two_inv_t = 2.0 * inv_t
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    t = tl.zeros((BLOCK,), dtype=tl.float32)
    tgt = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, num_splits):
        off = i * n64 + rows64
        mi = tl.load(part_ptr + off, mask=mask, other=0.0)
        si = tl.load(part_ptr + plane + off, mask=mask, other=0.0)
        shift = (mi * 0.5 - base * 0.5) * two_inv_t
        alpha = tl.exp(shift)
        s += si * alpha
        if WITH_ENT:
            ti = tl.load(part_ptr + 2 * plane + off, mask=mask, other=0.0)
            shift0 = tl.where(mi == float("-inf"), 0.0, shift)
            t += tl.where(alpha > 0.0, alpha * (ti + si * shift0), 0.0)
        tgt += tl.load(part_ptr + 3 * plane + off, mask=mask, other=0.0)
    log_s = tl.log(s)
    lse = _lse(m, log_s, inv_t)
    y = tl.load(labels_ptr + rows64, mask=mask, other=ignore_index)
    valid = y != ignore_index
    # a label outside [0, V) (value checks off) matched no column: NaN, never a stray read
    in_range = (y >= 0) & (y < V)
    logp = tl.where(in_range, (tgt * 0.5 - m * 0.5) * two_inv_t - log_s, float("nan"))
    tl.store(lse_ptr + rows64, lse, mask=mask)
    tl.store(norm_ptr + rows64, m, mask=mask)
    tl.store(norm_ptr + n64 + rows64, log_s, mask=mask)
    tl.store(logp_ptr + rows64, tl.where(valid, logp, 0.0), mask=mask)
    if WITH_ENT:
        tl.store(ent_ptr + rows64, tl.where(valid, log_s - t / s, 0.0), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _dlogits_kernel(
    src_ptr,
    w_ptr,
    b_ptr,
    labels_ptr,
    lse_ptr,
    norm_ptr,  # (2, N): raw row max M, log s (read with HAS_NORM)
    ent_ptr,
    g_logp_ptr,
    g_ent_ptr,
    out_ptr,  # (N, v_hi - v_lo) with row stride stride_out
    db_ptr,
    N,
    V,
    v_lo,
    v_hi,
    D,
    stride_src,
    stride_w,
    stride_out,
    inv_t,
    ignore_index,
    FROM_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """dlogits = (g ([v == y] - p) - e p (log p + H)) / tau on vocabulary columns
    [v_lo, v_hi), recomputing the logits; stored in out's dtype; db += column sums.
    log p = (z/2 - M/2)(2/tau) - log s from the forward's raw row max M and log s (HAS_NORM,
    for each row whose lse they reproduce), else z / tau - lse from the rounded lse alone."""
    num_tiles = tl.cdiv(N, BLOCK_N)
    num_vb = tl.cdiv(v_hi - v_lo, BLOCK_V)
    pid_n, pid_v = grouped_pid(tl.program_id(0), num_tiles, num_vb, GROUP)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_lo + local
    col_mask = cols < v_hi
    raw = _logits_tile(
        src_ptr, w_ptr, b_ptr, rows64, row_mask, cols, col_mask, D, stride_src, stride_w,
        FROM_LOGITS, HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_D, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    z = tl.where(col_mask[None, :], raw, float("-inf"))
    y = tl.load(labels_ptr + rows64, mask=row_mask, other=ignore_index)
    # an out-of-range label (value checks off) gets a zero gradient, like an ignored one
    valid = (y != ignore_index) & (y >= 0) & (y < V) & row_mask
    lse = tl.load(lse_ptr + rows64, mask=row_mask, other=0.0)
    shift = tl.zeros((BLOCK_N,), dtype=tl.float32)  # per row: log p = (z/2 - shift/2)(2/tau) - off
    off = lse
    if HAS_NORM:
        m = tl.load(norm_ptr + rows64, mask=row_mask, other=0.0)
        log_s = tl.load(norm_ptr + N.to(tl.int64) + rows64, mask=row_mask, other=0.0)
        same = _lse(m, log_s, inv_t) == lse  # the pair belongs to this lse (never NaN)
        shift = tl.where(same, m, 0.0)
        off = tl.where(same, log_s, lse)
    g = tl.where(valid, tl.load(g_logp_ptr + rows64, mask=row_mask, other=0.0), 0.0)
    log_p = (z * 0.5 - shift[:, None] * 0.5) * (2.0 * inv_t) - off[:, None]
    p = tl.exp(log_p)
    grad = tl.where(cols[None, :] == y[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_ENT_GRAD:
        e = tl.where(valid, tl.load(g_ent_ptr + rows64, mask=row_mask, other=0.0), 0.0)
        ent = tl.load(ent_ptr + rows64, mask=row_mask, other=0.0)
        grad -= e[:, None] * tl.where(p > 0.0, p * (log_p + ent[:, None]), 0.0)
    grad = tl.where(valid[:, None], grad * inv_t, 0.0)
    out = out_ptr + rows64[:, None] * stride_out + local.to(tl.int64)[None, :]
    tl.store(out, grad.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
    if BIAS_GRAD:
        tl.atomic_add(db_ptr + cols.to(tl.int64), tl.sum(grad, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["M", "K"])
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """c (+)= a @ b with fp32 accumulation; a is cast to b's dtype before the dot (so an
    fp32 gradient chunk can meet a bf16 weight), c is written in its own dtype."""
    pid_m, pid_n = grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_mask = rk < K
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        a = a.to(b.dtype)
        if UPCAST_DOT:  # interpreter only, see _common.interpreter_upcast
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    c_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# --------------------------------------------------------------------------- launch config


def tiles(dtype: torch.dtype, from_logits: bool = False) -> dict:
    """Fixed tile sizes (see the header); small-launch-count tiles under the interpreter."""
    if interpreting():
        if from_logits:
            return dict(BLOCK_N=16, BLOCK_V=1024, BLOCK_D=16, num_warps=4, num_stages=1)
        return dict(BLOCK_N=32, BLOCK_V=256, BLOCK_D=64, num_warps=4, num_stages=1)
    if from_logits:
        return dict(BLOCK_N=4, BLOCK_V=1024, BLOCK_D=16, num_warps=4, num_stages=2)
    if dtype == torch.float32:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, num_warps=4, num_stages=2)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, num_warps=8, num_stages=3)


def _gemm_tiles(dtype: torch.dtype) -> dict:
    if interpreting():
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


_GROUP = 8


_PARTIALS_BYTES = 64 << 20


def _num_splits(n: int, num_tiles: int, num_vblocks: int, device: torch.device, gemm: bool):
    """Vocabulary splits per token tile: enough programs for two waves and, for the fused
    GEMM, up to 32 splits of >= 8 blocks each so that the tiles running together (grouped
    order) share their hidden and weight tiles in L2; the L2 splits stop where the (4, S, N)
    fp32 partials would pass 64 MiB (very large N, where the waves are full anyway)."""
    want = cdiv(2 * _num_sms(device), num_tiles)
    if gemm:
        want = max(want, min(32, num_vblocks // 8, _PARTIALS_BYTES // (16 * n)))
    return max(1, min(num_vblocks, want))


# --------------------------------------------------------------------------- launchers


def lse_stats(
    src, weight, bias, labels, v, temperature, ignore_index, with_ent, from_logits, store=None
):
    """logp, entropy (or (0,)), lse and norm ((2, N) as one flat 2 N tensor: the raw row
    max M and log s, from which the backward forms log p without the rounded lse) for
    every row of src (hidden, or logits); with ``store`` ((N, V) fp32, unit column
    stride) the raw logits are also written there."""
    n = src.shape[0]
    d = 0 if from_logits else src.shape[1]
    cfg = tiles(src.dtype, from_logits)
    bn, bv = cfg["BLOCK_N"], cfg["BLOCK_V"]
    num_tiles, num_vblocks = cdiv(n, bn), cdiv(v, bv)
    splits = _num_splits(n, num_tiles, num_vblocks, src.device, gemm=not from_logits)
    per_split = cdiv(num_vblocks, splits)
    splits = cdiv(num_vblocks, per_split)  # every split non-empty
    part = torch.empty((4, splits, n), dtype=torch.float32, device=src.device)
    w = src if weight is None else weight
    _stats_partial_kernel[(num_tiles * splits,)](
        src, w, w if bias is None else bias, labels, part, part if store is None else store,
        n, v, d, src.stride(0), w.stride(0), 0 if store is None else store.stride(0),
        1.0 / temperature, splits, per_split, STORE_LOGITS=store is not None,
        FROM_LOGITS=from_logits, HAS_BIAS=bias is not None, WITH_ENT=with_ent,
        GROUP=_GROUP, DOT_PRECISION=dot_precision(src.dtype),
        UPCAST_DOT=interpreter_upcast(src.dtype), **cfg,
    )  # fmt: skip
    logp = torch.empty(n, dtype=torch.float32, device=src.device)
    lse = torch.empty(n, dtype=torch.float32, device=src.device)
    ent = torch.empty(n if with_ent else 0, dtype=torch.float32, device=src.device)
    norm = torch.empty(2 * n, dtype=torch.float32, device=src.device)  # (2, N) flat
    block = 1024 if not interpreting() else 256
    _stats_combine_kernel[(cdiv(n, block),)](
        part, labels, logp, ent if with_ent else lse, lse, norm, n, v, splits,
        1.0 / temperature, ignore_index, WITH_ENT=with_ent, BLOCK=block,
    )  # fmt: skip
    return logp, ent, lse, norm


def matmul(a, b, c, accumulate: bool):
    """c (+)= a @ b; a (M, K), b (K, N), c (M, N) strided views (fp32 accumulation)."""
    m, k = a.shape
    n = b.shape[1]
    cfg = _gemm_tiles(b.dtype)
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        c.stride(1), ACCUMULATE=accumulate, GROUP=_GROUP, DOT_PRECISION=dot_precision(b.dtype),
        UPCAST_DOT=interpreter_upcast(b.dtype), **cfg,
    )  # fmt: skip


def _vocab_chunk(n: int, v: int, elem_bytes: int, block: int) -> int:
    cols = chunk_bytes() // max(1, n * elem_bytes)
    return min(v, max(block, cols // block * block))


def dlogits(
    src, weight, bias, labels, lse, ent, g_logp, g_ent, out, db, v_lo, v_hi, temperature,
    ignore_index, norm=None,
):  # fmt: skip
    """out[:, :v_hi - v_lo] = dlogits of vocabulary columns [v_lo, v_hi), out's dtype.

    weight None: src is (N, V) logits (read, may be ``out`` itself: each element is read
    and written by the same program); else src is hidden and the logits are recomputed.
    ent/g_ent (N,) or None (no entropy gradient); db (V,) fp32 accumulated, or None;
    norm: lse_stats' (2, N) (raw max, log s) of these rows, or None (lse alone)."""
    from_logits = weight is None
    n = src.shape[0]
    cfg = tiles(src.dtype, from_logits)
    has_ent = ent is not None and g_ent is not None
    w = src if from_logits else weight
    grid = (cdiv(n, cfg["BLOCK_N"]) * cdiv(v_hi - v_lo, cfg["BLOCK_V"]),)
    _dlogits_kernel[grid](
        src, w, w if bias is None else bias, labels, lse, lse if norm is None else norm,
        ent if has_ent else lse, g_logp, g_ent if has_ent else g_logp, out,
        lse if db is None else db, n, w.shape[0] if not from_logits else src.shape[1], v_lo,
        v_hi, 0 if from_logits else src.shape[1], src.stride(0), w.stride(0), out.stride(0),
        1.0 / temperature, ignore_index,
        FROM_LOGITS=from_logits, HAS_BIAS=bias is not None, HAS_NORM=norm is not None,
        HAS_ENT_GRAD=has_ent, BIAS_GRAD=db is not None, GROUP=_GROUP,
        DOT_PRECISION=dot_precision(src.dtype), UPCAST_DOT=interpreter_upcast(src.dtype), **cfg,
    )  # fmt: skip


def linear_grad(
    hidden, weight, bias, labels, lse, ent, g_logp, g_ent, temperature, ignore_index, norm=None
):
    """(dh, dW fp32, db fp32 or (0,)) for upstream g_logp (N,) and optional entropy terms
    (ent and g_ent both (N,), or None): the three-GEMM vocabulary-chunked backward; norm as
    in ``dlogits``."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    dw = torch.empty((v, d), dtype=torch.float32, device=dev)
    db = torch.zeros(v if bias is not None else 0, dtype=torch.float32, device=dev)
    dh32 = torch.empty((n, d), dtype=torch.float32, device=dev)
    cv = _vocab_chunk(n, v, hidden.element_size(), tiles(hidden.dtype)["BLOCK_V"])
    g_buf = torch.empty((n, cv), dtype=hidden.dtype, device=dev)
    for i, v_lo in enumerate(range(0, v, cv)):
        v_hi = min(v, v_lo + cv)
        g = g_buf[:, : v_hi - v_lo]
        dlogits(
            hidden, weight, bias, labels, lse, ent, g_logp, g_ent, g,
            db if bias is not None else None, v_lo, v_hi, temperature, ignore_index, norm,
        )  # fmt: skip
        matmul(g.t(), hidden, dw[v_lo:v_hi], accumulate=False)
        matmul(g, weight[v_lo:v_hi], dh32, accumulate=i > 0)
    dh = dh32 if hidden.dtype == torch.float32 else dh32.to(hidden.dtype)
    return dh, dw, db


# --------------------------------------------------------------------------- saved norms
# The backward forms log p = (z/2 - M/2)(2/tau) - log s from each row's raw max M and log s
# (lse_stats' norm), not z / tau - lse from the rounded fp32 lse: that is off by up to
# ulp(lse) / 2 in every log p (5e-4 at |z / tau| ~ 1e4: the row's p no longer sum to 1) and
# overflows at |z / tau| > float max. The forwards return the norm as their fourth output,
# ``saved`` ((2, N) flattened; the op saves it for the backward, mrtpo_kernels/logprobs.py),
# and the backwards take it back; each row uses it only where (M, log s) reproduce the
# given lse bit for bit (``_dlogits_kernel``), otherwise, and for an empty or foreign
# ``saved``, log p comes from the lse alone.


def _norm_from(saved, n: int):
    """The (2, n) norm from a forward's ``saved``, or None (empty, or not 2 n floats)."""
    if saved is None or saved.numel() != 2 * n or n == 0:
        return None
    return saved.view(2, n)


def saved_numel(n: int) -> int:
    """Elements of the forwards' ``saved`` output (the op's fake reads it)."""
    return 2 * n


# --------------------------------------------------------------------------- backend API


def linear_logprobs_fwd(hidden, weight, bias, labels, temperature, ignore_index, with_entropy):
    check_device("hidden", hidden)
    logp, ent, lse, norm = lse_stats(
        hidden, weight, bias, labels, weight.shape[0], temperature, ignore_index,
        bool(with_entropy), from_logits=False,
    )  # fmt: skip
    return logp, ent, lse, norm  # flat (2 N): the base, not a view


def linear_logprobs_bwd(
    hidden, weight, bias, labels, lse, entropy, grad_logp, grad_entropy, temperature,
    ignore_index, saved=None,
):  # fmt: skip
    check_device("hidden", hidden)
    has_ent = entropy.numel() > 0 and grad_entropy.numel() > 0
    return linear_grad(
        hidden, weight, bias, labels, lse, entropy if has_ent else None, grad_logp,
        grad_entropy if has_ent else None, temperature, ignore_index,
        _norm_from(saved, hidden.shape[0]),
    )  # fmt: skip


def logprobs_from_logits_fwd(logits, labels, temperature, ignore_index, with_entropy):
    check_device("logits", logits)
    logp, ent, lse, norm = lse_stats(
        logits, None, None, labels, logits.shape[1], temperature, ignore_index,
        bool(with_entropy), from_logits=True,
    )  # fmt: skip
    return logp, ent, lse, norm  # flat (2 N): the base, not a view


def logprobs_from_logits_bwd(
    logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index,
    saved=None,
):  # fmt: skip
    check_device("logits", logits)
    has_ent = entropy.numel() > 0 and grad_entropy.numel() > 0
    out = torch.empty_like(logits)
    dlogits(
        logits, None, None, labels, lse, entropy if has_ent else None, grad_logp,
        grad_entropy if has_ent else None, out, None, 0, logits.shape[1], temperature,
        ignore_index, _norm_from(saved, logits.shape[0]),
    )  # fmt: skip
    return out
