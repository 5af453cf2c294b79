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

The plain call's numerics (README "Numerics") hold here too. The combine above needs each
shard's lse_r finite; one flag (all-reduced, read on the host: one synchronization per
forward) says whether it is for every valid token on every rank. Where it is not (a
log-normalizer past the float range at a small temperature, a NaN or +inf logit, a shard
whose logits are all -inf) the forward recomputes the shard's logits (one more GEMM) and
combines in the kernels' raw-max form: the global raw max M, x = (z/2 - M/2) (2/tau), so
the log-probs are the plain call's (0 / -inf past the range, not NaN); a NaN or +inf on any
shard, or every entry -inf, gives NaN (log-prob, entropy, gradient); a shard all -inf has
no mass and no gradient.

JS distance (no gradient): per chunk of tokens the shard's logits of both streams, global
raw row maxima and sums by all-reduce (x in the raw-max form), the shard's part of the
divergence summed by a third; a row with a NaN or +inf on any shard, or all -inf, gives
NaN, never 0.

The head's logit transform (``logit_scale``, ``softcap``: z = softcap tanh(scale r /
softcap) of the raw logits r, _types.LogitCap) acts on each vocabulary entry alone, so each
shard applies it to its own entries and everything above holds with z for r: the shard's
kernels take it as the plain call's do (their lse_r, entropies and gradients are of z, the
last chained through dz/dr), the raw-max form and the JS logits transform the recomputed
r, and the label's column term is multiplied by the slope dz/dr at the label.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._token_terms import js_terms, policy_token_terms, scaled_diff
from ._types import LogitCap, acc_dtype
from .backends import _chunk_sizes
from .backends._lm_head import NO_CAP, apply_logit_cap_

# The shard's kernels: the log-probs custom ops, registered beside linear_logprobs
# (logprobs.py, which imports this module for its process_group path: reached through the
# op registry, so the import graph stays one-way). Resolved at call time: by then the
# package, and so logprobs.py, is imported.


def _shard_logprobs_fwd(*args):
    return torch.ops.mrtpo.linear_logprobs_fwd.default(*args)


def _shard_logprobs_bwd(*args):
    return torch.ops.mrtpo.linear_logprobs_bwd.default(*args)


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
    """Global (logp, entropy|None, w_r, shift) from the shard's per-token statistics, all of
    them finite (see _forward); w_r = exp(lse_r - lse), the shard's probability mass, and
    shift = lse_r - lse = log w_r."""
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
    return logp, ent, e / s, torch.where(valid, lse_r - lse, zero)


def _half_diff(a: torch.Tensor, m: torch.Tensor, inv_t: float) -> torch.Tensor:
    """(a - m) / tau elementwise as (a/2 - m/2) (2/tau), the plain kernels' form."""
    return (a * 0.5 - m * 0.5) * (2.0 * inv_t)


def _shard_raw_stats(h, w, b, mapped, valid, inv_t, with_ent, cap):
    """This shard's per-row statistics in the plain kernels' raw-max form, from its logits
    recomputed in chunks (one more GEMM, then the logit transform ``cap``): the raw max m_r
    (-inf where the row is not finite-valued), log s_r = log sum exp((z - m_r) / tau), the
    raw logit z at the mapped label, the shard's entropy H_r and whether the row holds a
    NaN or a +inf."""
    acc = acc_dtype(h)
    n = h.shape[0]
    w32 = w.to(acc)
    b32 = None if b is None else b.to(acc)
    col = torch.where(valid, mapped, torch.zeros_like(mapped))
    m_r, log_s, z_lab = (h.new_empty(n, dtype=acc) for _ in range(3))
    ent = h.new_zeros(n, dtype=acc)
    bad = torch.zeros(n, dtype=torch.bool, device=h.device)
    rows = _chunk_sizes.chunk_rows(w.shape[0], streams=4)  # z, x, p, p log p: 4 [C, V_loc] at most
    for a in range(0, n, rows):
        e = min(n, a + rows)
        z = h[a:e].to(acc) @ w32.t()
        if b32 is not None:
            z = z + b32
        apply_logit_cap_(z, cap)
        mx = z.amax(-1)  # NaN propagates; +inf where a +inf is
        fin = torch.isfinite(mx)
        bad[a:e] = torch.isnan(mx) | (mx == math.inf)
        x = scaled_diff(z, torch.where(fin, mx, torch.zeros_like(mx)), inv_t)
        ls = torch.logsumexp(x, -1)
        m_r[a:e] = torch.where(fin, mx, torch.full_like(mx, -math.inf))
        log_s[a:e] = ls
        z_lab[a:e] = z.gather(-1, col[a:e, None])[:, 0]
        if with_ent:
            lp = x - ls[:, None]
            p = torch.exp(lp)
            ent[a:e] = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
    return m_r, log_s, z_lab, ent, bad


