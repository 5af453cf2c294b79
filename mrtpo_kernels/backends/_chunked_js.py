"""The chunk driver's JS ops (backends/_chunked.py lists the driver's modules):
``linear_js_distance`` (P's and each Q stream's logits per token chunk, or, where the row
kernel has js_many, the 1 + K streams stacked into one GEMM per chunk) and
``js_distance`` (the row kernel over chunks of existing logits).

GEMMs (N d V multiply-adds each over the call): 1 + K.
"""

from __future__ import annotations

from .._types import LogitCap, acc_dtype
from ._chunk_sizes import _buffer, balanced, chunk_rows, js_chunk_rows
from ._lm_head import Head, apply_logit_cap_, fp32_logits, upcast


def linear_js_distance(
    kern, hidden_p, hidden_q, weight, bias, temperature, logit_scale=1.0, softcap=0.0
):
    acc = acc_dtype(hidden_p)
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    v = weight.shape[0]
    cap = LogitCap(logit_scale, softcap)
    if kern.JS_MANY:
        return _js_stacked(kern, hidden_p, hidden_q, weight, bias, temperature, cap)
    w32, b32 = upcast(weight), upcast(bias)
    inv_t = 1.0 / temperature
    out = hidden_p.new_empty((k, n), dtype=acc)
    c = chunk_rows(v, streams=2)
    buf_p = _buffer(c, n, v, hidden_p, acc)
    buf_q = _buffer(c, n, v, hidden_p, acc)
    for s, e in balanced(n, c):
        # P's logits = h_p[s:e] W^T (+ b), fp32: once per chunk, for all K streams
        zp = apply_logit_cap_(fp32_logits(hidden_p[s:e], w32, b32, buf_p), cap)
        lse_p = None
        for j in range(k):
            # stream j's logits = h_q[j, s:e] W^T (+ b), fp32
            zq = apply_logit_cap_(fp32_logits(hidden_q[j, s:e], w32, b32, buf_q), cap)
            d, lse_p = kern.js(zp, zq, inv_t, lse_p)
            out[j, s:e] = d
    return out


def _js_stacked(kern, hidden_p, hidden_q, weight, bias, temperature, cap):
    """Per chunk of C tokens: the 1 + K streams' hidden rows stacked (P first) into one
    (1 + K) C x d operand, one GEMM into an fp32 scratch of (1 + K) C x V (C sized so it
    fits MRTPO_JS_SCRATCH_BYTES), then kern.js_many for the K distances."""
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    d, v = hidden_p.shape[1], weight.shape[0]
    acc = acc_dtype(hidden_p)
    out = hidden_p.new_empty((k, n), dtype=acc)
    if n == 0 or k == 0:
        return out
    head = Head(kern, hidden_p, weight, bias, cap)
    streams = 1 + k
    c = min(n, js_chunk_rows(v, k))
    a_buf = hidden_p.new_empty(streams * c * d)
    z_buf = hidden_p.new_empty(streams * c * v, dtype=acc)
    for s, e in balanced(n, c):
        rows = e - s
        a = a_buf[: streams * rows * d].view(streams, rows, d)
        a[0].copy_(hidden_p[s:e])
        a[1:].copy_(hidden_q[:, s:e])
        # the stacked logits = [h_p; h_q[0]; ...; h_q[K-1]][s:e] W^T (+ b), fp32: one GEMM
        z = head.logits(a.view(streams * rows, d), z_buf.view(-1, v))
        out[:, s:e] = kern.js_many(z.view(streams, rows, v), 1.0 / temperature)
    return out


def js_distance(kern, logits_p, logits_q, temperature):
    acc = acc_dtype(logits_p)
    k, n, v = logits_q.shape
    inv_t = 1.0 / temperature
    out = logits_p.new_empty((k, n), dtype=acc)
    for s, e in balanced(n, chunk_rows(v, streams=2)):
        zp = upcast(logits_p[s:e]).contiguous()
        lse_p = None
        for j in range(k):
            zq = upcast(logits_q[j, s:e]).contiguous()
            d, lse_p = kern.js(zp, zq, inv_t, lse_p)
            out[j, s:e] = d
    return out
