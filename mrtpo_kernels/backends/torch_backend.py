"""The "torch" backend: the chunked drivers with chunk kernels written in PyTorch ops.

Runs on any device and any float dtype (float64 end to end). Each chunk kernel makes a few
[C, V] temporaries (the C++ kernels of the "cpu" backend make none), so this is the
portable path the dispatcher falls back to, and the home of float64 inputs where the fast
backend has no float64 kernel; it is not the fast path.
"""

from __future__ import annotations

import functools
import math

import torch

from .._token_terms import js_terms, policy_token_terms, scaled_diff
from . import ANY_DEVICE, Serves, _chunked, _saved_state
from .contract import RowKernel

LN2 = math.log(2.0)


def _shift(z, inv_t):
    """x = (z - M) / tau with M the raw row max, log s = logsumexp(x), M, and whether each
    row is defined (no NaN, no +inf, not all -inf; README "Numerics"). x is formed as
    (z/2 - M/2) (2/tau), as in the C++ kernels: one rounded difference (halving is exact)
    times the scale, so the max entry gives exactly 0 and finite logits never overflow
    unless the true x is beyond the float range."""
    m = z.amax(-1)  # propagates NaN
    ok = torch.isfinite(m)
    m_safe = torch.where(ok, m, torch.zeros_like(m))
    x = scaled_diff(z, m_safe, inv_t)
    return x, torch.logsumexp(x, -1), m_safe, ok


def _label_masks(labels, ignore_index, vocab):
    """valid (not ignored), use (valid and in [0, V): the only labels used as an index),
    and a safe index for gather. On CPU a valid label outside [0, V) (value checks off)
    is a ValueError, as on the "cpu" backend; elsewhere (no sync) its log-prob is NaN and
    its gradient 0."""
    valid = labels != ignore_index
    use = valid & (labels >= 0) & (labels < vocab)
    if labels.device.type == "cpu" and not bool(torch.equal(use, valid)):
        bad = valid & ~use
        raise ValueError(
            f"labels: {int(bad.sum())} label(s) outside [0, {vocab}) that are not "
            f"ignore_index={ignore_index} (value checks were off), e.g. "
            f"{int(labels[bad][0])}"
        )
    safe = torch.where(use, labels, torch.zeros_like(labels))
    return valid, use, safe


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _times_slope(grad, z, logit_scale, softcap):
    """dL/dr = dL/dz dz/dr for the logit transform z = softcap tanh(scale r / softcap):
    dz/dr = scale (1 - z/softcap)(1 + z/softcap), scale without a cap (z the transformed
    logits the kernel read); grad itself for the identity."""
    if softcap:
        t = z / softcap
        return grad.mul_((1.0 - t) * (1.0 + t)).mul_(logit_scale)
    return grad.mul_(logit_scale) if logit_scale != 1.0 else grad


class _TorchChunkKernel(RowKernel):
    """The row-kernel contract (contract.RowKernel) in PyTorch ops; no optional ability."""

    @staticmethod
    def stats(z, labels, inv_t, ignore_index, with_ent):
        valid, use, safe = _label_masks(labels, ignore_index, z.shape[-1])
        x, log_s, m, ok = _shift(z, inv_t)
        lse = torch.where(ok, m * inv_t + log_s, _nan_like(log_s))
        tgt = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        logp = torch.where(use & ok, tgt - log_s, _nan_like(log_s))
        logp = torch.where(valid, logp, torch.zeros_like(logp))
        ent = None
        if with_ent:
            logp_all = x - log_s.unsqueeze(-1)
            p = torch.exp(logp_all)
            # p = 0 (a -inf logit) contributes 0, not 0 * inf; NaN rows stay NaN
            ent = -torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
            ent = torch.where(ok, ent, _nan_like(ent))
            ent = torch.where(valid, ent, torch.zeros_like(ent))
        return logp, ent, lse

    @staticmethod
    def grad_(
        z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index, logit_scale=1.0, softcap=0.0
    ):
        # dlogp/dz = onehot - p ; dH/dz = -p (log p + H) ; both times 1/tau for the logits.
        # The row's max and sum are recomputed (the saved lse is rounded at large |z / tau|).
        valid, use, safe = _label_masks(labels, ignore_index, z.shape[-1])
        x, log_s, _, ok = _shift(z, inv_t)
        logp_all = x - log_s.unsqueeze(-1)
        p = torch.exp(logp_all)
        g = torch.where(use, g_logp, torch.zeros_like(g_logp)).unsqueeze(-1)
        grad = -p * g
        if ent is not None and g_ent is not None:
            ge = torch.where(use, g_ent, torch.zeros_like(g_ent)).unsqueeze(-1)
            term = ge * p * (logp_all + ent.unsqueeze(-1))
            grad -= torch.where(p > 0, term, torch.zeros_like(term))
        grad.scatter_add_(-1, safe.unsqueeze(-1), g)
        grad = torch.where(use[:, None], grad, torch.zeros_like(grad))
        grad = torch.where((use & ~ok)[:, None], _nan_like(grad), grad)
        z.copy_(_times_slope(grad.mul_(inv_t), z, logit_scale, softcap))

    @staticmethod
    def js(zp, zq, inv_t, lse_p):
        # Same per-element form as the C++ kernel: p log(p/M) + q log(q/M) = M h(t) with
        # M = (p+q)/2, t = (p-q)/(p+q); series for small |t| (exactly 0 when p == q).
        # lse_p is opaque to the driver: P's (raw max, log s, defined) for the next q.
        if lse_p is None:
            _, lsp, mp, okp = _shift(zp, inv_t)
            lse_p = (mp, lsp, okp)
        mp, lsp, okp = lse_p
        a = scaled_diff(zp, mp, inv_t) - lsp[:, None]
        xq, lsq, _, okq = _shift(zq, inv_t)
        jsd = js_terms(a, xq - lsq[:, None])
        jsd = torch.where(okp & okq, jsd, _nan_like(jsd))  # a NaN / +inf row: NaN, never 0
        return torch.sqrt(jsd.clamp(min=0.0) / LN2).clamp(max=1.0), lse_p

    @staticmethod
    def policy_(z, labels, old_logp, advantages, token_weight, ref_logp, cfg, need_grad):
        inv_t = 1.0 / cfg.temperature
        valid, use, safe = _label_masks(labels, cfg.ignore_index, z.shape[-1])
        x, log_s, _, ok = _shift(z, inv_t)
        logp = x.gather(-1, safe[:, None])[:, 0] - log_s
        logp = torch.where(use & ok, logp, _nan_like(logp))
        logp = torch.where(valid, logp, torch.zeros_like(logp))
        per_tok, dlogp, clipped = policy_token_terms(logp, old_logp, advantages, ref_logp, cfg)
        per_tok = torch.where(valid, per_tok, torch.zeros_like(per_tok))
        clipped = torch.where(valid & clipped, 1.0, 0.0)
        if need_grad:
            g = torch.where(use, dlogp * token_weight, torch.zeros_like(dlogp))
            p = torch.exp(x - log_s[:, None])
            grad = -p * g[:, None]
            grad.scatter_add_(-1, safe[:, None], g[:, None])
            grad = torch.where(use[:, None], grad, torch.zeros_like(grad))
            grad = torch.where((use & ~ok)[:, None], _nan_like(grad), grad)
            cap = cfg.logit_cap
            z.copy_(_times_slope(grad.mul_(inv_t), z, cap.scale, cap.softcap))
        return per_tok, logp, clipped