def _combine_raw(stats, owned, valid, inv_t, with_ent, group):
    """_combine from _shard_raw_stats, in the plain kernels' raw-max form: the global raw
    max M, x = (z - M) / tau as one rounded difference times the scale, so the result is
    the plain call's wherever that one is defined (log-normalizers beyond the float range
    included); a NaN or +inf on any shard, or every entry -inf on every shard, gives NaN
    (log-prob, entropy and gradient), as in the plain call; a shard whose entries are all
    -inf has no mass."""
    m_r, log_s, z_lab, ent_r, bad_r = stats
    acc = m_r.dtype
    zero = torch.zeros_like(m_r)
    ninf = torch.full_like(m_r, -math.inf)
    nan = torch.full_like(m_r, math.nan)
    mx = torch.stack([torch.where(valid, m_r, ninf), bad_r.to(acc)])
    mx = _all_reduce(mx, dist.ReduceOp.MAX, group)
    big_m, bad = mx[0], mx[1] > 0
    ok = valid & ~bad & torch.isfinite(big_m)
    ms = torch.where(ok, big_m, zero)
    has = ok & torch.isfinite(m_r)
    lr = torch.where(has, _half_diff(torch.where(has, m_r, zero), ms, inv_t) + log_s, ninf)
    e = torch.exp(lr)  # the shard's sum of exp((z - M) / tau)
    parts = [e, torch.where(owned & ok, z_lab, zero)]
    if with_ent:
        parts.append(torch.where(e > 0, e * (ent_r - lr), zero))
    red = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group)
    s = torch.where(ok, red[0], torch.ones_like(red[0]))
    log_s_all = torch.log(s)
    logp = torch.where(ok, _half_diff(red[1], ms, inv_t) - log_s_all, nan)
    logp = torch.where(valid, logp, zero)
    ent = None
    if with_ent:
        ent = torch.where(ok, red[2] / s + log_s_all, nan)
        ent = torch.where(valid, ent, zero)
    w_r = torch.where(ok, e / s, torch.where(valid, nan, zero))
    shift = torch.where(e > 0, lr - log_s_all, zero)
    shift = torch.where(ok | ~valid, shift, nan)
    return logp, ent, w_r, shift


def _forward(h, w, b, lab, temperature, ignore_index, with_ent, backend, group, cap):
    """The shard's kernel, then the global statistics: (logp, ent|None, saved) with saved
    the tensors _grad needs. The kernel's lse_r feeds the combine where it is finite on
    every rank for every valid token (one flag, all-reduced and read on the host); else
    (a log-normalizer past the float range at a small temperature, a NaN or +inf logit,
    a shard whose logits are all -inf) the statistics are recomputed in the raw-max form
    (_combine_raw), so the result follows the plain call's rules."""
    v0, v_loc, _ = shard_info(w, group)
    mapped, owned, valid = local_labels(lab, v0, v_loc, ignore_index)
    mapped = mapped.contiguous()
    logp_r, ent_r, lse_r, _ = _shard_logprobs_fwd(
        h, w, b, mapped, temperature, ignore_index, with_ent, backend, cap.scale, cap.softcap
    )
    odd = (valid & ~torch.isfinite(lse_r)).any().to(lse_r.dtype).reshape(1)
    if not torch.compiler.is_compiling() and bool(_all_reduce(odd, dist.ReduceOp.MAX, group)):
        stats = _shard_raw_stats(h, w, b, mapped, valid, 1.0 / temperature, with_ent, cap)
        logp, ent, w_r, shift = _combine_raw(
            stats, owned, valid, 1.0 / temperature, with_ent, group
        )
    else:
        logp, ent, w_r, shift = _combine(logp_r, ent_r, lse_r, owned, valid, with_ent, group)
    return logp, ent, (h, w, b, mapped, owned, valid, lse_r, w_r, shift)


