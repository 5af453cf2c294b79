"""Token-chunked drivers shared by the "cpu" and "torch" backends.

Both backends walk the tokens in chunks of C rows sized from a memory budget
(``MRTPO_CHUNK_BYTES``, see mrtpo_kernels/settings.py): one BLAS GEMM makes the
chunk's fp32 logits [C, V], then a chunk kernel streams the reductions over them and, for
gradients, overwrites them in place with dL/dlogits, which two more GEMMs turn into the
gradients of hidden and weight. Extra memory is O(C x V) (plus an fp32 copy of the weight
when it is not fp32, and the fp32 weight-gradient accumulator), never O(N x V).

GEMM count per chunk (N d V multiply-adds each):
    log-probs forward 1; log-probs backward 3 (recompute, dH, dW);
    policy loss (forward with gradient) 3; JS one-vs-K 1 + K.

A chunk kernel ``kern`` provides:
    stats(z, labels, inv_temp, ignore_index, with_entropy) -> (logp, entropy|None, lse)
    grad_(z, labels, lse, entropy|None, g_logp, g_entropy|None, inv_temp, ignore_index)
    js(zp, zq, inv_temp, lse_p|None) -> (d, lse_p)
    policy_(z, labels, old, adv, token_weight, ref|None, inv_temp, clip_low, clip_high,
            beta, ignore_index, need_grad) -> (per_token_loss, logp, clipped)
where z is a contiguous fp32 chunk of raw logits (before the temperature).
"""

from __future__ import annotations

import torch

from .. import settings
from ..types import acc_dtype

# The public ops these drivers implement (entry points: mrtpo_kernels/_optable.py).
OPS = (
    "linear_logprobs",
    "logprobs_from_logits",
    "linear_js_distance",
    "js_distance",
    "linear_policy_loss",
)


