"""What the Triton row kernels (row_stats.py, row_grads.py, row_js.py; rows.py binds them)
and the low-memory column kernels (row_cols.py) share: the device functions of one row (its
int64 offset, the online max / sum scan, the target's logit, the gradient write, the policy
loss's per-token terms) and the launchers' helpers (block size, warps, dtype and buffer
checks). The math is rows.py's header.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import settings
from ._common import interpreting


@triton.jit
def _row_offset(row, stride):
    """Element offset of a row: int64, so rows x stride may pass 2^31."""
    return row.to(tl.int64) * stride


@triton.jit
def _row_scan(row_ptr, V, inv_t, WITH_T: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over a row: (M raw max, s, t, bad) with s = sum exp(x), t = sum e^x x
    relative to M, bad = the row holds a NaN or +inf (``_span_scan`` over [0, V))."""
    return _span_scan(row_ptr, 0, V, inv_t, WITH_T, BLOCK)


@triton.jit
def _span_scan(row_ptr, lo, hi, inv_t, WITH_T: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the columns [lo, hi) of a row: (M raw max, s, t, bad) with
    s = sum exp(x), t = sum e^x x relative to M, bad = a NaN or +inf among them (M = -inf,
    s = t = 0 where every column is -inf or the span is empty).

    Each of the BLOCK lanes keeps its own running max m_l, s_l and t_l over the columns it
    reads (one exp per element: exp(-|d|), d the element's x against the lane max, serves
    as the new term when d <= 0 and as the rescale of the old sums when d > 0), so the loop
    has no cross-lane reduction; the lanes are merged once at the end:
    s = sum_l s_l exp(sh_l), t = sum_l exp(sh_l) (t_l + s_l sh_l), sh_l = (m_l - M) / tau."""
    two_inv_t = 2.0 * inv_t
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for v0 in range(lo, hi, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        nonfinite = (z != z) | (z == float("inf"))
        bad = bad | nonfinite.to(tl.int32)
        zc = tl.where(nonfinite, float("-inf"), z)  # the max and sums of the finite part
        live = zc > float("-inf")
        up = zc > m  # a new lane max (never for -inf)
        d = (zc * 0.5 - m * 0.5) * two_inv_t  # +inf while the lane is empty
        e = tl.exp(-tl.abs(d))
        if WITH_T:
            # up: the old sums rescaled, e (t - s d), 0 where they vanish (an empty lane, or
            # e underflowing to 0 with d = +inf: never 0 * inf); else the new term e d
            # (e = exp(d) <= 1), nothing where e is 0 (d may be -inf)
            t_up = tl.where((s > 0.0) & (e > 0.0), e * (t - s * d), 0.0)
            t = tl.where(up, t_up, tl.where(live & (e > 0.0), t + e * d, t))
        s = tl.where(up, s * e + 1.0, tl.where(live, s + e, s))
        m = tl.where(up, zc, m)
    mx, s_all, t_all = _merge_parts(m, s, t, inv_t, WITH_T)
    return mx, s_all, t_all, tl.max(bad, axis=0)


@triton.jit
def _merge_parts(m, s, t, inv_t, WITH_T: tl.constexpr):
    """(M, s, t) of a row from the (m_i, s_i, t_i) of its parts (the lanes of one program,
    or the splits of ``_stats_split_kernel``), each relative to its own max m_i:
    M = max m_i, s = sum_i s_i exp(sh_i), t = sum_i exp(sh_i) (t_i + s_i sh_i) with
    sh_i = (m_i - M) / tau; an empty part (m_i = -inf, s_i = 0) adds nothing."""
    mx = tl.max(m, axis=0)
    base = tl.where(mx == float("-inf"), 0.0, mx)
    sh = (m * 0.5 - base * 0.5) * (2.0 * inv_t)  # -inf for an empty part
    a = tl.exp(sh)
    s_all = tl.sum(s * a, axis=0)
    t_all = tl.sum(tl.zeros_like(s), axis=0)
    if WITH_T:
        t_all = tl.sum(tl.where(a > 0.0, a * (t + s * sh), 0.0), axis=0)
    return mx, s_all, t_all


@triton.jit
def _target_x(row_ptr, y, use, m, inv_t):
    """x of the label's column (0 where the label is not used)."""
    zy = tl.load(row_ptr + tl.where(use, y, 0).to(tl.int64)).to(tl.float32)
    return tl.where(use, (zy * 0.5 - m * 0.5) * (2.0 * inv_t), 0.0)


@triton.jit
def _write_grad(
    row_ptr,
    out_ptr,
    V,
    y,
    g,
    e,
    ent,
    m,
    log_s,
    use,
    ok,
    inv_t,
    scale,
    inv_cap,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOPE: tl.constexpr = False,
):
    """Second pass: dz over the row into out (same row, any float dtype). SLOPE: the row
    holds transformed logits z = softcap tanh(scale r / softcap) (``LogitCap``), and the
    gradient written is dL/dr = dL/dz ``_cap_slope(z)``."""
    two_inv_t = 2.0 * inv_t
    g_use = tl.where(use, g, 0.0)
    e_use = tl.where(use, e, 0.0)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        cmask = cols < V
        z = tl.load(row_ptr + cols, mask=cmask, other=float("-inf")).to(tl.float32)
        lp = (z * 0.5 - m * 0.5) * two_inv_t - log_s
        p = tl.exp(lp)
        grad = tl.where(cols == y, g_use, 0.0) - p * g_use
        if HAS_ENT:
            grad -= e_use * tl.where(p > 0.0, p * (lp + ent), 0.0)
        grad = tl.where(use, grad * inv_t, 0.0)
        if SLOPE:
            grad = grad * _cap_slope(z, scale, inv_cap)
        grad = tl.where(use & (ok == 0), float("nan"), grad)
        tl.store(out_ptr + cols, grad.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _cap_slope(z, scale, inv_cap):
    """dz/dr of the logit transform at the transformed logit z: scale (1 - z/s)(1 + z/s),
    which is scale without a cap (inv_cap = 0)."""
    t = z * inv_cap
    return scale * ((1.0 - t) * (1.0 + t))


def cap_args(logit_scale: float, softcap: float) -> dict:
    """The slope's kernel arguments: scale, 1 / softcap (0: no cap) and SLOPE, False for the
    identity (the kernels compiled without it, as before the transform existed)."""
    active = logit_scale != 1.0 or softcap != 0.0
    inv_cap = 1.0 / softcap if softcap else 0.0
    return {"scale": float(logit_scale), "inv_cap": float(inv_cap), "SLOPE": bool(active)}


@triton.jit
def _policy_terms(
    logp,
    valid,
    use,
    old,
    adv,
    tw,
    ref,
    clip_low,
    clip_high,
    clip_c,
    beta,
    HAS_REF: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL_IW: tl.constexpr,
):
    """(per-token loss L, clipped flag, g = w dL/dlogp) of one token; NaN in, NaN out.
    DUAL_CLIP caps the surrogate at -A clip_c for A < 0 (gradient 0 where it binds); KL_IW
    multiplies the k3 term by the ratio (its derivative is then ratio (logp - ref))."""
    ratio = tl.exp(logp - old)
    lo = 1.0 - clip_low
    hi = 1.0 + clip_high
    r_c = tl.where(ratio < lo, lo, tl.where(ratio > hi, hi, ratio))  # NaN stays NaN
    a = ratio * adv
    b = r_c * adv
    # the reference's rule: clipped iff a > b, strictly (a tie or a NaN is not clipped);
    # L = -min(a, b) with NaN in, NaN out; dL/dlogp = -A ratio unless clipped (autograd of
    # torch.minimum and clamp: a tie passes the whole gradient, a NaN passes it as NaN)
    is_clipped = a > b
    loss = -tl.where(is_clipped, b, a)
    dlogp = tl.where(is_clipped, 0.0, -adv * ratio)
    if DUAL_CLIP:
        cap = -adv * clip_c
        dual = (adv < 0.0) & (loss > cap)
        loss = tl.where(dual, cap, loss)
        dlogp = tl.where(dual, 0.0, dlogp)
    if HAS_REF:
        diff = ref - logp
        # k3 = exp(d) - d - 1 without its cancellation: sum_{n >= 2} d^n / n! through
        # 1/16! for |d| < 1/2, else the plain form (reference.kl_k3_ref)
        small = tl.abs(diff) < 0.5
        ds = tl.where(small, diff, 0.0)
        poly = ds * 4.779477332387385e-14 + 7.647163731819816e-13
        poly = poly * ds + 1.1470745597729725e-11
        poly = poly * ds + 1.6059043836821613e-10
        poly = poly * ds + 2.08767569878681e-09
        poly = poly * ds + 2.505210838544172e-08
        poly = poly * ds + 2.755731922398589e-07
        poly = poly * ds + 2.7557319223985893e-06
        poly = poly * ds + 2.48015873015873e-05
        poly = poly * ds + 0.0001984126984126984
        poly = poly * ds + 0.001388888888888889
        poly = poly * ds + 0.008333333333333333
        poly = poly * ds + 0.041666666666666664
        poly = poly * ds + 0.16666666666666666
        poly = poly * ds + 0.5
        k3 = tl.where(small, ds * ds * poly, tl.exp(diff) - diff - 1.0)
        if KL_IW:
            loss += beta * ratio * k3
            dlogp -= beta * ratio * diff
        else:
            loss += beta * k3
            dlogp -= beta * (diff + k3)  # 1 - exp(d) = -(d + k3), no cancellation
    loss = tl.where(valid, loss, 0.0)
    clipped = tl.where(valid & is_clipped, 1.0, 0.0)
    g = tl.where(use, dlogp * tw, 0.0)
    return loss, clipped, g


# --------------------------------------------------------------------------- launchers


def row_block(v: int) -> int:
    """Columns per step of a row program: 2048 on a GPU; under the interpreter at most 1024
    (so rows of a few thousand columns still take several steps in the tests). The
    MRTPO_ROW_BLOCK override, where set, wins."""
    override = settings.row_block()
    if override is not None:
        return override[0]
    if interpreting():
        return min(1024, triton.next_power_of_2(max(v, 16)))
    return 2048


def _warps(block: int) -> int:
    override = settings.row_block()
    if override is not None:
        return override[1]
    return 8 if block >= 2048 else 4


def _clip_c(clip_ratio_c: float) -> float:
    return float(clip_ratio_c) if math.isfinite(clip_ratio_c) else 0.0


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _check_out(z: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """z itself (in place) or an ``out`` with z's rows that shares none of z's bytes."""
    if out is None or out is z:
        return z
    if out.shape != z.shape:
        raise ValueError(f"out: expected shape {tuple(z.shape)}, got {tuple(out.shape)}")
    zs, os_ = z.untyped_storage(), out.untyped_storage()
    lo = max(zs.data_ptr(), os_.data_ptr())
    hi = min(zs.data_ptr() + zs.nbytes(), os_.data_ptr() + os_.nbytes())
    if lo < hi:  # the two storages overlap
        raise ValueError(
            "out: must not share memory with z (the kernel reads a row of z after writing "
            "part of out; pass a separate buffer, or none to write in place)"
        )
    return out


def _norm(norm: torch.Tensor, rows: int) -> torch.Tensor:
    """A (2, rows) fp32 norm buffer (raw row max, log s) with unit row stride, checked: a
    column slice norm[:, a:b] of a (2, N) buffer is one (the planes' stride is passed)."""
    if norm.shape != (2, rows) or norm.dtype != torch.float32 or norm.stride(1) != 1:
        raise ValueError(
            f"norm: expected a (2, {rows}) float32 tensor with unit stride along the rows, "
            f"got shape {tuple(norm.shape)}, {norm.dtype}, strides {norm.stride()}"
        )
    return norm
