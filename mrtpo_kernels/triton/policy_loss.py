"""Triton kernels: the clipped-surrogate policy loss fused with the LM head, its gradient
computed in the forward pass (METHOD.md section 6).

Math (per token t; logp_t from ``logprobs.lse_stats``, 0 on ignored tokens):
    ratio = exp(logp - old),   r_c = clamp(ratio, 1 - clip_low, 1 + clip_high)
    L_t   = -min(ratio A, r_c A) + beta (exp(ref - logp) - (ref - logp) - 1)   (KL k3)
    loss  = sum_t w_t L_t                      (w = token_weight: the aggregation rule)
    g_t   = dloss/dlogp_t = w_t (-A ratio [ratio A <= r_c A] + beta (1 - exp(ref - logp)))
    clipped_t = [ratio A > r_c A]; L, g, clipped are 0 on ignored tokens.
The gradients of hidden, weight and bias are those of sum_t g_t logp_t, i.e. the log-prob
backward with upstream g and no entropy term: dlogits = g ([v == y] - p) / tau.

Shapes: hidden (N, d), weight (V, d) fp32/bf16/fp16 (fp64 goes to the "torch" backend);
bias (V,); labels (N,) int64; old_logp, advantages, token_weight (N,) fp32; ref_logp (N,) or
(0,) fp32. Returns loss () fp32, logp (N,) fp32, clipped (N,) fp32 and, with need_grad,
grad_hidden (N, d) in hidden's dtype, grad_weight (V, d) fp32, grad_bias (V,) fp32 or (0,).
Nothing is saved for a backward: the autograd op only scales these by the upstream scalar.

GEMM count (each 2 N d V FLOPs = 2.0e13 at N = 16384, d = 4096, V = 151936) and the pick:
  (a) keep a token chunk of fp32 logits between its two uses: 3 GEMMs (logits, dh, dW).
      The softmax needs the whole row's lse before any dlogits, so a chunk of C tokens
      keeps C x V fp32 logits; the 1 GB extra-memory target caps C near 1024 at V = 151936,
      and dW (fp32, V d 4 = 2.5 GB) is then read and written once per token chunk:
      16 x 5 GB = 80 GB, plus ~16 V bytes per token of logits / dlogits traffic (40 GB):
      ~120 GB, ~25 ms of HBM at 4.8 TB/s.
  (b) recompute: 4 GEMMs (forward lse; then per vocabulary chunk: logits again -> dlogits,
      dW[chunk] = G^T h finished in one pass, dh += G W[chunk]); HBM beyond the GEMMs'
      operands ~15 GB (G in hidden's dtype, the fp32 dh accumulator), ~3 ms.
  At d = 4096 one GEMM is ~29 ms at 700 TFLOP/s: (a) ~ 3 x 29 + 25 = 112 ms, (b) ~ 4 x 29 +
  3 = 119 ms, within the error of this estimate; at d = 896 a GEMM is ~6 ms and (a)'s
  traffic (dW 16 x 1.1 GB + 40 GB) ~12 ms, so (b) wins there. This file implements (b): it
  shares the log-prob backward (``logprobs.linear_grad``), needs the least memory, and
  never re-reads dW. Measuring (a) on an H200 is left open (see the note in the report).

Kernels: ``lse_stats`` (forward log-sum-exp, 1 GEMM), ``_policy_token_kernel`` (per-token
surrogate, KL, clip flag and g; O(N)), ``linear_grad`` (3 GEMMs). Bytes and FLOPs: the
sum of the log-prob forward and backward costs in ``logprobs.py``: 4 x 2 N d V FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_device, interpreting
from .logprobs import linear_grad, lse_stats

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
    HAS_REF: tl.constexpr,
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
    ratio = tl.exp(logp - old)
    r_c = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    unclipped_obj = ratio * adv
    clipped_obj = r_c * adv
    unclipped = unclipped_obj <= clipped_obj
    loss = -tl.minimum(unclipped_obj, clipped_obj)
    dlogp = tl.where(unclipped, -adv * ratio, 0.0)
    if HAS_REF:
        diff = tl.load(ref_ptr + rows, mask=mask, other=0.0) - logp
        e_diff = tl.exp(diff)
        loss += beta * (e_diff - diff - 1.0)
        dlogp += beta * (1.0 - e_diff)
    tl.store(wloss_ptr + rows, tl.where(valid, loss * w, 0.0), mask=mask)
    tl.store(clipped_ptr + rows, tl.where(valid & (~unclipped), 1.0, 0.0), mask=mask)
    tl.store(g_ptr + rows, tl.where(valid, dlogp * w, 0.0), mask=mask)


def linear_policy_loss(
    hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp, temperature,
    clip_low, clip_high, beta, ignore_index, need_grad,
):  # fmt: skip
    if hidden.dtype == torch.float64:  # no fp64 dots in Triton: the torch backend, in fp64
        from ..backends import torch_backend

        return torch_backend.linear_policy_loss(
            hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp,
            temperature, clip_low, clip_high, beta, ignore_index, need_grad,
        )  # fmt: skip
    check_device("hidden", hidden)
    n = hidden.shape[0]
    dev = hidden.device
    logp, _, lse = lse_stats(
        hidden, weight, bias, labels, weight.shape[0], temperature, ignore_index, False,
        from_logits=False,
    )  # fmt: skip
    has_ref = ref_logp.numel() > 0 and beta != 0.0
    f32 = dict(dtype=torch.float32, device=dev)
    wloss = torch.empty(n, **f32)
    clipped = torch.empty(n, **f32)
    g = torch.empty(n, **f32)
    block = 256 if interpreting() else 1024
    _policy_token_kernel[(cdiv(n, block),)](
        logp, labels, old_logp, advantages, token_weight, ref_logp if has_ref else logp,
        wloss, clipped, g, n, float(clip_low), float(clip_high), float(beta),
        int(ignore_index), HAS_REF=has_ref, BLOCK=block,
    )  # fmt: skip
    loss = wloss.sum()
    if not need_grad:
        empty = hidden.new_empty(0)
        return loss, logp, clipped, empty, hidden.new_empty(0, **f32), hidden.new_empty(0, **f32)
    dh, dw, db = linear_grad(
        hidden, weight, bias, labels, lse, None, g, None, temperature, ignore_index
    )
    return loss, logp, clipped, dh, dw, db
