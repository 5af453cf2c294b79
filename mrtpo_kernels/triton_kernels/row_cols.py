"""Low-memory mode of the Triton row kernels: the column-sliced gradient (``grad_cols_``)
and the per-token policy terms (``policy_terms``) for a row split over vocabulary chunks,
bound as methods of ``TritonRowKernel`` (rows.py). The math is rows.py's header.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting
from .row_math import (
    _cap_slope,
    _clip_c,
    _f32,
    _norm,
    _policy_terms,
    _row_offset,
    _warps,
    cap_args,
    row_block,
)

# --------------------------------------------------------------------------- low-memory mode
# The column kernel cannot recompute a row's max and sum (the row is split over vocabulary
# chunks). Given only the fp32 lse it forms z / tau - lse, ulp(lse) / 2 off in every log p
# (5e-4 at |z / tau| ~ 1e4) and NaN past |z / tau| = float max; given the (raw max, log s)
# that stats(..., norm=) writes (8 bytes a row), it has the row kernels' accuracy. The chunk
# driver's low-memory mode (backends/_chunk_backward.py) passes the norm where it has one.


@triton.jit
def _grad_cols_kernel(
    z_ptr,
    out_ptr,
    labels_ptr,
    lse_ptr,
    norm_ptr,
    ent_ptr,
    g_logp_ptr,
    g_ent_ptr,
    W,
    v_lo,
    V,
    norm_stride,
    stride_z,
    stride_out,
    inv_t,
    ignore_index,
    scale,
    inv_cap,
    HAS_NORM: tl.constexpr,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOPE: tl.constexpr,
):
    """dz on the columns [v_lo, v_lo + W) of a row (the row is split over vocabulary chunks,
    so its max and sum cannot be recomputed here): log p = (z/2 - M/2)(2/tau) - log s from
    the raw max and log s that stats saved (HAS_NORM), else z / tau - lse from the rounded
    lse (ulp(lse) / 2 off in every log p, and NaN past |z / tau| = float max)."""
    r = tl.program_id(0)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    o_ptr = out_ptr + _row_offset(r, stride_out)
    y = tl.load(labels_ptr + r)
    use = (y != ignore_index) & (y >= 0) & (y < V)
    shift = 0.0
    off = tl.load(lse_ptr + r)
    if HAS_NORM:
        shift = tl.load(norm_ptr + r)
        off = tl.load(norm_ptr + norm_stride + r)
    two_inv_t = 2.0 * inv_t
    g = tl.where(use, tl.load(g_logp_ptr + r).to(tl.float32), 0.0)
    e = 0.0
    ent = 0.0
    if HAS_ENT:
        e = tl.where(use, tl.load(g_ent_ptr + r).to(tl.float32), 0.0)
        ent = tl.load(ent_ptr + r)
    for c0 in range(0, W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cmask = cols < W
        z = tl.load(row_ptr + cols, mask=cmask, other=float("-inf"))
        lp = (z * 0.5 - shift * 0.5) * two_inv_t - off
        p = tl.exp(lp)
        grad = tl.where(cols + v_lo == y, g, 0.0) - p * g
        if HAS_ENT:
            grad -= e * tl.where(p > 0.0, p * (lp + ent), 0.0)
        grad = tl.where(use, grad * inv_t, 0.0)
        if SLOPE:  # z the transformed logits: dL/dr = dL/dz dz/dr (row_math._write_grad)
            grad = grad * _cap_slope(z, scale, inv_cap)
        tl.store(o_ptr + cols, grad.to(o_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _policy_terms_kernel(
    logp_ptr,
    labels_ptr,
    old_ptr,
    adv_ptr,
    tw_ptr,
    ref_ptr,
    loss_ptr,
    clipped_ptr,
    g_ptr,
    N,
    V,
    clip_low,
    clip_high,
    clip_c,
    beta,
    ignore_index,
    HAS_REF: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL_IW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    y = tl.load(labels_ptr + i, mask=mask, other=ignore_index)
    valid = y != ignore_index
    use = valid & (y >= 0) & (y < V)
    ref = 0.0
    if HAS_REF:
        ref = tl.load(ref_ptr + i, mask=mask, other=0.0)
    loss, clipped, g = _policy_terms(
        tl.load(logp_ptr + i, mask=mask, other=0.0),
        valid,
        use,
        tl.load(old_ptr + i, mask=mask, other=0.0),
        tl.load(adv_ptr + i, mask=mask, other=0.0),
        tl.load(tw_ptr + i, mask=mask, other=0.0),
        ref,
        clip_low,
        clip_high,
        clip_c,
        beta,
        HAS_REF=HAS_REF,
        DUAL_CLIP=DUAL_CLIP,
        KL_IW=KL_IW,
    )
    tl.store(loss_ptr + i, loss, mask=mask)
    tl.store(clipped_ptr + i, clipped, mask=mask)
    tl.store(g_ptr + i, g, mask=mask)


def grad_cols_(
    z,
    labels,
    lse,
    ent,
    g_logp,
    g_ent,
    inv_t,
    ignore_index,
    v_lo,
    vocab,
    out=None,
    norm=None,
    logit_scale=1.0,
    softcap=0.0,
):
    """dL/dz of vocabulary columns [v_lo, v_lo + z.shape[1]) of every row, from the saved lse
    (and entropy), in place or into ``out``. With ``norm``, the (2, rows) raw max and log s
    that ``stats(..., norm=)`` wrote for these rows, log p is formed from them instead of
    the rounded lse (the row kernels' accuracy at any |z / tau|)."""
    check_device("z", z)
    rows, width = z.shape
    if rows == 0:
        return
    out = z if out is None else out
    has_ent = ent is not None and g_ent is not None
    g = _f32(g_logp)
    block = row_block(width)
    _grad_cols_kernel[(rows,)](
        z,
        out,
        labels.contiguous(),
        _f32(lse),
        g if norm is None else _norm(norm, rows),
        _f32(ent) if has_ent else g,
        g,
        _f32(g_ent) if has_ent else g,
        W=width,
        v_lo=int(v_lo),
        V=int(vocab),
        norm_stride=0 if norm is None else norm.stride(0),
        stride_z=z.stride(0),
        stride_out=out.stride(0),
        inv_t=float(inv_t),
        ignore_index=int(ignore_index),
        HAS_NORM=norm is not None,
        HAS_ENT=has_ent,
        BLOCK=block,
        num_warps=_warps(block),
        **cap_args(logit_scale, softcap),
    )


def policy_terms(logp, labels, old_logp, advantages, token_weight, ref_logp, vocab, cfg):
    """(per-token loss, clipped, g = w dL/dlogp) from the log-probs: the token terms of
    ``policy_`` for the low-memory mode, where the gradient comes later; ``cfg`` the op's
    scalar settings (``PolicyLossSettings``)."""
    check_device("logp", logp)
    n = logp.shape[0]
    f32 = dict(dtype=torch.float32, device=logp.device)
    loss, clipped, g = (torch.empty(n, **f32) for _ in range(3))
    if n == 0:
        return loss, clipped, g
    has_ref = ref_logp is not None and cfg.beta != 0.0
    old = _f32(old_logp)
    block = 256 if interpreting() else 1024
    _policy_terms_kernel[(triton.cdiv(n, block),)](
        _f32(logp),
        labels.contiguous(),
        old,
        _f32(advantages),
        _f32(token_weight),
        _f32(ref_logp) if has_ref else old,
        loss,
        clipped,
        g,
        N=n,
        V=int(vocab),
        clip_low=float(cfg.clip_low),
        clip_high=float(cfg.clip_high),
        clip_c=_clip_c(cfg.clip_ratio_c),
        beta=float(cfg.beta),
        ignore_index=int(cfg.ignore_index),
        HAS_REF=has_ref,
        DUAL_CLIP=math.isfinite(cfg.clip_ratio_c),
        KL_IW=bool(cfg.kl_importance_weight),
        BLOCK=block,
    )
    return loss, clipped, g
