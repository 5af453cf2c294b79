"""Triton kernels: the clipped-surrogate policy loss fused with the LM head, its gradient
computed in the forward pass (METHOD.md section 6).

Math (per token t; logp_t from ``logprobs.lse_stats``, 0 on ignored tokens):
    ratio = exp(logp - old),   r_c = clamp(ratio, 1 - clip_low, 1 + clip_high)
    L_t   = -min(ratio A, r_c A) + beta (exp(ref - logp) - (ref - logp) - 1)   (KL k3)
Options: the dual clip caps L_t's surrogate at -A clip_ratio_c for A < 0 (gradient 0 where
it binds; clip_ratio_c = inf: none); KL_IW multiplies the k3 term by ratio (its gradient
is then ratio (logp - ref)).
    loss  = sum_t w_t L_t                      (w = token_weight: the aggregation rule)
    g_t   = dloss/dlogp_t = w_t (-A ratio [not clipped_t] + beta (1 - exp(ref - logp)))
    clipped_t = [ratio A > r_c A], strictly: a tie or a NaN is not clipped (the reference's
    rule; its autograd passes the whole gradient at a tie, and NaN through a NaN);
    L, g, clipped are 0 on ignored tokens.
The gradients of hidden, weight and bias are those of sum_t g_t logp_t, i.e. the log-prob
backward with upstream g and no entropy term: dlogits = g ([v == y] - p) / tau.

Shapes: hidden (N, d), weight (V, d) fp32/bf16/fp16 (the dispatcher sends fp64 to "torch");
bias (V,); labels (N,) int64; old_logp, advantages, token_weight (N,) fp32; ref_logp (N,) or
(0,) fp32. Returns loss () fp32, logp (N,) fp32, clipped (N,) fp32 and, with need_grad,
grad_hidden (N, d) in hidden's dtype, grad_weight (V, d) fp32, grad_bias (V,) fp32 or (0,).
Nothing is saved for a backward: the autograd op only scales these by the upstream scalar.

Design: two variants, because counting does not separate them at d = 4096 (the counting:
docs/kernels.md). (b), the default, recomputes: 4 GEMMs (forward lse; then per vocabulary
chunk logits again -> dlogits, dW[chunk] = G^T h in one pass, dh += G W[chunk]); it shares
the log-prob backward ``logprobs.linear_grad``, needs the least memory and never re-reads
dW. (a), with MRTPO_POLICY_KEEP_LOGITS=1, keeps a token chunk of fp32 logits (its size
from MRTPO_CHUNK_BYTES) between their two uses: 3 GEMMs, dW read and written once per
token chunk.

Both variants form every log p in the backward from the forward's raw row max and log s
(``lse_stats``' norm: (z/2 - M/2)(2/tau) - log s), not from the rounded fp32 lse.

Kernels: (b) ``lse_stats`` (forward log-sum-exp, 1 GEMM), ``_policy_token_kernel``
(per-token surrogate, KL, clip flag and g; O(N)), ``linear_grad`` (3 GEMMs): 4 x 2 N d V
FLOPs, the bytes of the log-prob forward plus backward in ``logprobs.py``. (a) per token
chunk: ``lse_stats`` with STORE_LOGITS (1 GEMM, writes 4 C V bytes), the token kernel,
``dlogits`` in place over the kept logits (reads and writes 4 C V bytes), dh = G W and
dW += G^T h (2 GEMMs, dW read and written in fp32 once per chunk): 3 x 2 N d V FLOPs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import settings
from ._common import cdiv, check_device, chunk_bytes, interpreting
from .logprobs import dlogits, linear_grad, lse_stats, matmul, tiles
from .row_math import _policy_terms

__all__ = ["linear_policy_loss"]


@triton.jit(do_not_specialize=["N"])
def _policy_token_kernel(
    logp_ptr,
    labels_ptr,
    old_ptr,
    adv_ptr,
    tw_ptr,
    ref_ptr,
    wloss_ptr,  # out: w_t L_t
    clipped_ptr,  # out
    g_ptr,  # out: dloss/dlogp_t
    N,
    clip_low,
    clip_high,
    beta,
    ignore_index,
    clip_c,
    HAS_REF: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL_IW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = rows < N
    y = tl.load(labels_ptr + rows, mask=mask, other=ignore_index)
    valid = (y != ignore_index) & mask
    logp = tl.load(logp_ptr + rows, mask=mask, other=0.0)
    old = tl.load(old_ptr + rows, mask=mask, other=0.0)
    adv = tl.load(adv_ptr + rows, mask=mask, other=0.0)
    w = tl.load(tw_ptr + rows, mask=mask, other=0.0)
    ref = logp
    if HAS_REF:
        ref = tl.load(ref_ptr + rows, mask=mask, other=0.0)
    # the same per-token terms as the rows variant (clip rule, dual clip, k3 KL)
    loss, clipped, g = _policy_terms(
        logp, valid, valid, old, adv, w, ref, clip_low, clip_high, clip_c, beta,
        HAS_REF=HAS_REF, DUAL_CLIP=DUAL_CLIP, KL_IW=KL_IW,
    )  # fmt: skip
    tl.store(wloss_ptr + rows, tl.where(valid, loss * w, 0.0), mask=mask)
    tl.store(clipped_ptr + rows, clipped, mask=mask)
    tl.store(g_ptr + rows, g, mask=mask)


def _token_terms(
    logp, labels, old, adv, tw, ref, wloss, clipped, g, cl, ch, beta, ii, cc=math.inf, kl_iw=False
):
    """Launch _policy_token_kernel on (n,) views; ref None means no KL term."""
    n = logp.shape[0]
    block = 256 if interpreting() else 1024
    dual = math.isfinite(cc)
    _policy_token_kernel[(cdiv(n, block),)](
        logp, labels, old, adv, tw, logp if ref is None else ref, wloss, clipped, g, n,
        float(cl), float(ch), float(beta), int(ii), float(cc) if dual else 0.0,
        HAS_REF=ref is not None, DUAL_CLIP=dual, KL_IW=bool(kl_iw), BLOCK=block,
    )  # fmt: skip


def keep_logits() -> bool:
    """Variant (a) of the header (3 GEMMs, token chunks of kept fp32 logits) when
    MRTPO_POLICY_KEEP_LOGITS=1; (b) (4 GEMMs) otherwise."""
    return settings.policy_keep_logits()


def _policy_keep_logits(
    hidden, weight, bias, labels, old, adv, tw, ref, temp, cl, ch, beta, ii, cc, kl_iw
):
    """Variant (a): per token chunk, one GEMM writes the raw fp32 logits while the online
    lse runs, the token terms give g, dlogits overwrite the kept logits in place, then
    dh[chunk] = G W (written once) and dW += G^T h[chunk] (fp32 read-modify-write)."""
    n, d = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    bn = tiles(hidden.dtype)["BLOCK_N"]
    rows = min(n, max(bn, chunk_bytes() // (4 * v) // bn * bn))
    z_buf = torch.empty((rows, v), **f32)
    logp, wloss, clipped, g = (torch.empty(n, **f32) for _ in range(4))
    dh = torch.empty_like(hidden)
    dw = torch.empty((v, d), **f32)
    db = torch.zeros(v if bias is not None else 0, **f32)
    for i, s in enumerate(range(0, n, rows)):
        e = min(n, s + rows)
        z = z_buf[: e - s]
        lab = labels[s:e]
        lp, _, lse, norm = lse_stats(
            hidden[s:e], weight, bias, lab, v, temp, ii, False, from_logits=False, store=z
        )
        logp[s:e] = lp
        _token_terms(
            lp, lab, old[s:e], adv[s:e], tw[s:e], None if ref is None else ref[s:e],
            wloss[s:e], clipped[s:e], g[s:e], cl, ch, beta, ii, cc, kl_iw,
        )  # fmt: skip
        dlogits(
            z, None, None, lab, lse, None, g[s:e], None, z, db if bias is not None else None,
            0, v, temp, ii, norm,
        )  # fmt: skip
        matmul(z, weight, dh[s:e], accumulate=False)
        matmul(z.t(), hidden[s:e], dw, accumulate=i > 0)
    return wloss.sum(), logp, clipped, dh, dw, db


def linear_policy_loss(
    hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp, temperature,
    clip_low, clip_high, beta, ignore_index, need_grad, clip_ratio_c=math.inf, kl_iw=False,
):  # fmt: skip
    check_device("hidden", hidden)
    ref = ref_logp if ref_logp.numel() > 0 and beta != 0.0 else None
    if need_grad and keep_logits():
        return _policy_keep_logits(
            hidden, weight, bias, labels, old_logp, advantages, token_weight, ref,
            temperature, clip_low, clip_high, beta, ignore_index, clip_ratio_c, kl_iw,
        )  # fmt: skip
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, _, lse, norm = lse_stats(
        hidden, weight, bias, labels, weight.shape[0], temperature, ignore_index, False,
        from_logits=False,
    )  # fmt: skip
    wloss, clipped, g = (torch.empty(n, **f32) for _ in range(3))
    _token_terms(
        logp, labels, old_logp, advantages, token_weight, ref, wloss, clipped, g, clip_low,
        clip_high, beta, ignore_index, clip_ratio_c, kl_iw,
    )  # fmt: skip
    loss = wloss.sum()
    if not need_grad:
        empty = hidden.new_empty(0)
        return loss, logp, clipped, empty, hidden.new_empty(0, **f32), hidden.new_empty(0, **f32)
    dh, dw, db = linear_grad(
        hidden, weight, bias, labels, lse, None, g, None, temperature, ignore_index, norm
    )
    return loss, logp, clipped, dh, dw, db
