"""Per-token terms shared by the torch backend's row kernel and the vocabulary-parallel
path (``_vocab_parallel``): the scaled row difference, the JS divergence of two log-prob
rows, the clipped policy-loss terms and the k3 KL, each in the form the C++ and Triton row
kernels use (README "Numerics"). Pure PyTorch, any dtype; nothing here dispatches."""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def scaled_diff(z, m, inv_t):
    """(z - m) / tau for rows z (R, V) and row values m (R,), as (z/2 - m/2) (2/tau)."""
    return (z * 0.5 - (m * 0.5)[:, None]) * (2.0 * inv_t)


def js_terms(a, b):
    """JSD (nats) of each row from log p = a and log q = b, summed over the last dim:
    p log(p/M) + q log(q/M) = M h(t) per element with M = (p+q)/2, t = (p-q)/(p+q), a series
    for small |t| (exactly 0 when p == q), as in the C++ kernel."""
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
    return 0.5 * torch.where(s > tiny, term, torch.zeros_like(term)).sum(-1)


def policy_token_terms(logp, old_logp, advantages, ref_logp, cfg):
    """Per-token loss L_t, dL_t/dlogp_t and the clipped flag from the log-probs (N,);
    ``cfg`` the op's scalar settings (a ``PolicyLossSettings``; its temperature and
    ignore_index are not used here).

    L = -min(r A, clamp(r, 1 - clip_low, 1 + clip_high) A), capped at -A clip_ratio_c for
    A < 0 (the dual clip; inf: none; gradient 0 where the cap binds), plus beta k3 with
    k3 = exp(ref - logp) - (ref - logp) - 1 (kl_k3: no cancellation), times r with
    kl_importance_weight (its derivative is then r k3 + r (1 - exp(ref - logp)) =
    r (logp - ref)). Clipped:
    r A > clamp(r) A, strictly as in the reference (a tie, i.e. any r inside the range or
    A = 0, or a NaN is not clipped); dL/dlogp = -A r unless clipped, as the reference's
    autograd: a tie passes the whole gradient and a NaN passes NaN (never 0); L is NaN where
    r A or clamp(r) A is."""
    adv, ref, beta = advantages, ref_logp, cfg.beta
    ratio = torch.exp(logp - old_logp)
    cr = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = ratio * adv > cr * adv
    per_tok = -torch.minimum(ratio * adv, cr * adv)
    dlogp = torch.where(clipped, torch.zeros_like(ratio), -adv * ratio)
    if math.isfinite(cfg.clip_ratio_c):
        cap = -adv * cfg.clip_ratio_c
        dual = (adv < 0) & (per_tok > cap)
        per_tok = torch.where(dual, cap, per_tok)
        dlogp = torch.where(dual, torch.zeros_like(dlogp), dlogp)
    if ref is not None and beta != 0.0:
        diff = ref - logp
        k3 = kl_k3(diff)
        if cfg.kl_importance_weight:
            per_tok = per_tok + beta * ratio * k3
            dlogp = dlogp - beta * ratio * diff
        else:
            per_tok = per_tok + beta * k3
            dlogp = dlogp - beta * (diff + k3)  # 1 - exp(d) = -(d + k3), no cancellation
    return per_tok, dlogp, clipped


# k3 = exp(d) - d - 1 = sum_{n >= 2} d^n / n! for |d| < K3_SERIES (through 1/16!), else
# expm1(d) - d: the reference's form (reference.kl_k3_ref), used by every backend.
K3_SERIES = 0.5
_K3_TERMS = tuple(1.0 / math.factorial(n) for n in range(2, 17))


def kl_k3(d):
    """The k3 KL term exp(d) - d - 1 of d = ref - logp, computed without cancellation
    (the plain form reads 0 in float32 for |d| ~ 1e-5); NaN stays NaN."""
    small = d.abs() < K3_SERIES
    ds = torch.where(small, d, torch.zeros_like(d))
    poly = torch.full_like(d, _K3_TERMS[-1])
    for c in reversed(_K3_TERMS[:-1]):
        poly = poly * ds + c
    return torch.where(small, ds * ds * poly, torch.expm1(d) - d)
