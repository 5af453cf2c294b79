"""Triton row kernels: the chunk-kernel contract of mrtpo_kernels/backends/_chunked.py on
the GPU (the same contract the C++ kernels of csrc/cpu and the PyTorch kernels of
backends/torch_backend.py implement), so one chunk driver serves every device.

The driver makes each token chunk's fp32 logits z [C, V] with one cuBLAS GEMM into a reused
buffer; these kernels then make one program per row that streams the row once for its
statistics and, where a gradient is asked for, a second time to write dL/dlogits in place.

Per row (z the raw logits, tau the temperature, M the raw row max; README "Numerics"):
    x_v = (z_v / 2 - M / 2) (2 / tau)       (halving is exact: finite z never overflows)
    log s = log sum_v exp(x_v),  lse = M / tau + log s,  logp = x_y - log s
    H = log s - (sum_v e^x_v x_v) / s
  computed online in one pass (M, s and t = sum e^x x rescaled when M grows). A row with a
  NaN or +inf, or nothing but -inf, is undefined: NaN log-prob, entropy, lse and gradient.
  Ignored rows (label = ignore_index): logp = H = 0 and a zero gradient. A label outside
  [0, V) (value checks off) gives a NaN log-prob and a zero gradient.
Gradient (written over the row, or into ``out``, a 16-bit view of the same storage):
    dz_v = (g ([v == y] - p_v) - e p_v (log p_v + H)) / tau,  p_v = exp(x_v - log s)
  g and e the upstream gradients of logp and H. For the policy loss g is the per-token
  derivative of the surrogate, known as soon as the row's log s is:
    ratio = exp(logp - old),  r_c = clamp(ratio, 1 - clip_low, 1 + clip_high)
    L = -min(ratio A, r_c A) + beta (exp(ref - logp) - (ref - logp) - 1)
    g = w (-A ratio [not clipped] + beta (1 - exp(ref - logp))),  clipped = [ratio A > r_c A]
  (strictly, as the reference: a tie or a NaN is not clipped, and passes the gradient,
  NaN for a NaN), and the options of the contract: the dual clip caps the surrogate at
  -A clip_ratio_c for A < 0 (g's surrogate part 0 where it binds); kl_iw multiplies the k3
  term by the ratio.
Gradient output: in place over z (each element written by the thread that read it, in
the same step), or into ``out``, which must not overlap z (the driver passes rows of a
separate 16-bit buffer): a 16-bit view of z's own storage would have threads write bytes
that another warp still has to read, with no barrier between them (``_check_out`` refuses
it).

Row offsets are int64 (``_row_offset``): C x V passes 2^31 at V = 151936 beyond 14134 rows.
JS one-vs-many (``js_many``) runs on the stacked (1 + K) C rows of one GEMM: a per-row
pass for (M, log s), then split sums of the terms of js_terms.py over the vocabulary, with
log p = x - log s formed from each row's own raw max (no z / tau, no rounded lse).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting, num_sms
from .js_terms import _js_finish_kernel, _js_terms, _splits, _sum_blocks
from .row_cols import grad_cols_, policy_terms
from .row_math import (
    _check_out,
    _clip_c,
    _f32,
    _merge_parts,
    _norm,
    _policy_terms,
    _row_offset,
    _row_scan,
    _span_scan,
    _target_x,
    _warps,
    _write_grad,
    cap_args,
    row_block,
)

__all__ = ["TritonRowKernel", "row_block"]


@triton.jit
def _stats_rows_kernel(
    z_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,  # (2, rows) out with WITH_NORM: raw row max M, log s (NaN: undefined row)
    V,
    norm_stride,  # elements from norm's M plane to its log s plane
    stride_z,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    m, s, t, bad = _row_scan(row_ptr, V, inv_t, WITH_ENT, BLOCK)
    _store_stats(
        row_ptr,
        r,
        labels_ptr,
        logp_ptr,
        ent_ptr,
        lse_ptr,
        norm_ptr,
        V,
        norm_stride,
        m,
        s,
        t,
        bad,
        inv_t,
        ignore_index,
        WITH_ENT,
        WITH_NORM,
    )


@triton.jit
def _store_stats(
    row_ptr,
    r,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,
    V,
    norm_stride,
    m,
    s,
    t,
    bad,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
):
    """Row r's outputs from its (M, s, t, bad): log p (the label's x less log s), lse,
    entropy, and with WITH_NORM the (M, log s) pair; NaN for an undefined row, 0 for an
    ignored one (the header's rules)."""
    ok = (bad == 0) & (m > float("-inf"))
    y = tl.load(labels_ptr + r)
    valid = y != ignore_index
    use = valid & (y >= 0) & (y < V)
    log_s = tl.log(s)
    xy = _target_x(row_ptr, y, use, m, inv_t)
    logp = tl.where(use & ok, xy - log_s, float("nan"))
    tl.store(logp_ptr + r, tl.where(valid, logp, 0.0))
    tl.store(lse_ptr + r, tl.where(ok, m * inv_t + log_s, float("nan")))
    if WITH_NORM:
        tl.store(norm_ptr + r, m)
        tl.store(norm_ptr + norm_stride + r, tl.where(ok, log_s, float("nan")))
    if WITH_ENT:
        ent = tl.where(ok, log_s - t / s, float("nan"))
        tl.store(ent_ptr + r, tl.where(valid, ent, 0.0))


@triton.jit
def _stats_split_kernel(
    z_ptr,
    part_ptr,  # (4, S, rows) fp32: each split's raw max m, s, t and bad (1.0: a NaN / +inf)
    V,
    rows,
    plane,  # S x rows: elements from one part plane to the next
    cols_per_split,
    stride_z,
    inv_t,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The split-row statistics, first pass: one program per (row, vocabulary split), the
    one-program-per-row scan (``_span_scan``) over the split's columns only, so that a
    chunk of a few hundred rows still fills the GPU (S programs per row)."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    lo = sp * cols_per_split
    hi = tl.minimum(lo + cols_per_split, V)
    m, s, t, bad = _span_scan(row_ptr, lo, hi, inv_t, WITH_ENT, BLOCK)
    at = _row_offset(sp, rows) + r
    tl.store(part_ptr + at, m)
    tl.store(part_ptr + plane + at, s)
    tl.store(part_ptr + 2 * plane + at, t)
    tl.store(part_ptr + 3 * plane + at, bad.to(tl.float32))


@triton.jit
def _stats_merge_kernel(
    z_ptr,
    part_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,
    V,
    rows,
    splits,
    plane,
    norm_stride,
    stride_z,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The split-row statistics, second pass: one program per row merges its S splits'
    (m, s, t) like the lanes of one program (``_merge_parts``) and stores the outputs of
    ``_stats_rows_kernel`` (``_store_stats``)."""
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK_S)
    live = i < splits
    at = i.to(tl.int64) * rows + r
    m = tl.load(part_ptr + at, mask=live, other=float("-inf"))
    s = tl.load(part_ptr + plane + at, mask=live, other=0.0)
    t = tl.load(part_ptr + 2 * plane + at, mask=live, other=0.0)
    bad = tl.max(tl.load(part_ptr + 3 * plane + at, mask=live, other=0.0), axis=0)
    mx, s_all, t_all = _merge_parts(m, s, t, inv_t, WITH_ENT)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    _store_stats(
        row_ptr,
        r,
        labels_ptr,
        logp_ptr,
        ent_ptr,
        lse_ptr,
        norm_ptr,
        V,
        norm_stride,
        mx,
        s_all,
        t_all,
        bad,
        inv_t,
        ignore_index,
        WITH_ENT,
        WITH_NORM,
    )


@triton.jit
def _grad_rows_kernel(
    z_ptr,
    out_ptr,
    labels_ptr,
    ent_ptr,
    g_logp_ptr,
    g_ent_ptr,
    V,
    stride_z,
    stride_out,
    inv_t,
    ignore_index,
    scale,
    inv_cap,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOPE: tl.constexpr,
):
    r = tl.program_id(0)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    m, s, _, bad = _row_scan(row_ptr, V, inv_t, False, BLOCK)
    ok = ((bad == 0) & (m > float("-inf"))).to(tl.int32)
    y = tl.load(labels_ptr + r)
    use = (y != ignore_index) & (y >= 0) & (y < V)
    g = tl.load(g_logp_ptr + r).to(tl.float32)
    e = 0.0
    ent = 0.0
    if HAS_ENT:
        e = tl.load(g_ent_ptr + r).to(tl.float32)
        ent = tl.load(ent_ptr + r).to(tl.float32)
    _write_grad(
        row_ptr,
        out_ptr + _row_offset(r, stride_out),
        V,
        y,
        g,
        e,
        ent,
        m,
        tl.log(s),
        use,
        ok,
        inv_t,
        scale,
        inv_cap,
        HAS_ENT=HAS_ENT,
        BLOCK=BLOCK,
        SLOPE=SLOPE,
    )


@triton.jit
def _policy_rows_kernel(
    z_ptr,
    out_ptr,
    labels_ptr,
    old_ptr,
    adv_ptr,
    tw_ptr,
    ref_ptr,
    loss_ptr,
    logp_ptr,
    clipped_ptr,
    V,
    stride_z,
    stride_out,
    inv_t,
    clip_low,
    clip_high,
    clip_c,
    beta,
    ignore_index,
    scale,
    inv_cap,
    HAS_REF: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL_IW: tl.constexpr,
    NEED_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOPE: tl.constexpr,
):
    r = tl.program_id(0)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    m, s, _, bad = _row_scan(row_ptr, V, inv_t, False, BLOCK)
    ok = ((bad == 0) & (m > float("-inf"))).to(tl.int32)
    y = tl.load(labels_ptr + r)
    valid = y != ignore_index
    use = valid & (y >= 0) & (y < V)
    log_s = tl.log(s)
    xy = _target_x(row_ptr, y, use, m, inv_t)
    logp = tl.where(use & (ok != 0), xy - log_s, float("nan"))
    logp = tl.where(valid, logp, 0.0)
    ref = 0.0
    if HAS_REF:
        ref = tl.load(ref_ptr + r).to(tl.float32)
    loss, clipped, g = _policy_terms(
        logp,
        valid,
        use,
        tl.load(old_ptr + r).to(tl.float32),
        tl.load(adv_ptr + r).to(tl.float32),
        tl.load(tw_ptr + r).to(tl.float32),
        ref,
        clip_low,
        clip_high,
        clip_c,
        beta,
        HAS_REF=HAS_REF,
        DUAL_CLIP=DUAL_CLIP,
        KL_IW=KL_IW,
    )
    tl.store(loss_ptr + r, loss)
    tl.store(logp_ptr + r, logp)
    tl.store(clipped_ptr + r, clipped)
    if NEED_GRAD:
        _write_grad(
            row_ptr,
            out_ptr + _row_offset(r, stride_out),
            V,
            y,
            g,
            0.0,
            0.0,
            m,
            log_s,
            use,
            ok,
            inv_t,
            scale,
            inv_cap,
            HAS_ENT=False,
            BLOCK=BLOCK,
            SLOPE=SLOPE,
        )


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


class TritonRowKernel:
    """The row-kernel contract (``RowKernel`` in backends/contract.py, matched by structure:
    this layer imports nothing from the backends) in Triton row kernels, with every
    optional ability: grad_ and policy_ take ``out=`` (rows of the driver's separate 16-bit
    gradient buffer), js_many, the low-memory column kernels grad_cols_ and policy_terms
    (bound below), and ``norm=`` (each row's raw max and log s) in stats and grad_cols_."""

    GRAD_OUT = True
    JS_MANY = True
    GRAD_COLS = True
    NORM = True

    @staticmethod
    def stats(z, labels, inv_t, ignore_index, with_ent, norm=None):
        """(logp, entropy|None, lse); with ``norm`` ((2, rows) fp32, e.g. the slice [:, a:b]
        of a (2, N) buffer) also each row's raw max M and log s (NaN for an undefined row)
        there, for ``grad_cols_``."""
        check_device("z", z)
        rows, v = z.shape
        f32 = dict(dtype=torch.float32, device=z.device)
        logp, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
        ent = torch.empty(rows if with_ent else 0, **f32)
        if rows:
            block = row_block(v)
            _stats_rows_kernel[(rows,)](
                z,
                labels.contiguous(),
                logp,
                ent if with_ent else lse,
                lse,
                lse if norm is None else _norm(norm, rows),
                V=v,
                norm_stride=0 if norm is None else norm.stride(0),
                stride_z=z.stride(0),
                inv_t=float(inv_t),
                ignore_index=int(ignore_index),
                WITH_ENT=bool(with_ent),
                WITH_NORM=norm is not None,
                BLOCK=block,
                num_warps=_warps(block),
            )
        return logp, (ent if with_ent else None), lse

    @staticmethod
    def stats_split(z, labels, inv_t, ignore_index, with_ent, norm=None, splits=None):
        """``stats`` by split rows (issue 35, item 4; not yet the driver's: the GPU window
        measures it against ``stats``): each row's vocabulary in S contiguous splits, one
        program per (row, split), then one merging program per row, for the chunk's few
        hundred rows that leave one program per row latency-bound on 132 SMs. ``splits``:
        S (default: enough programs for 8 per SM, at most one split per column step)."""
        check_device("z", z)
        rows, v = z.shape
        f32 = dict(dtype=torch.float32, device=z.device)
        logp, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
        ent = torch.empty(rows if with_ent else 0, **f32)
        if rows == 0:
            return logp, (ent if with_ent else None), lse
        block = row_block(v)
        if splits is None:
            splits = max(1, min(triton.cdiv(8 * num_sms(z.device), rows), triton.cdiv(v, block)))
        per = triton.cdiv(triton.cdiv(v, int(splits)), block) * block  # whole column steps
        splits = triton.cdiv(v, per)  # every split non-empty
        part = torch.empty((4, splits, rows), **f32)
        _stats_split_kernel[(rows, splits)](
            z,
            part,
            V=v,
            rows=rows,
            plane=splits * rows,
            cols_per_split=per,
            stride_z=z.stride(0),
            inv_t=float(inv_t),
            WITH_ENT=bool(with_ent),
            BLOCK=block,
            num_warps=_warps(block),
        )
        _stats_merge_kernel[(rows,)](
            z,
            part,
            labels.contiguous(),
            logp,
            ent if with_ent else lse,
            lse,
            lse if norm is None else _norm(norm, rows),
            V=v,
            rows=rows,
            splits=splits,
            plane=splits * rows,
            norm_stride=0 if norm is None else norm.stride(0),
            stride_z=z.stride(0),
            inv_t=float(inv_t),
            ignore_index=int(ignore_index),
            WITH_ENT=bool(with_ent),
            WITH_NORM=norm is not None,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            num_warps=1,
        )
        return logp, (ent if with_ent else None), lse

    @staticmethod
    def grad_(
        z,
        labels,
        lse,
        ent,
        g_logp,
        g_ent,
        inv_t,
        ignore_index,
        out=None,
        logit_scale=1.0,
        softcap=0.0,
    ):
        """dL/dz over z in place, or into ``out`` (same rows). The row's max and sum are
        recomputed from z (lse is not read: it is rounded at large |z / tau|). With a logit
        transform (logit_scale, softcap; z the transformed logits), dL/dr."""
        check_device("z", z)
        rows, v = z.shape
        if rows == 0:
            return
        out = _check_out(z, out)
        has_ent = ent is not None and g_ent is not None
        g = _f32(g_logp)
        block = row_block(v)
        _grad_rows_kernel[(rows,)](
            z,
            out,
            labels.contiguous(),
            _f32(ent) if has_ent else g,
            g,
            _f32(g_ent) if has_ent else g,
            V=v,
            stride_z=z.stride(0),
            stride_out=out.stride(0),
            inv_t=float(inv_t),
            ignore_index=int(ignore_index),
            HAS_ENT=has_ent,
            BLOCK=block,
            num_warps=_warps(block),
            **cap_args(logit_scale, softcap),
        )

    @staticmethod
    def policy_(z, labels, old_logp, advantages, token_weight, ref_logp, cfg, need_grad, out=None):
        """(per-token loss, logp, clipped) of rows z; with need_grad, dL/dz for the token
        weights over z or into ``out``; ``cfg`` the op's scalar settings
        (``PolicyLossSettings``)."""
        check_device("z", z)
        rows, v = z.shape
        f32 = dict(dtype=torch.float32, device=z.device)
        loss, logp, clipped = (torch.empty(rows, **f32) for _ in range(3))
        if rows == 0:
            return loss, logp, clipped
        out = _check_out(z, out)
        has_ref = ref_logp is not None and cfg.beta != 0.0
        old = _f32(old_logp)
        block = row_block(v)
        _policy_rows_kernel[(rows,)](
            z,
            out,
            labels.contiguous(),
            old,
            _f32(advantages),
            _f32(token_weight),
            _f32(ref_logp) if has_ref else old,
            loss,
            logp,
            clipped,
            V=v,
            stride_z=z.stride(0),
            stride_out=out.stride(0),
            inv_t=1.0 / float(cfg.temperature),
            clip_low=float(cfg.clip_low),
            clip_high=float(cfg.clip_high),
            clip_c=_clip_c(cfg.clip_ratio_c),
            beta=float(cfg.beta),
            ignore_index=int(cfg.ignore_index),
            HAS_REF=has_ref,
            DUAL_CLIP=math.isfinite(cfg.clip_ratio_c),
            KL_IW=bool(cfg.kl_importance_weight),
            NEED_GRAD=bool(need_grad),
            BLOCK=block,
            num_warps=_warps(block),
            **cap_args(cfg.logit_scale, cfg.softcap),
        )
        return loss, logp, clipped

    @staticmethod
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

    @classmethod
    def js(cls, zp, zq, inv_t, lse_p):
        """One Q stream at a time (the per-stream form of the contract; lse_p unused)."""
        return cls.js_many(torch.stack((zp, zq)), inv_t)[0], lse_p


TritonRowKernel.grad_cols_ = staticmethod(grad_cols_)
TritonRowKernel.policy_terms = staticmethod(policy_terms)