_K = _TorchChunkKernel()
ROW_KERNEL = _K  # public: mrtpo_kernels.chunk_plan.row_kernel("torch")

SERVES = {op: Serves((ANY_DEVICE,)) for op in _chunked.CHUNK_DRIVEN_OPS} | {
    "mrtpo_token_advantages": Serves((ANY_DEVICE,)),
    # computed by the public function itself in PyTorch ops (a few O(n K) reductions)
    "gdpo_advantages": Serves((ANY_DEVICE,)),
    "specific_relevance": Serves((ANY_DEVICE,)),
}


def available() -> bool:
    return True


def unavailable_reason() -> str:
    return ""


saved_numel = functools.partial(_saved_state.saved_numel, _K)
linear_logprobs_fwd = functools.partial(_chunked.linear_logprobs_fwd, _K)
linear_logprobs_bwd = functools.partial(_chunked.linear_logprobs_bwd, _K)
linear_js_distance = functools.partial(_chunked.linear_js_distance, _K)
logprobs_from_logits_fwd = functools.partial(_chunked.logprobs_from_logits_fwd, _K)
logprobs_from_logits_bwd = functools.partial(_chunked.logprobs_from_logits_bwd, _K)
js_distance = functools.partial(_chunked.js_distance, _K)
linear_policy_loss = functools.partial(_chunked.linear_policy_loss, _K)


def mrtpo_token_advantages(
    per_reward,
    lam,
    has_info,
    relevance,
    cu_seqlens,
    sequence,
    divisor,
    alpha,
    gamma,
    delta,
    clip_min,
    clip_max,
):
    """METHOD.md sections 4-5 on packed tokens, vectorized (segment sums by index_add):
    token[t] = sequence[i] + sum_k c_k (w_k[t] - 1) / divisor, c_k = lam_k A_k[i], summed
    over the rewards with c_k != 0 (sequence[i] itself where divisor is not > 0)."""
    k, n_tok = relevance.shape
    n = per_reward.shape[0]
    counts = cu_seqlens[1:] - cu_seqlens[:-1]
    seg_ids = torch.repeat_interleave(
        torch.arange(n, device=relevance.device), counts, output_size=n_tok
    )
    rel = relevance.clamp(min=0.0)
    lengths = counts.to(rel.dtype)
    dg = rel if gamma == 1.0 else rel.pow(gamma)
    seg_sum = torch.zeros((k, n), dtype=rel.dtype, device=rel.device)
    seg_sum.index_add_(1, seg_ids, dg)
    seg_mean = seg_sum / lengths.clamp(min=1.0)  # (K, n)
    # (K, n): reallocate this reward here; an all-zero relevance (mean 0) is uniform
    # whatever delta (delta = 0 included: no 0 / 0), METHOD.md section 4
    use = has_info.t() & (seg_mean >= delta) & (seg_mean > 0)
    w_hat = dg / seg_mean.clamp(min=delta)[:, seg_ids]
    if clip_min > 0.0 or math.isfinite(clip_max):
        w_hat = w_hat.clamp(clip_min, clip_max)
        renorm = torch.zeros((k, n), dtype=rel.dtype, device=rel.device)
        renorm.index_add_(1, seg_ids, w_hat)
        renorm = renorm / lengths.clamp(min=1.0)
        w_hat = w_hat / renorm.clamp(min=1e-30)[:, seg_ids]
    alloc = torch.where(use[:, seg_ids], (1.0 - alpha) + alpha * w_hat, torch.ones_like(w_hat))
    coef = (per_reward * lam).t()[:, seg_ids]  # (K, N)
    # the redistribution: a weight of exactly 1, or a reward with c_k = 0, adds exactly 0
    moved = torch.where(coef != 0, coef * (alloc - 1.0), torch.zeros_like(alloc)).sum(0)
    seq = sequence.to(alloc.dtype)[seg_ids]
    token = torch.where(divisor > 0, seq + moved / divisor, seq)
    return token, alloc
