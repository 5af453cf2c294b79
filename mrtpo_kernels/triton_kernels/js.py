"""One-vs-many Jensen-Shannon distance (METHOD.md section 3), fused with the LM head
(``linear_js_distance``) and from logits that already exist (``js_distance``). No gradient.

Math (per token row r, stream k = 1..K, vocabulary entry v; tau the temperature):
    lp_v = z_p[v] / tau - lse_p,   lq_v = z_q[k, v] / tau - lse_q[k]    (log P, log Q)
    JSD  = 1/2 sum_v [ p log(p/m) + q log(q/m) ],  m = (p + q) / 2
    d    = min(1, sqrt(max(JSD, 0) / ln 2))
  Each vocabulary term is evaluated without cancellation from delta = lp - lq (each log
  formed first, so identical rows give delta = 0 exactly and a huge logit only meets its
  own row's lse):
    p log(p/m) + q log(q/m) = m h,   h = 2 (x tanh x - log cosh x),  x = delta / 2
    |delta| <  1/2:  h = x^2 - x^4/2 + 2x^6/9 - 17x^8/180 + 62x^10/1575 - 1382x^12/85050
                     (next term below 1e-9 relative there)
    |delta| >= 1/2:  m h = (p + q)(ln 2 - log(1 + e^-|delta|)) - min(p, q) |delta|
  Every term is >= 0, and 0 where p = q = 0. Disjoint supports give JSD = ln 2, d = 1.
  Per term and stream: 3 transcendentals (exp lq, exp -|delta|, log(1 + e)); exp lp is
  shared by the K streams.

Design: the two log-normalizers are needed before any term can be summed, so the
vocabulary is visited twice; one GEMM pass keeps each token chunk's fp32 logits in a device
scratch between their two uses rather than computing the logits twice. Per chunk of C
tokens the hidden rows of the 1 + K streams are stacked into one (1 + K) C x d operand (P
first: its logits are computed once per chunk and shared by the K streams);
_js_logits_kernel writes the fp32 logits / tau and a log-sum-exp per (row, vocabulary
tile), _row_lse_kernel combines those per row, _js_sum_kernel reads the scratch once and
sums the terms over vocabulary splits, _js_finish_kernel adds the splits and takes the
square root. C keeps the scratch within MRTPO_JS_SCRATCH_BYTES. From existing logits
(js_distance) there is no GEMM: two reads of the logits, memory-bound. The counting behind
the choice, and what is not yet measured: docs/kernels.md.

Shapes, strides, dtypes:
  linear_js_distance(hidden_p (N, d), hidden_q (K, N, d), weight (V, d), bias (V,) | None, tau)
      -> (K, N) fp32; inputs contiguous, same dtype (bf16, fp16 or fp32; fp32 dots are IEEE
      fp32 unless torch's matmul precision allows tf32). Scratch per chunk: stacked hidden
      (1 + K, C, d), logits (1 + K, C, V) fp32, tile lse (1 + K, C, ceil(V / BLOCK_N)), lse
      (1 + K, C), split sums (S, K, C).
  js_distance(logits_p (N, V), logits_q (K, N, V), tau) -> (K, N) fp32; rows contiguous;
      scratch lse (1 + K, N), split sums (S, K, N).
  float64 inputs never reach these kernels: the dispatcher sends them to the "torch"
  backend (float64 throughout).
  N, V, d, K are run-time kernel arguments (RL batches vary); only tile sizes and flags are
  constexpr; offsets are int64; tails are masked; the max identity is -inf and guarded;
  all accumulation is fp32. No host synchronization.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .. import settings
from ._common import check_device, dot_precision, interpreter_upcast, interpreting, num_sms

LN2 = math.log(2.0)

# Series coefficients of h(x) = 2 (x tanh x - log cosh x) in powers of x^2 (see the header).
_H1 = tl.constexpr(-0.5)
_H2 = tl.constexpr(2.0 / 9.0)
_H3 = tl.constexpr(-17.0 / 180.0)
_H4 = tl.constexpr(62.0 / 1575.0)
_H5 = tl.constexpr(-1382.0 / 85050.0)
_LN2 = tl.constexpr(LN2)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _js_logits_kernel(
    a_ptr,  # (M, d): this chunk's hidden rows, streams stacked (P's rows, then each Q's)
    w_ptr,  # (V, d)
    b_ptr,  # (V,) or a dummy pointer when HAS_BIAS is False
    z_ptr,  # (M, V) fp32 scratch: (a W^T + b) / tau
    part_ptr,  # (M, n_vt) fp32: log-sum-exp of each row over each vocabulary tile
    M,
    D,
    V,
    n_vt,
    inv_t,
    stride_a,
    stride_w,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only, see _common.interpreter_upcast
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program order: all row tiles of one vocabulary tile are consecutive, so a weight tile
    # comes from HBM once per chunk and the chunk's rows (a few MiB) stay in L2.
    pid = tl.program_id(0)
    n_mt = tl.cdiv(M, BLOCK_M)
    pid_m = pid % n_mt
    pid_v = pid // n_mt

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_v = pid_v.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    v_mask = offs_v < V
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + offs_v[None, :] * stride_w + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_mask = (k0 + offs_k) < D
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & v_mask[None, :], other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # Epilogue on the fp32 accumulator: (z + b) / tau, stored fp32, and this tile's lse.
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_v, mask=v_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    zs = tl.where(v_mask[None, :], acc * inv_t, float("-inf"))
    z_ptrs = z_ptr + offs_m[:, None] * V + offs_v[None, :]
    tl.store(z_ptrs, zs, mask=m_mask[:, None] & v_mask[None, :])
    mx = tl.max(zs, axis=1)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    se = tl.sum(tl.exp(zs - mx_safe[:, None]), axis=1)
    tl.store(part_ptr + offs_m * n_vt + pid_v, mx_safe + tl.log(se), mask=m_mask)


@triton.jit
def _row_lse_kernel(
    x_ptr,  # rows of values, row (r, s) at s * stride_xs + r * stride_xr
    out_ptr,  # fp32, (s, r) at s * stride_os + r
    cols,
    stride_xs,
    stride_xr,
    stride_os,
    scale,
    BLOCK: tl.constexpr,
):
    # out = log sum_c exp(scale * x[c]); one program per (row, stream), one pass.
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    base = x_ptr + s * stride_xs + r * stride_xr
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for c0 in range(0, cols, BLOCK):
        idx = c0 + offs
        x = tl.load(base + idx, mask=idx < cols, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(out_ptr + s * stride_os + r, m_safe + tl.log(total))


@triton.jit
def _log1p_unit(x, FAST_LOG: tl.constexpr):
    """log(1 + x) for x in [0, 1]. FAST_LOG (on a GPU): lg2.approx.f32, the special
    function unit's log2 (CUDA's __log2f), times ln 2. The CUDA programming guide bounds
    __log2f by 2^-22 absolute for arguments in [0.5, 2] (here 1 + x in [1, 2]): at most
    1.7e-7 absolute in this log. tl.log (and tl.log2) compile to libdevice's logf, a
    software sequence on which the JS sum kernel's second pass is ALU-bound. Elsewhere (the
    interpreter, which has no inline PTX) tl.log."""
    if FAST_LOG:
        lg2 = tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [1.0 + x], dtype=tl.float32, is_pure=True, pack=1
        )
        return lg2 * _LN2
    return tl.log(1.0 + x)


@triton.jit
def _js_terms(p, q, delta, FAST_LOG: tl.constexpr):
    """Per-element p log(p/m) + q log(q/m) from p, q and delta = log p - log q (fp32).
    FAST_LOG: _log1p_unit's approximate log, at most 1.7e-7 (p + q) off per element (only
    where |delta| >= 1/2), so at most 1.7e-7 in the divergence (half the sum of the terms;
    the sum of p + q is 2)."""
    ad = tl.abs(delta)
    x2 = 0.25 * ad * ad
    h = x2 * (1.0 + x2 * (_H1 + x2 * (_H2 + x2 * (_H3 + x2 * (_H4 + x2 * _H5)))))
    small = 0.5 * (p + q) * h
    log1pe = _log1p_unit(tl.exp(-ad), FAST_LOG)
    mn = tl.minimum(p, q)
    large = (p + q) * (_LN2 - log1pe) - tl.where(mn > 0.0, mn * ad, 0.0)
    term = tl.where(ad < 0.5, small, large)
    return tl.where(p + q > 0.0, term, 0.0)


@triton.jit
def _js_sum_kernel(
    zp_ptr,  # P rows, row r at r * stride_p
    zq_ptr,  # Q rows, (k, r) at k * stride_qk + r * stride_q
    lse_ptr,  # (1 + K, *) fp32: lse of P at [0, r], of Q_k at [1 + k, r]
    part_ptr,  # (S, K, rows_alloc) fp32: this split's half sum of terms
    K,
    cols,
    cols_per_split,
    stride_p,
    stride_qk,
    stride_q,
    stride_ls,
    stride_part_s,
    stride_part_k,
    scale,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    # One program per (token row, vocabulary split); P's block is loaded and exponentiated
    # once and compared with all K streams ([BLOCK_K, BLOCK_V] tile).
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    lse_p = tl.load(lse_ptr + r)
    lse_q = tl.load(lse_ptr + (1 + kk).to(tl.int64) * stride_ls + r, mask=k_mask, other=0.0)
    dl = lse_p - lse_q
    p_row = zp_ptr + r * stride_p
    q_rows = zq_ptr + kk.to(tl.int64)[:, None] * stride_qk + r * stride_q
    v_lo = sp * cols_per_split
    v_hi = tl.minimum(v_lo + cols_per_split, cols)
    acc = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vm = offs < v_hi
        zp = tl.load(p_row + offs, mask=vm, other=float("-inf")).to(tl.float32) * scale
        zq = tl.load(
            q_rows + offs[None, :], mask=k_mask[:, None] & vm[None, :], other=float("-inf")
        )
        zq = zq.to(tl.float32) * scale
        lp = zp - lse_p
        lq = zq - lse_q[:, None]
        p = tl.exp(lp)
        q = tl.exp(lq)
        delta = lp[None, :] - lq  # log p - log q: a huge logit never meets the other lse
        acc += _js_terms(p[None, :], q, delta, FAST_LOG)
    half = 0.5 * tl.sum(acc, axis=1)
    # a row with a NaN or +inf (lse NaN) or nothing but -inf (lse -inf) has no distribution:
    # NaN, never the 0 that the p + q > 0 mask of _js_terms would give (README "Numerics")
    defined = tl.abs(dl) < float("inf")  # dl = lse_p - lse_q: finite iff both are
    half = tl.where(defined, half, float("nan"))
    tl.store(part_ptr + sp * stride_part_s + kk.to(tl.int64) * stride_part_k + r, half, k_mask)


@triton.jit
def _js_finish_kernel(
    part_ptr,  # (S, K, rows_alloc) fp32
    out_ptr,  # (K, N) fp32
    K,
    rows,
    splits,
    row0,
    stride_part_s,
    stride_part_k,
    stride_out_k,
    BLOCK: tl.constexpr,
):
    # d = min(1, sqrt(max(JSD, 0) / ln 2)), JSD = sum over the S splits (fixed order).
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < K * rows
    k = j // rows
    r = j % rows
    src = part_ptr + k * stride_part_k + r
    jsd = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(0, splits):
        jsd += tl.load(src + sp * stride_part_s, mask=mask, other=0.0)
    # clamps by comparison: tl.maximum / tl.minimum may drop a NaN on the GPU
    d = tl.sqrt_rn(tl.where(jsd < 0.0, 0.0, jsd) * (1.0 / _LN2))
    tl.store(out_ptr + k * stride_out_k + row0 + r, tl.where(d > 1.0, 1.0, d), mask=mask)


# --------------------------------------------------------------------------- launchers


class _GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _gemm_configs(dtype: torch.dtype) -> list[_GemmConfig]:
    """Tile sizes for _js_logits_kernel, best first; the later ones (same BLOCK_N, less
    shared memory) are used where the first does not fit the device.
    MRTPO_JS_GEMM="BM,BN,BK,warps,stages" overrides (for tuning on a GPU).
    Hopper, 16-bit: 128 x 256 x 64 tiles, 8 warps (two warpgroups of wgmma), 3 stages of
    (128 + 256) x 64 x 2 B = 48 KiB of shared memory each. fp32 (IEEE dots unless torch
    allows tf32) on smaller tiles. Not yet tuned on the H200 (no measurement so far)."""
    override = settings.js_gemm()
    if override is not None:
        return [_GemmConfig(*override)]
    if interpreting():
        return [_GemmConfig(64, 256, 64, 4, 1)]  # few, large programs: the interpreter is numpy
    if dtype == torch.float32:
        return [_GemmConfig(64, 128, 32, 4, 3), _GemmConfig(64, 128, 16, 4, 2)]
    return [
        _GemmConfig(128, 256, 64, 8, 3),
        _GemmConfig(128, 256, 64, 8, 2),
        _GemmConfig(64, 256, 32, 4, 2),
    ]


_GEMM_FIRST_OK: dict[tuple, int] = {}


def _launch_logits_gemm(dtype, device, grid_for, args, flags):
    """Launch _js_logits_kernel with the first config of _gemm_configs that fits."""
    configs = _gemm_configs(dtype)
    key = (dtype, str(device), configs[0])
    for i in range(_GEMM_FIRST_OK.get(key, 0), len(configs)):
        cfg = configs[i]
        try:
            _js_logits_kernel[grid_for(cfg.block_m)](
                *args, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
        except OutOfResources:
            if i + 1 == len(configs):
                raise
            continue
        _GEMM_FIRST_OK[key] = i
        return


def _chunk_rows(n: int, vocab: int, streams: int, block_m: int) -> int:
    """Tokens per chunk so the (streams, C, V) fp32 logits scratch fits the budget."""
    c = settings.js_scratch_bytes() // (4 * streams * vocab)
    if c >= block_m:
        c -= c % block_m
    return max(1, min(c, n))


def _sum_blocks(k: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(k)
    elems = 8192 if interpreting() else 4096
    return block_k, max(64, elems // block_k)


def _splits(rows: int, cols: int, block_v: int, device: torch.device) -> tuple[int, int]:
    """Vocabulary splits per row so that rows x splits programs fill the GPU (8 per SM)."""
    target = 8 * num_sms(device)
    splits = max(1, min(triton.cdiv(target, rows), triton.cdiv(cols, block_v)))
    per_split = triton.cdiv(triton.cdiv(cols, splits), block_v) * block_v
    return triton.cdiv(cols, per_split), per_split


def _lse_block(cols: int) -> int:
    return min(triton.next_power_of_2(max(cols, 16)), 8192 if interpreting() else 2048)


def _js_sum_and_finish(zp, zq, lse, out, row0, scale):
    """Launch _js_sum_kernel and _js_finish_kernel: zp (rows, V) and zq (K, rows, V) views
    with unit last stride, lse (1 + K, rows) fp32; writes out[:, row0 : row0 + rows]."""
    rows, cols = zp.shape
    k = zq.shape[0]
    block_k, block_v = _sum_blocks(k)
    splits, per_split = _splits(rows, cols, block_v, out.device)
    part = torch.empty((splits, k, rows), dtype=torch.float32, device=out.device)
    _js_sum_kernel[(rows, splits)](
        zp, zq, lse, part, k, cols, per_split, zp.stride(0), zq.stride(0), zq.stride(1),
        lse.stride(0), k * rows, rows, scale, BLOCK_K=block_k, BLOCK_V=block_v,
        FAST_LOG=not interpreting(), num_warps=8,
    )  # fmt: skip
    fin_block = 1024
    _js_finish_kernel[(triton.cdiv(k * rows, fin_block),)](
        part, out, k, rows, splits, row0, k * rows, rows, out.stride(0), BLOCK=fin_block,
        num_warps=4,
    )  # fmt: skip


def linear_js_distance(hidden_p, hidden_q, weight, bias, temperature):
    """(K, N) fp32 JS distances between softmax((hidden_p W^T + b) / tau) and each of the
    K streams softmax((hidden_q[k] W^T + b) / tau). Inputs contiguous, validated."""
    check_device("hidden_p", hidden_p)
    n, d = hidden_p.shape
    k = hidden_q.shape[0]
    v = weight.shape[0]
    streams = 1 + k
    dev = hidden_p.device
    out = torch.empty((k, n), dtype=torch.float32, device=dev)
    if n == 0 or k == 0:
        return out
    cfg = _gemm_configs(hidden_p.dtype)[0]
    c = _chunk_rows(n, v, streams, cfg.block_m)
    n_vt = triton.cdiv(v, cfg.block_n)
    # Per-chunk buffers, viewed densely as (streams, rows, .) for the last, shorter chunk.
    a_buf = torch.empty(streams * c * d, dtype=hidden_p.dtype, device=dev)
    z_buf = torch.empty(streams * c * v, dtype=torch.float32, device=dev)
    part_buf = torch.empty(streams * c * n_vt, dtype=torch.float32, device=dev)
    lse_buf = torch.empty(streams * c, dtype=torch.float32, device=dev)
    precision = dot_precision(hidden_p.dtype) if hidden_p.dtype == torch.float32 else "tf32"
    upcast = interpreter_upcast(hidden_p.dtype)
    if upcast:
        precision = "ieee"
    flags = dict(HAS_BIAS=bias is not None, DOT_PRECISION=precision, UPCAST_DOT=upcast)
    b_arg = bias if bias is not None else weight
    for row0 in range(0, n, c):
        rows = min(c, n - row0)
        m = streams * rows
        a = a_buf[: m * d].view(streams, rows, d)
        a[0].copy_(hidden_p[row0 : row0 + rows])
        a[1:].copy_(hidden_q[:, row0 : row0 + rows])
        z = z_buf[: m * v].view(streams, rows, v)
        part = part_buf[: m * n_vt]
        lse = lse_buf[:m]
        args = (a, weight, b_arg, z, part, m, d, v, n_vt, 1.0 / temperature, d, weight.stride(0))
        _launch_logits_gemm(
            hidden_p.dtype, dev, lambda bm, m=m: (triton.cdiv(m, bm) * n_vt,), args, flags
        )
        _row_lse_kernel[(m, 1)](part, lse, n_vt, 0, n_vt, 0, 1.0, BLOCK=_lse_block(n_vt))
        _js_sum_and_finish(z[0], z[1:], lse.view(streams, rows), out, row0, 1.0)
    return out


def js_distance(logits_p, logits_q, temperature):
    """(K, N) fp32 JS distances between softmax(logits_p / tau) and each
    softmax(logits_q[k] / tau). Inputs contiguous, validated."""
    check_device("logits_p", logits_p)
    n, v = logits_p.shape
    k = logits_q.shape[0]
    dev = logits_p.device
    inv_t = 1.0 / temperature
    lse = torch.empty((1 + k, n), dtype=torch.float32, device=dev)
    out = torch.empty((k, n), dtype=torch.float32, device=dev)
    if n == 0 or k == 0:
        return out
    block = _lse_block(v)
    warps = 8 if block >= 2048 else 4
    _row_lse_kernel[(n, 1)](logits_p, lse, v, 0, v, 0, inv_t, BLOCK=block, num_warps=warps)
    _row_lse_kernel[(n, k)](logits_q, lse[1:], v, n * v, v, n, inv_t, BLOCK=block, num_warps=warps)
    _js_sum_and_finish(logits_p, logits_q, lse, out, 0, inv_t)
    return out
