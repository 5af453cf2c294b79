"""Vocabulary-parallel LM heads: the linear ops with ``process_group=``.

The head is sharded over the vocabulary in equal parts, as Megatron and verl's tensor
parallelism shard it (the vocabulary padded to a multiple of the group size): rank r of the
group holds rows [r V_loc, (r + 1) V_loc) of the weight and of the bias, and every rank has
the same hidden states and the same global label ids. Each rank runs the ordinary
single-device kernels on its shard and the per-token partial results are combined with
all-reduces of (N,) tensors (no [N, V] tensor is communicated, no host synchronization):

    forward   lse_r, H_r, logp_r from the shard's kernel (the label mapped to a local id);
              M = max_r lse_r (all-reduce MAX); one all-reduce SUM of the stacked
              e_r = exp(lse_r - M), the label's logit x_y = logp_r + lse_r from the owning
              rank (0 elsewhere) and e_r (H_r - (lse_r - M)); then
              lse = M + log sum e_r, logp = x_y - lse,
              H = sum_r w_r (H_r - (lse_r - lse)) = sum_r e_r (H_r - (lse_r - M)) / s + log s
              with w_r = exp(lse_r - lse) the shard's probability mass and s = sum_r e_r.
    backward  the global dL/dz_v = g ([v == y] - p_v) - g_H p_v (log p_v + H) on the shard,
              with p_v = w_r p_r,v: the shard's kernel run with g' = g w_r, g_H' = g_H w_r
              and its entropy input set to H + lse_r - lse, plus g (owned - w_r) at the
              mapped label's column (a rank that does not own the label maps it to column
              0); dW and db stay local, dh is all-reduced (SUM).

JS distance (no gradient): per chunk of tokens the shard's logits of both streams, global
row maxima and sums by all-reduce, the shard's part of the divergence summed by a third.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _ops
from .backends import _chunked
from .backends.torch_backend import js_terms, policy_token_terms
from .types import acc_dtype


def shard_info(weight: torch.Tensor, process_group) -> tuple[int, int, int]:
    """(v0, V_loc, V): the first global row of this rank's shard, its size, the vocabulary."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "process_group: torch.distributed is not initialized (init_process_group first)"
        )
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("process_group: this process is not a member of the group")
    v_loc = weight.shape[0]
    return rank * v_loc, v_loc, world * v_loc


def local_labels(lab: torch.Tensor, v0: int, v_loc: int, ignore_index: int):
    """(mapped, owned): the label as a local id where this shard owns it, column 0 for other
    valid tokens (so the shard's kernel still computes their statistics), ignore_index kept."""
    valid = lab != ignore_index
    loc = lab - v0
    owned = valid & (loc >= 0) & (loc < v_loc)
    mapped = torch.where(owned, loc, torch.where(valid, torch.zeros_like(lab), lab))
    return mapped, owned, valid


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


def _combine(logp_r, ent_r, lse_r, owned, valid, with_ent, group):
    """Global (logp, entropy|None, lse, w_r) from the shard's per-token statistics."""
    zero = torch.zeros_like(lse_r)
    lse_r = torch.where(valid, lse_r, zero)
    m = _all_reduce(lse_r.clone(), dist.ReduceOp.MAX, group)
    e = torch.exp(lse_r - m)
    parts = [e, torch.where(owned, logp_r + lse_r, zero)]
    if with_ent:
        parts.append(torch.where(valid, e * (ent_r - (lse_r - m)), zero))
    red = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group)
    s = red[0]
    lse = m + torch.log(s)
    logp = torch.where(valid, red[1] - lse, zero)
    ent = torch.where(valid, red[2] / s + torch.log(s), zero) if with_ent else None
    return logp, ent, lse, e / s