def _slope_at(h, w_rows, b_rows, cap: LogitCap) -> torch.Tensor:
    """dz/dr of the logit transform at each token's column: r = h . w_row (+ b_row), then
    scale (1 - (z / softcap)^2) with z = softcap tanh(scale r / softcap) (scale alone
    without a cap), as the row kernels' slope."""
    if not cap.softcap:
        return torch.full(h.shape[:1], cap.scale, dtype=h.dtype, device=h.device)
    r = (h * w_rows).sum(-1)
    if b_rows is not None:
        r = r + b_rows
    t = torch.tanh(r * (cap.scale / cap.softcap))
    return cap.scale * (1.0 - t * t)


def _grad(ctx_tensors, ent, cfg, g_logp, g_ent):
    """(dh, dW_loc, db_loc) of sum_t g_logp_t logp_t + g_ent_t H_t for this shard."""
    h, w, b, mapped, owned, valid, lse_r, w_r, shift = ctx_tensors
    temperature, ignore_index, backend, group, cap = cfg
    acc = lse_r.dtype
    zero = torch.zeros_like(lse_r)
    g = torch.where(valid, g_logp.to(acc), zero)
    has_ent = g_ent is not None and ent is not None
    if has_ent:
        ge = torch.where(valid, g_ent.to(acc), zero)
        ent_in = (ent + shift).contiguous()  # H + lse_r - lse
        ge_in = (ge * w_r).contiguous()
    else:
        ent_in = ge_in = lse_r.new_empty(0)
    # a shard without mass for a token (w_r = 0: e.g. all its logits -inf) contributes no
    # gradient there beyond the label's column below: its kernel rows are skipped (the
    # kernel would call an all -inf row undefined); NaN (an undefined token) still runs
    lab_k = torch.where(w_r == 0, torch.full_like(mapped, ignore_index), mapped).contiguous()
    dh, dw, db = _shard_logprobs_bwd(
        h,
        w,
        b,
        lab_k,
        lse_r.contiguous(),
        ent_in,
        (g * w_r).contiguous(),
        ge_in,
        temperature,
        ignore_index,
        cap.scale,
        cap.softcap,
        backend,
        False,  # ent_in is not the shard's own entropy: its rows of dL/dz need not sum to 0
        None,
    )
    # the label's column: g [v == y] where the kernel put g w_r [v == mapped], with respect
    # to the transformed logit z; times dz/dr there for the raw logit r the GEMMs see
    c = torch.where(valid, (owned.to(acc) - w_r) * g / temperature, zero)
    col = torch.where(valid, mapped, torch.zeros_like(mapped))
    w32 = w.to(acc)
    if cap.active:
        c = c * _slope_at(h.to(acc), w32[col], None if b is None else b.to(acc)[col], cap)
    dh = dh.to(acc) + c[:, None] * w32[col]
    dw = dw.index_add(0, col, c[:, None] * h.to(acc))
    if b is not None:
        db = db.index_add(0, col, c)
    dh = _all_reduce(dh, dist.ReduceOp.SUM, group)
    return dh, dw, db


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, lab, temperature, ignore_index, with_ent, backend, group, cap):
        logp, ent, saved = _forward(
            h, w, b, lab, temperature, ignore_index, with_ent, backend, group, cap
        )
        ctx.save_for_backward(*saved, ent)
        ctx.cfg = (temperature, ignore_index, backend, group, cap)
        ctx.has_bias = b is not None
        ctx.set_materialize_grads(False)
        return logp, (ent if with_ent else logp.new_empty(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        *saved, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(saved[6])
        dh, dw, db = _grad(saved, ent, ctx.cfg, g_logp, g_ent)
        h, w, b = saved[:3]
        dh = dh.to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = dw.to(w.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(b.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None, None, None, None, None, None


def linear_logprobs(
    h, w, b, lab, temperature, ignore_index, with_ent, backend, group, cap: LogitCap = NO_CAP
):
    """(logp (N,), entropy (N,) or (0,)) over the sharded head, whose logits are transformed
    by ``cap`` (the identity by default); differentiable."""
    return _LinearLogprobs.apply(
        h, w, b, lab, temperature, ignore_index, with_ent, backend, group, cap
    )


class _LinearPolicyLoss(torch.autograd.Function):
    """The policy loss over the sharded head: logp from the combined statistics, the
    per-token terms and dL/dlogp of every backend's row kernel (policy_token_terms), and the
    gradient of sum_t c_t dL_t/dlogp_t logp_t through the sharded log-prob backward."""

    @staticmethod
    def forward(
        ctx, h, w, b, lab, old_logp, advantages, token_weight, ref_logp, cfg, backend, group
    ):
        temperature, ignore_index, cap = cfg.temperature, cfg.ignore_index, cfg.logit_cap
        logp, _, saved = _forward(
            h, w, b, lab, temperature, ignore_index, False, backend, group, cap
        )
        valid = saved[5]
        per_tok, dlogp, clipped = policy_token_terms(
            logp, old_logp, advantages, ref_logp if ref_logp.numel() else None, cfg
        )
        zero = torch.zeros_like(logp)
        loss = torch.where(valid, per_tok * token_weight, zero).sum()
        clipped = torch.where(valid & clipped, 1.0, 0.0).to(logp.dtype)
        g = torch.where(valid, dlogp * token_weight, zero)
        ctx.save_for_backward(*saved, g)
        ctx.cfg = (temperature, ignore_index, backend, group, cap)
        ctx.has_bias = b is not None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(logp, clipped)
        return loss, logp, clipped

    @staticmethod
    def backward(ctx, g_loss, _g_logp, _g_clipped):
        none = (None,) * 8
        if g_loss is None:
            return (None, None, None) + none
        *saved, g = ctx.saved_tensors
        h, w, b = saved[:3]
        dh, dw, db = _grad(saved, None, ctx.cfg, g * g_loss.to(g.dtype), None)
        dh = dh.to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = dw.to(w.dtype) if ctx.needs_input_grad[1] else None
        db = db.to(b.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dh, dw, db) + none


def linear_policy_loss(
    h, w, b, lab, old_logp, advantages, token_weight, ref_logp, cfg, backend, group
):
    """(loss, logp, clipped) over the sharded head; the loss is differentiable. cfg: the
    call's validated ``PolicyLossSettings`` (its logit transform included); backend: the
    log-prob kernels' backend."""
    return _LinearPolicyLoss.apply(
        h, w, b, lab, old_logp, advantages, token_weight, ref_logp, cfg, backend, group
    )


@torch.no_grad()
def linear_js_distance(hp, hq, w, b, temperature, group, cap: LogitCap = NO_CAP):
    """(K, N) JS distances between the sharded head's distributions at hp (N, d) and each
    of hq (K, N, d), the logits transformed by ``cap`` (the identity by default)."""
    acc = acc_dtype(hp)
    k, n = hq.shape[0], hp.shape[0]
    inv_t = 1.0 / temperature
    w32 = w if w.dtype == acc else w.to(acc)
    b32 = None if b is None else b.to(acc)
    out = hp.new_empty((k, n), dtype=acc)
    rows = _chunk_sizes.chunk_rows(w.shape[0], streams=2)

    def log_probs(hh):
        """(log p of the shard's entries, whether the row is defined): the global raw max M,
        x = (z - M) / tau in the plain kernels' form (no z / tau that could overflow); a
        NaN or +inf on any shard, or every entry -inf, leaves the row undefined (JS NaN)."""
        z = hh.to(acc) @ w32.t()
        if b32 is not None:
            z = z + b32
        apply_logit_cap_(z, cap)
        mx = z.amax(-1)  # NaN propagates
        fin = torch.isfinite(mx)
        bad = (torch.isnan(mx) | (mx == math.inf)).to(acc)
        red = torch.stack([torch.where(fin, mx, torch.full_like(mx, -math.inf)), bad])
        red = _all_reduce(red, dist.ReduceOp.MAX, group)
        ok = (red[1] == 0) & torch.isfinite(red[0])
        x = scaled_diff(z, torch.where(ok, red[0], torch.zeros_like(mx)), inv_t)
        s = _all_reduce(torch.exp(x).sum(-1), dist.ReduceOp.SUM, group)
        return x - torch.log(s)[:, None], ok

    for s in range(0, n, rows):
        e = min(n, s + rows)
        a, ok_p = log_probs(hp[s:e])
        for j in range(k):
            bq, ok_q = log_probs(hq[j, s:e])
            part = _all_reduce(js_terms(a, bq), dist.ReduceOp.SUM, group)
            d = torch.sqrt(part.clamp(min=0.0) / math.log(2.0)).clamp(max=1.0)
            out[j, s:e] = torch.where(ok_p & ok_q, d, torch.full_like(d, math.nan))
    return out