def chunk_rows(vocab: int, streams: int = 1) -> int:
    """Rows per chunk so that ``streams`` fp32 [rows, vocab] chunks fit the budget."""
    return max(1, settings.chunk_bytes() // (4 * max(vocab, 1) * streams))


def _upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _logits(
    h: torch.Tensor, w32: torch.Tensor, b32: torch.Tensor | None, buf: torch.Tensor
) -> torch.Tensor:
    """fp32 logits of the rows h into buf[:rows] (one buffer reused by every chunk: a fresh
    [C, V] allocation per chunk would page-fault and zero a few hundred MB each time)."""
    h32 = _upcast(h)
    out = buf[: h.shape[0]]
    if b32 is None:
        return torch.mm(h32, w32.t(), out=out)
    return torch.addmm(b32, h32, w32.t(), out=out)


def _buffer(rows: int, n: int, v: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((min(rows, n), v), dtype=dtype, device=like.device)


def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


def linear_logprobs_fwd(kern, hidden, weight, bias, labels, temperature, ignore_index, with_ent):
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    w32, b32 = _upcast(weight), _upcast(bias)
    inv_t = 1.0 / temperature
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    ent = hidden.new_empty(n if with_ent else 0, dtype=acc)
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s in range(0, n, c):
        e = min(n, s + c)
        z = _logits(hidden[s:e], w32, b32, buf)
        lp, en, ls = kern.stats(z, labels[s:e], inv_t, ignore_index, with_ent)
        logp[s:e] = lp
        lse[s:e] = ls
        if with_ent:
            ent[s:e] = en
    return logp, ent, lse


def linear_logprobs_bwd(
    kern, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, temperature, ignore_index
):
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    w32, b32 = _upcast(weight), _upcast(bias)
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    db = torch.zeros(v if bias is not None else 0, dtype=acc, device=weight.device)
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s in range(0, n, c):
        e = min(n, s + c)
        h32 = _upcast(hidden[s:e])
        z = _logits(h32, w32, b32, buf)
        kern.grad_(
            z,
            labels[s:e],
            lse[s:e],
            None if ent is None else ent[s:e],
            g_logp[s:e],
            None if g_ent is None else g_ent[s:e],
            inv_t,
            ignore_index,
        )
        dh[s:e] = z @ w32
        dw.addmm_(z.t(), h32)
        if bias is not None:
            db += z.sum(0)
    return dh, dw, db


def linear_js(kern, hidden_p, hidden_q, weight, bias, temperature):
    acc = acc_dtype(hidden_p)
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    v = weight.shape[0]
    w32, b32 = _upcast(weight), _upcast(bias)
    inv_t = 1.0 / temperature
    out = hidden_p.new_empty((k, n), dtype=acc)
    c = chunk_rows(v, streams=2)
    buf_p = _buffer(c, n, v, hidden_p, acc)
    buf_q = _buffer(c, n, v, hidden_p, acc)
    for s in range(0, n, c):
        e = min(n, s + c)
        zp = _logits(hidden_p[s:e], w32, b32, buf_p)  # P's logits: once per chunk, for all K
        lse_p = None
        for j in range(k):
            zq = _logits(hidden_q[j, s:e], w32, b32, buf_q)
            d, lse_p = kern.js(zp, zq, inv_t, lse_p)
            out[j, s:e] = d
    return out


def logits_logprobs_fwd(kern, logits, labels, temperature, ignore_index, with_ent):
    acc = acc_dtype(logits)
    n, v = logits.shape
    inv_t = 1.0 / temperature
    logp = logits.new_empty(n, dtype=acc)
    lse = logits.new_empty(n, dtype=acc)
    ent = logits.new_empty(n if with_ent else 0, dtype=acc)
    c = chunk_rows(v)
    for s in range(0, n, c):
        e = min(n, s + c)
        z = _upcast(logits[s:e]).contiguous()
        lp, en, ls = kern.stats(z, labels[s:e], inv_t, ignore_index, with_ent)
        logp[s:e] = lp
        lse[s:e] = ls
        if with_ent:
            ent[s:e] = en
    return logp, ent, lse


def logits_logprobs_bwd(kern, logits, labels, lse, ent, g_logp, g_ent, temperature, ignore_index):
    acc = acc_dtype(logits)
    n, v = logits.shape
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    out = torch.empty_like(logits)
    c = chunk_rows(v)
    # fp32/fp64 logits: the gradient is computed in place in the output's rows; other
    # dtypes go through one reused accumulation-dtype buffer
    buf = None if logits.dtype == acc else _buffer(c, n, v, logits, acc)
    for s in range(0, n, c):
        e = min(n, s + c)
        z = out[s:e] if buf is None else buf[: e - s]
        z.copy_(logits[s:e])
        kern.grad_(
            z,
            labels[s:e],
            lse[s:e],
            None if ent is None else ent[s:e],
            g_logp[s:e],
            None if g_ent is None else g_ent[s:e],
            inv_t,
            ignore_index,
        )
        if buf is not None:
            out[s:e] = z
    return out


def logits_js(kern, logits_p, logits_q, temperature):
    acc = acc_dtype(logits_p)
    k, n, v = logits_q.shape
    inv_t = 1.0 / temperature
    out = logits_p.new_empty((k, n), dtype=acc)
    c = chunk_rows(v, streams=2)
    for s in range(0, n, c):
        e = min(n, s + c)
        zp = _upcast(logits_p[s:e]).contiguous()
        lse_p = None
        for j in range(k):
            zq = _upcast(logits_q[j, s:e]).contiguous()
            d, lse_p = kern.js(zp, zq, inv_t, lse_p)
            out[j, s:e] = d
    return out


def linear_policy_loss(
    kern,
    hidden,
    weight,
    bias,
    labels,
    old_logp,
    adv,
    token_weight,
    ref_logp,
    temperature,
    clip_low,
    clip_high,
    beta,
    ignore_index,
    need_grad,
):
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    w32, b32 = _upcast(weight), _upcast(bias)
    inv_t = 1.0 / temperature
    ref_logp = _none_if_empty(ref_logp)
    logp = hidden.new_empty(n, dtype=acc)
    clipped = hidden.new_empty(n, dtype=acc)
    loss = hidden.new_zeros((), dtype=acc)
    if need_grad:
        dh = torch.empty_like(hidden)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        db = hidden.new_zeros(v if bias is not None else 0, dtype=acc)
    else:
        dh = hidden.new_empty(0)
        dw = hidden.new_empty(0, dtype=acc)
        db = hidden.new_empty(0, dtype=acc)
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s in range(0, n, c):
        e = min(n, s + c)
        h32 = _upcast(hidden[s:e])
        z = _logits(h32, w32, b32, buf)
        per_tok, lp, cl = kern.policy_(
            z,
            labels[s:e],
            old_logp[s:e],
            adv[s:e],
            token_weight[s:e],
            None if ref_logp is None else ref_logp[s:e],
            inv_t,
            clip_low,
            clip_high,
            beta,
            ignore_index,
            need_grad,
        )
        loss += (per_tok * token_weight[s:e]).sum()
        logp[s:e] = lp
        clipped[s:e] = cl
        if need_grad:
            dh[s:e] = z @ w32
            dw.addmm_(z.t(), h32)
            if bias is not None:
                db += z.sum(0)
    return loss, logp, clipped, dh, dw, db