def _grad(ctx_tensors, cfg, g_logp, g_ent):
    """(dh, dW_loc, db_loc) of sum_t g_logp_t logp_t + g_ent_t H_t for this shard."""
    h, w, b, mapped, owned, valid, lse, lse_r, w_r, ent = ctx_tensors
    temperature, ignore_index, backend, group = cfg
    acc = lse.dtype
    zero = torch.zeros_like(lse)
    g = torch.where(valid, g_logp.to(acc), zero)
    has_ent = g_ent is not None and ent is not None
    if has_ent:
        ge = torch.where(valid, g_ent.to(acc), zero)
        ent_in = (ent + lse_r - lse).contiguous()
        ge_in = (ge * w_r).contiguous()
    else:
        ent_in = ge_in = lse.new_empty(0)
    dh, dw, db = _ops.linear_logprobs_bwd(
        h, w, b, mapped, lse_r.contiguous(), ent_in, (g * w_r).contiguous(), ge_in,
        temperature, ignore_index, backend,
    )  # fmt: skip
    # the label's column: g [v == y] where the kernel put g w_r [v == mapped]
    c = torch.where(valid, (owned.to(acc) - w_r) * g / temperature, zero)
    col = torch.where(valid, mapped, torch.zeros_like(mapped))
    w32 = w.to(acc)
    dh = dh.to(acc) + c[:, None] * w32[col]
    dw = dw.index_add(0, col, c[:, None] * h.to(acc))
    if b is not None:
        db = db.index_add(0, col, c)
    dh = _all_reduce(dh, dist.ReduceOp.SUM, group)
    return dh, dw, db


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, lab, temperature, ignore_index, with_ent, backend, group):
        v0, v_loc, _ = shard_info(w, group)
        mapped, owned, valid = local_labels(lab, v0, v_loc, ignore_index)
        logp_r, ent_r, lse_r = _ops.linear_logprobs_fwd(
            h, w, b, mapped.contiguous(), temperature, ignore_index, with_ent, backend
        )
        logp, ent, lse, w_r = _combine(logp_r, ent_r, lse_r, owned, valid, with_ent, group)
        ctx.save_for_backward(h, w, b, mapped, owned, valid, lse, lse_r, w_r, ent)
        ctx.cfg = (temperature, ignore_index, backend, group)
        ctx.has_bias = b is not None
        ctx.set_materialize_grads(False)
        return logp, (ent if with_ent else lse.new_empty(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        saved = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(saved[6])
        dh, dw, db = _grad(saved, ctx.cfg, g_logp, g_ent)
        h, w, b = saved[:3]
        dh = dh.to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = dw.to(w.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(b.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None, None, None, None, None


def linear_logprobs(h, w, b, lab, temperature, ignore_index, with_ent, backend, group):
    """(logp (N,), entropy (N,) or (0,)) over the sharded head; differentiable."""
    return _LinearLogprobs.apply(h, w, b, lab, temperature, ignore_index, with_ent, backend, group)


class _LinearPolicyLoss(torch.autograd.Function):
    """The policy loss over the sharded head: logp from the combined statistics, the
    per-token terms and dL/dlogp of every backend's row kernel (policy_token_terms), and the
    gradient of sum_t c_t dL_t/dlogp_t logp_t through the sharded log-prob backward."""

    @staticmethod
    def forward(ctx, h, w, b, lab, old, adv, coef, ref, cfg, group):
        temperature, cl, ch, cc, beta, kl_iw, ignore_index, backend = cfg
        v0, v_loc, _ = shard_info(w, group)
        mapped, owned, valid = local_labels(lab, v0, v_loc, ignore_index)
        logp_r, _, lse_r = _ops.linear_logprobs_fwd(
            h, w, b, mapped.contiguous(), temperature, ignore_index, False, backend
        )
        logp, _, lse, w_r = _combine(logp_r, None, lse_r, owned, valid, False, group)
        per_tok, dlogp, clipped = policy_token_terms(
            logp, old, adv, ref if ref.numel() else None, cl, ch, cc, beta, kl_iw
        )
        zero = torch.zeros_like(logp)
        loss = torch.where(valid, per_tok * coef, zero).sum()
        clipped = torch.where(valid & clipped, 1.0, 0.0).to(logp.dtype)
        g = torch.where(valid, dlogp * coef, zero)
        ctx.save_for_backward(h, w, b, mapped, owned, valid, lse, lse_r, w_r, g)
        ctx.cfg = (temperature, ignore_index, backend, group)
        ctx.has_bias = b is not None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(logp, clipped)
        return loss, logp, clipped

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_clipped):
        none = (None,) * 7
        if g_loss is None:
            return (None, None, None) + none
        h, w, b, mapped, owned, valid, lse, lse_r, w_r, g = ctx.saved_tensors
        saved = (h, w, b, mapped, owned, valid, lse, lse_r, w_r, None)
        dh, dw, db = _grad(saved, ctx.cfg, g * g_loss.to(g.dtype), None)
        dh = dh.to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = dw.to(w.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(b.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dh, dw, db) + none


def linear_policy_loss(h, w, b, lab, old, adv, coef, ref, cfg, group):
    """(loss, logp, clipped) over the sharded head; the loss is differentiable.
    cfg = (temperature, clip_low, clip_high, clip_ratio_c (inf: none), beta, kl_iw,
    ignore_index, backend)."""
    return _LinearPolicyLoss.apply(h, w, b, lab, old, adv, coef, ref, cfg, group)


@torch.no_grad()
def linear_js(hp, hq, w, b, temperature, group):
    """(K, N) JS distances between the sharded head's distributions at hp (N, d) and each
    of hq (K, N, d)."""
    acc = acc_dtype(hp)
    k, n = hq.shape[0], hp.shape[0]
    inv_t = 1.0 / temperature
    w32 = w if w.dtype == acc else w.to(acc)
    b32 = None if b is None else b.to(acc)
    out = hp.new_empty((k, n), dtype=acc)
    rows = _chunked.chunk_rows(w.shape[0], streams=2)

    def log_probs(hh):
        z = hh.to(acc) @ w32.t()
        if b32 is not None:
            z = z + b32
        z = z * inv_t
        m = _all_reduce(z.amax(-1), dist.ReduceOp.MAX, group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        x = z - m[:, None]
        s = _all_reduce(torch.exp(x).sum(-1), dist.ReduceOp.SUM, group)
        return x - torch.log(s)[:, None]

    for s in range(0, n, rows):
        e = min(n, s + rows)
        a = log_probs(hp[s:e])
        for j in range(k):
            part = _all_reduce(js_terms(a, log_probs(hq[j, s:e])), dist.ReduceOp.SUM, group)
            out[j, s:e] = torch.sqrt(part.clamp(min=0.0) / math.log(2.0)).clamp(max=1.0)
    return out
