"""Triton row kernels, gradients: dL/dlogits of the log-probs (``grad_``) and the policy
loss's token terms with their gradient in the same pass (``policy_``), over each row of
fp32 logits z [C, V] in place or into ``out`` (rows of the driver's separate 16-bit
gradient buffer). rows.py's header has the math and the rule on ``out``;
``TritonRowKernel`` binds both as its methods.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_device
from .row_math import (
    _check_out,
    _clip_c,
    _f32,
    _policy_terms,
    _row_offset,
    _row_scan,
    _target_x,
    _warps,
    _write_grad,
    cap_args,
    row_block,
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
