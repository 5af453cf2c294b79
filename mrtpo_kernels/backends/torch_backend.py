"""The "torch" backend: the chunked drivers with chunk kernels written in PyTorch ops.

Runs on any device. Each chunk kernel makes a few [C, V] temporaries (the C++ kernels of
the "cpu" backend make none), so this is the portable fallback, not the fast path.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _chunked

LN2 = math.log(2.0)


class _TorchChunkKernel:
    @staticmethod
    def stats(z, labels, inv_t, ignore_index, with_ent):
        zt = z * inv_t
        lse = torch.logsumexp(zt, dim=-1)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        tgt = zt.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        logp = torch.where(valid, tgt - lse, torch.zeros_like(lse))
        ent = None
        if with_ent:
            logp_all = zt - lse.unsqueeze(-1)
            ent = -(torch.exp(logp_all) * logp_all).nan_to_num(0.0).sum(-1)
            ent = torch.where(valid, ent, torch.zeros_like(ent))
        return logp, ent, lse

    @staticmethod
    def grad_(z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index):
        # dlogp/dz = onehot - p ; dH/dz = -p (log p + H) ; both times 1/tau for the logits.
        valid = labels != ignore_index
        zt = z.mul_(inv_t)
        logp_all = zt - lse.unsqueeze(-1)
        p = torch.exp(logp_all)
        g = torch.where(valid, g_logp, torch.zeros_like(g_logp)).unsqueeze(-1)
        grad = -p * g
        if ent is not None and g_ent is not None:
            ge = torch.where(valid, g_ent, torch.zeros_like(g_ent)).unsqueeze(-1)
            grad -= (ge * p * (logp_all + ent.unsqueeze(-1))).nan_to_num(0.0)
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        grad.scatter_add_(-1, safe.unsqueeze(-1), g)
        z.copy_(grad.mul_(inv_t))

    @staticmethod
    def js(zp, zq, inv_t, lse_p):
        # Same per-element form as the C++ kernel: p log(p/M) + q log(q/M) = M h(t) with
        # M = (p+q)/2, t = (p-q)/(p+q); series for small |t| (exactly 0 when p == q).
        zt = zp * inv_t
        if lse_p is None:
            lse_p = torch.logsumexp(zt, -1)
        a = zt - lse_p[:, None]
        zqt = zq * inv_t
        b = zqt - torch.logsumexp(zqt, -1, keepdim=True)
        p, q = a.exp(), b.exp()
        s = p + q
        tiny = torch.finfo(s.dtype).tiny
        s_safe = torch.where(s > tiny, s, torch.ones_like(s))
        t2 = ((p - q) / s_safe) ** 2
        h = 1.0 / 66
        for c in (1.0 / 45, 1.0 / 28, 1.0 / 15, 1.0 / 6, 1.0):
            h = h * t2 + c
        series = 0.5 * s * t2 * h
        log_s = torch.log(s_safe)
        zero = torch.zeros_like(p)  # p = 0 (a logit of -inf) contributes 0, not 0 * inf
        direct = torch.where(p > 0, p * (LN2 + a - log_s), zero) + torch.where(
            q > 0, q * (LN2 + b - log_s), zero
        )
        term = torch.where(t2 < 0.0625, series, direct)
        jsd = 0.5 * torch.where(s > tiny, term, torch.zeros_like(term)).sum(-1)
        return torch.sqrt(jsd.clamp(min=0.0) / LN2).clamp(max=1.0), lse_p

    @staticmethod
    def policy_(z, labels, old, adv, tw, ref, inv_t, clip_low, clip_high, beta, ii, need_grad):
        valid = labels != ii
        zt = z * inv_t
        lse = torch.logsumexp(zt, -1)
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        logp = zt.gather(-1, safe[:, None])[:, 0] - lse
        logp = torch.where(valid, logp, torch.zeros_like(logp))
        ratio = torch.exp(logp - old)
        cr = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        unclipped = ratio * adv <= cr * adv
        per_tok = -torch.minimum(ratio * adv, cr * adv)
        dlogp = torch.where(unclipped, -adv * ratio, torch.zeros_like(ratio))
        if ref is not None and beta != 0.0:
            diff = ref - logp
            per_tok = per_tok + beta * (torch.exp(diff) - diff - 1.0)
            dlogp = dlogp + beta * (1.0 - torch.exp(diff))
        per_tok = torch.where(valid, per_tok, torch.zeros_like(per_tok))
        clipped = torch.where(valid & ~unclipped, 1.0, 0.0)
        if need_grad:
            g = torch.where(valid, dlogp * tw, torch.zeros_like(dlogp))
            p = torch.softmax(zt, -1)
            grad = -p * g[:, None]
            grad.scatter_add_(-1, safe[:, None], g[:, None])
            z.copy_(grad.mul_(inv_t))
        return per_tok, logp, clipped


_K = _TorchChunkKernel()

linear_logprobs_fwd = functools.partial(_chunked.linear_logprobs_fwd, _K)
linear_logprobs_bwd = functools.partial(_chunked.linear_logprobs_bwd, _K)
linear_js = functools.partial(_chunked.linear_js, _K)
logits_logprobs_fwd = functools.partial(_chunked.logits_logprobs_fwd, _K)
logits_logprobs_bwd = functools.partial(_chunked.logits_logprobs_bwd, _K)
logits_js = functools.partial(_chunked.logits_js, _K)
linear_policy_loss = functools.partial(_chunked.linear_policy_loss, _K)


def reallocate_packed(
    per_reward,
    lam,
    has_info,
    relevance,
    seg_ids,
    cu_seqlens,
    mean,
    std,
    alpha,
    gamma,
    eps_batch,
    delta,
    clip_min,
    clip_max,
):
    """METHOD.md sections 4-5 on packed tokens, vectorized (segment sums by index_add)."""
    k, n_tok = relevance.shape
    n = per_reward.shape[0]
    rel = relevance.clamp(min=0.0)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(rel.dtype)
    dg = rel if gamma == 1.0 else rel.pow(gamma)
    seg_sum = torch.zeros((k, n), dtype=rel.dtype, device=rel.device)
    seg_sum.index_add_(1, seg_ids, dg)
    seg_mean = seg_sum / lengths.clamp(min=1.0)  # (K, n)
    use = has_info.t() & (seg_mean >= delta)  # (K, n): reallocate this reward here
    w_hat = dg / seg_mean.clamp(min=delta)[:, seg_ids]
    if clip_min > 0.0 or math.isfinite(clip_max):
        w_hat = w_hat.clamp(clip_min, clip_max)
        renorm = torch.zeros((k, n), dtype=rel.dtype, device=rel.device)
        renorm.index_add_(1, seg_ids, w_hat)
        renorm = renorm / lengths.clamp(min=1.0)
        w_hat = w_hat / renorm.clamp(min=1e-30)[:, seg_ids]
    alloc = torch.where(use[:, seg_ids], (1.0 - alpha) + alpha * w_hat, torch.ones_like(w_hat))
    coef = per_reward * lam  # (n, K)
    token = (coef.t()[:, seg_ids] * alloc).sum(0)
    token = (token - mean) / (std + eps_batch)
    return token, alloc
