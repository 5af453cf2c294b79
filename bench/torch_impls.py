"""What users would write instead of mrtpo_kernels, as benchmark baselines.

plain_*: full [N, V] logits, log_softmax and autograd (the textbook PyTorch code).
Chunked*: a loop over token chunks calling one small per-chunk function, which can be put
under torch.compile; gradients are written out by hand so that a chunk's [C, V] logits
never outlive the chunk (no autograd graph across chunks). Both run in fp32 from the GEMM
output on, like the kernels they are compared with.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- plain PyTorch


def plain_logprobs(hidden, weight, labels, *, temperature=1.0, return_entropy=False):
    """log p(label) (and entropy) from full fp32 logits; differentiable by autograd."""
    z = (hidden @ weight.t()).float()
    if temperature != 1.0:
        z = z / temperature
    lsm = torch.log_softmax(z, dim=-1)
    logp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp
    ent = -(lsm.exp() * lsm).sum(-1)
    return logp, ent


def plain_js_distance(hidden_p, hidden_q, weight, *, temperature=1.0):
    """JS distance (K, N) from the full log-softmax of P and of each Q stream in turn
    (in-place where it is free to do so: at most five [N, V] fp32 tensors at once)."""
    zp = (hidden_p @ weight.t()).float()
    lp = torch.log_softmax(zp / temperature if temperature != 1.0 else zp, dim=-1)
    del zp
    p = lp.exp()
    out = []
    for q in hidden_q:
        zq = (q @ weight.t()).float()
        lq = torch.log_softmax(zq / temperature if temperature != 1.0 else zq, dim=-1)
        del zq
        lm = torch.logaddexp(lp, lq).sub_(LN2)
        kl_pm = (lp - lm).mul_(p).sum(-1)
        kl_qm = lq.exp().mul_(lq.sub_(lm)).sum(-1)
        del lq, lm
        jsd = 0.5 * (kl_pm + kl_qm)
        out.append(torch.sqrt(jsd.clamp(min=0.0) / LN2).clamp(max=1.0))
    return torch.stack(out)


def clipped_surrogate(logp, old_logprobs, advantages, clip_low=0.2, clip_high=0.2):
    """Token-mean clipped surrogate loss (all tokens valid)."""
    ratio = torch.exp(logp - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages).mean()


def plain_policy_loss(hidden, weight, labels, old_logprobs, advantages, *, temperature=1.0):
    logp = plain_logprobs(hidden, weight, labels, temperature=temperature)
    return clipped_surrogate(logp, old_logprobs, advantages)


# --------------------------------------------------------------------------- chunk bodies
# z is a chunk's fp32 logits divided by the temperature; h and w are in the input dtype.


def _chunk_stats(h, w, labels, inv_t: float, with_entropy: bool):
    z = (h @ w.t()).float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if with_entropy:
        p = torch.exp(z - lse.unsqueeze(-1))
        ent = lse - (p * z).sum(-1)
        return logp, ent, lse
    return logp, None, lse


def _chunk_grad(h, w, labels, lse, g, inv_t: float):
    """dL/dz of L = sum_t g_t logp_t for one chunk: g (onehot - p) / temperature."""
    z = (h @ w.t()).float() * inv_t
    dz = torch.exp(z - lse.unsqueeze(-1)) * (-g).unsqueeze(-1)
    dz = dz.scatter_add(1, labels.unsqueeze(-1), g.unsqueeze(-1)) * inv_t
    return dz.to(h.dtype)


def _chunk_js(hp, hq, w, inv_t: float):
    """JS distance (K, C) between one P chunk and K Q chunks hq (K, C, d)."""
    lp = torch.log_softmax((hp @ w.t()).float() * inv_t, dim=-1)
    lq = torch.log_softmax(torch.matmul(hq, w.t()).float() * inv_t, dim=-1)
    lp = lp.unsqueeze(0)
    lm = torch.logaddexp(lp, lq) - LN2
    jsd = 0.5 * ((lp.exp() * (lp - lm)).sum(-1) + (lq.exp() * (lq - lm)).sum(-1))
    return torch.sqrt(jsd.clamp(min=0.0) / LN2).clamp(max=1.0)


def _chunk_policy(h, w, labels, old, adv, coef, inv_t: float, clip_low: float, clip_high: float):
    """Loss sum_t coef_t L_t of one chunk and its gradient dL/dz."""
    z = (h @ w.t()).float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_term = ratio * adv
    loss = -(coef * torch.minimum(unclipped_term, clipped * adv)).sum()
    # dL/dlogp: the unclipped branch carries the gradient where it is the minimum
    g = torch.where(unclipped_term <= clipped * adv, -coef * unclipped_term, 0.0)
    dz = torch.exp(z - lse.unsqueeze(-1)) * (-g).unsqueeze(-1)
    dz = dz.scatter_add(1, labels.unsqueeze(-1), g.unsqueeze(-1)) * inv_t
    return loss, dz.to(h.dtype)


def _backprop_chunk(dz, h, w, dh_out, dw_acc):
    """dh_out = dz @ w; dw_acc (fp32) += dz^T h, in place where the dtypes allow it."""
    torch.mm(dz, w, out=dh_out)
    if dz.dtype == dw_acc.dtype:
        dw_acc.addmm_(dz.t(), h)
    else:  # bf16/fp16: the GEMM accumulates in fp32, its output is rounded per chunk
        dw_acc += dz.t() @ h


# --------------------------------------------------------------------------- chunked driver


def pow2_rows(vocab: int, streams: int, budget_bytes: int) -> int:
    """Largest power of two C with streams fp32 [C, vocab] blocks within budget_bytes, so that
    every full chunk has the same shape (one compilation)."""
    rows = max(1, budget_bytes // (4 * vocab * max(streams, 1)))
    return 1 << (rows.bit_length() - 1)


class ChunkedTorch:
    """Chunked linear log-probs / JS / policy loss, per-chunk bodies optionally compiled."""

    def __init__(self, compile: bool = True, budget_bytes: int = 256 << 20):
        self.budget = budget_bytes
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self.stats = wrap(_chunk_stats)
        self.grad = wrap(_chunk_grad)
        self.js_chunk = wrap(_chunk_js)
        self.policy_chunk = wrap(_chunk_policy)

    def rows(self, vocab: int, streams: int = 1) -> int:
        return pow2_rows(vocab, streams, self.budget)

    def logprobs(self, hidden, weight, labels, *, temperature=1.0, return_entropy=False):
        out = _ChunkedLogprobs.apply(
            hidden, weight, labels, 1.0 / temperature, self, return_entropy
        )
        return out if return_entropy else out[0]

    @torch.no_grad()
    def js_distance(self, hidden_p, hidden_q, weight, *, temperature=1.0):
        n, k = hidden_p.shape[0], hidden_q.shape[0]
        c = self.rows(weight.shape[0], 1 + k)
        out = torch.empty((k, n), dtype=torch.float32, device=hidden_p.device)
        for s in range(0, n, c):
            e = min(n, s + c)
            out[:, s:e] = self.js_chunk(hidden_p[s:e], hidden_q[:, s:e], weight, 1.0 / temperature)
        return out

    def policy_loss(self, hidden, weight, labels, old_logprobs, advantages, *, temperature=1.0):
        coef = torch.full_like(old_logprobs, 1.0 / labels.shape[0], dtype=torch.float32)
        return _ChunkedPolicyLoss.apply(
            hidden,
            weight,
            labels,
            old_logprobs.float(),
            advantages.float(),
            coef,
            1.0 / temperature,
            self,
        )


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, impl, with_entropy):
        n = hidden.shape[0]
        c = impl.rows(weight.shape[0])
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, c):
            e = min(n, s + c)
            lp, en, ls = impl.stats(hidden[s:e], weight, labels[s:e], inv_t, with_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if with_entropy:
                ent[s:e] = en
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.inv_t, ctx.impl = inv_t, impl
        ctx.mark_non_differentiable(*([ent] if with_entropy else []))
        return (logp, ent) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, g_logp, *unused):
        hidden, weight, labels, lse = ctx.saved_tensors
        impl, n = ctx.impl, hidden.shape[0]
        c = impl.rows(weight.shape[0])
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        g_logp = g_logp.float().contiguous()
        for s in range(0, n, c):
            e = min(n, s + c)
            dz = impl.grad(hidden[s:e], weight, labels[s:e], lse[s:e], g_logp[s:e], ctx.inv_t)
            _backprop_chunk(dz, hidden[s:e], weight, dh[s:e], dw)
            del dz
        return dh, dw.to(weight.dtype), None, None, None, None


class _ChunkedPolicyLoss(torch.autograd.Function):
    """Loss and gradients in the forward pass; the backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, old, adv, coef, inv_t, impl):
        n = hidden.shape[0]
        c = impl.rows(weight.shape[0])
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, c):
            e = min(n, s + c)
            l_c, dz = impl.policy_chunk(
                hidden[s:e], weight, labels[s:e], old[s:e], adv[s:e], coef[s:e], inv_t, 0.2, 0.2
            )
            loss += l_c
            _backprop_chunk(dz, hidden[s:e], weight, dh[s:e], dw)
            del dz
        ctx.save_for_backward(dh, dw.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors  # used once: scaled in place, no second copy
        return dh.mul_(g.to(dh.dtype)), dw.mul_(g.to(dw.dtype)), None, None, None, None, None, None
