"""Triton row kernels, JS one-vs-many (``js_many``) on the stacked (1 + K) C rows of one
GEMM: a per-row pass for each row's raw max M and log s (``_row_norm_kernel``), then
split sums over the vocabulary of the terms of js_terms.py (``_js_rows_sum_kernel``),
with log p = x - log s formed from each row's own raw max (no z / tau, no rounded lse),
and ``_js_finish_kernel`` (js_terms.py) for the distances. rows.py's header has the
contract; ``TritonRowKernel`` binds ``js_many`` as its method.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting
from .js_terms import _js_finish_kernel, _js_terms, _splits, _sum_blocks
from .row_math import _row_offset, _row_scan, _warps, row_block


@triton.jit
def _row_norm_kernel(
    z_ptr,
    m_ptr,
    log_s_ptr,
    V,
    rows,
    stride_s,
    stride_r,
    inv_t,
    BLOCK: tl.constexpr,
):
    """Per (row, stream) of the stacked JS logits: the raw max M and log s (NaN for a row
    with a NaN or +inf, or nothing but -inf), stored at stream * rows + row."""
    r = tl.program_id(0)
    st = tl.program_id(1)
    row_ptr = z_ptr + _row_offset(st, stride_s) + _row_offset(r, stride_r)
    m, s, _, bad = _row_scan(row_ptr, V, inv_t, False, BLOCK)
    ok = (bad == 0) & (m > float("-inf"))
    at = _row_offset(st, rows) + r
    tl.store(m_ptr + at, m)
    tl.store(log_s_ptr + at, tl.where(ok, tl.log(s), float("nan")))


@triton.jit
def _js_rows_sum_kernel(
    z_ptr,  # (1 + K, rows, V): P at stream 0, Q_k at stream 1 + k
    m_ptr,  # (1 + K, rows) raw row max
    log_s_ptr,  # (1 + K, rows) log s of x = (z - M) / tau
    part_ptr,  # (S, K, rows) fp32: this split's half sum of terms
    K,
    rows,
    cols,
    cols_per_split,
    stride_s,
    stride_r,
    inv_t,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """One program per (token row, vocabulary split), P's block shared by the K streams:
    log p = (z_p - M_p) / tau - log s_p and log q likewise, each from its own row's raw max
    and sum (no z / tau, no rounded lse), delta = log p - log q from the raw differences
    where that form rounds less (close rows), then the terms of js_terms._js_terms."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_mask = kk < K
    q_at = (1 + kk).to(tl.int64) * rows + r
    m_p = tl.load(m_ptr + r)
    ls_p = tl.load(log_s_ptr + r)
    m_q = tl.load(m_ptr + q_at, mask=k_mask, other=0.0)
    ls_q = tl.load(log_s_ptr + q_at, mask=k_mask, other=0.0)
    two_inv_t = 2.0 * inv_t
    dmh = m_p * 0.5 - m_q * 0.5  # (M_p - M_q) / 2 per stream
    dls = ls_p - ls_q
    p_row = z_ptr + r * stride_r
    q_rows = z_ptr + (1 + kk).to(tl.int64)[:, None] * stride_s + r * stride_r
    v_lo = sp * cols_per_split
    v_hi = tl.minimum(v_lo + cols_per_split, cols)
    acc = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vm = offs < v_hi
        zp = tl.load(p_row + offs, mask=vm, other=float("-inf")).to(tl.float32)
        zq = tl.load(
            q_rows + offs[None, :], mask=k_mask[:, None] & vm[None, :], other=float("-inf")
        ).to(tl.float32)
        lp = (zp * 0.5 - m_p * 0.5) * two_inv_t - ls_p
        lq = (zq * 0.5 - m_q[:, None] * 0.5) * two_inv_t - ls_q[:, None]
        p = tl.exp(lp)
        q = tl.exp(lq)
        # delta = log p - log q in the form with the smaller rounding error: from the raw
        # differences ((z_p - z_q) - (M_p - M_q)) / tau - (log s_p - log s_q) where those are
        # small next to |lp| + |lq| (close rows: exactly 0 for identical ones, and free of the
        # rounding of lp, lq), else lp - lq (rows of different scales, where the raw form
        # would cancel two huge terms)
        dz = zp[None, :] * 0.5 - zq * 0.5
        raw = (dz - dmh[:, None]) * two_inv_t - dls[:, None]
        raw_ok = (tl.abs(dz) + tl.abs(dmh[:, None])) * two_inv_t <= tl.abs(lp[None, :]) + tl.abs(lq)
        delta = tl.where(raw_ok, raw, lp[None, :] - lq)
        acc += _js_terms(p[None, :], q, delta, FAST_LOG)
    half = 0.5 * tl.sum(acc, axis=1)
    # no distribution on either side (log s NaN): NaN, never 0 (README "Numerics")
    defined = tl.abs(ls_p - ls_q) < float("inf")  # finite iff both are
    half = tl.where(defined, half, float("nan"))
    tl.store(part_ptr + sp * (K * rows) + kk.to(tl.int64) * rows + r, half, k_mask)


def js_many(z, inv_t):
    """(K, C) distances between row block 0 of z (1 + K, C, V) fp32 (P) and each of the
    K blocks after it (Q streams). Each row is shifted by its raw max before the
    temperature, as in stats: finite logits never overflow through z / tau."""
    check_device("z", z)
    streams, rows, v = z.shape
    k = streams - 1
    f32 = dict(dtype=torch.float32, device=z.device)
    out = torch.empty((k, rows), **f32)
    if rows == 0 or k == 0:
        return out
    if z.stride(2) != 1:
        z = z.contiguous()
    m, log_s = torch.empty((streams, rows), **f32), torch.empty((streams, rows), **f32)
    block = row_block(v)
    _row_norm_kernel[(rows, streams)](
        z,
        m,
        log_s,
        V=v,
        rows=rows,
        stride_s=z.stride(0),
        stride_r=z.stride(1),
        inv_t=float(inv_t),
        BLOCK=block,
        num_warps=_warps(block),
    )
    block_k, block_v = _sum_blocks(k)
    splits, per_split = _splits(rows, v, block_v, z.device)
    part = torch.empty((splits, k, rows), **f32)
    _js_rows_sum_kernel[(rows, splits)](
        z,
        m,
        log_s,
        part,
        K=k,
        rows=rows,
        cols=v,
        cols_per_split=per_split,
        stride_s=z.stride(0),
        stride_r=z.stride(1),
        inv_t=float(inv_t),
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        FAST_LOG=not interpreting(),  # lg2.approx on a GPU (js_terms._log1p_unit)
        num_warps=8,
    )
    _js_finish_kernel[(triton.cdiv(k * rows, 1024),)](
        part,
        out,
        K=k,
        rows=rows,
        splits=splits,
        row0=0,
        stride_part_s=k * rows,
        stride_part_k=rows,
        stride_out_k=out.stride(0),
        BLOCK=1024,
        num_warps=4,
    )
    return out
