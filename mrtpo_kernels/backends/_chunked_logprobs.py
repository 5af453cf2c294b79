"""The chunk driver's log-prob ops (backends/_chunked.py lists the driver's modules):
``linear_logprobs`` (the LM head's GEMM per span, the row kernel's statistics, the last
rows' logits kept for the backward: _saved_state.py) and ``logprobs_from_logits`` (the
row kernel over chunks of existing logits).

GEMMs (N d V multiply-adds each over the call): forward 1; backward 3 (recompute, dH,
dW), 2 for the kept rows, whose logits the forward keeps (MRTPO_KEEP_LOGITS_BYTES, see
kept_rows; the kept block also sets the GEMM span of the other rows, see logprobs_spans).
"""

from __future__ import annotations

import torch

from .._types import LogitCap, acc_dtype
from ._chunk_backward import _backward_by_vocab, _low_memory, _run_backward
from ._chunk_sizes import (
    _buffer,
    _none_if_empty,
    _out,
    balanced,
    chunk_rows,
    grad_spans,
    logprobs_spans,
)
from ._lm_head import Head, cap_kwargs, upcast
from ._row_lanes import _RowLanes
from ._saved_state import kept_from, kept_rows, norm_rows, takes_norm


def linear_logprobs_fwd(
    kern,
    hidden,
    weight,
    bias,
    labels,
    temperature,
    ignore_index,
    with_ent,
    logit_scale=1.0,
    softcap=0.0,
):
    """(logp, entropy, lse, saved): ``saved`` is what the backward needs (above); kept
    logits are stored transformed (z), as the backward's row kernels read them."""
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    head = Head(kern, hidden, weight, bias, LogitCap(logit_scale, softcap))
    inv_t = 1.0 / temperature
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    ent = hidden.new_empty(n if with_ent else 0, dtype=acc)
    c = chunk_rows(v)
    low = _low_memory(kern, weight)
    k = 0 if low else kept_rows(n, v)
    # low-memory mode: each row's (raw max, log s) for the column kernel of the backward
    saved = hidden.new_empty(2 * n if low and takes_norm(kern) else k * v, dtype=acc)
    norm = saved.view(2, n) if low and takes_norm(kern) else None
    spans = logprobs_spans(n, v, k)
    span_rows = max([0] + [e - s for s, e in spans])
    kept = saved.view(k, v) if not low else saved[:0].view(0, v)
    overlap = _RowLanes.enabled(head.low, hidden) and span_rows > 0
    # the kept block doubles as the buffer of the spans before it where it is large enough
    # (not with the overlap: the lanes own their two buffers)
    buf = kept if k >= span_rows and not overlap else _buffer(span_rows, n, v, hidden, acc)

    def stats(z, g, s, e):  # the kernel on slices of at most c rows of the span's logits z
        for a, b in balanced(e - s, c, s):
            lp, en, ls = kern.stats(
                z[a - s : b - s],
                labels[a:b],
                inv_t,
                ignore_index,
                with_ent,
                **norm_rows(norm, a, b),
            )
            logp[a:b] = lp
            lse[a:b] = ls
            if with_ent:
                ent[a:b] = en

    lanes = _RowLanes(buf, hidden) if overlap else None
    try:
        for s, e in spans:
            # logits = h[s:e] W^T (+ b), fp32, (e - s) x V: one GEMM per span
            if lanes is None:
                stats(head.logits(hidden[s:e], buf), None, s, e)
            else:
                lanes.run(lambda zb, s=s, e=e: head.logits(hidden[s:e], zb), stats, None, s, e)
        del buf
        if k:
            # logits of the kept rows = h[n-k:] W^T (+ b) straight into ``saved``: one GEMM
            z = head.logits(hidden[n - k :], kept)
            if lanes is None:
                stats(z, None, n - k, n)
            else:
                lanes.on_side(stats, z, None, n - k, n)
    finally:
        if lanes is not None:  # also on an exception: see _RowLanes
            lanes.join()
    return logp, ent, lse, saved  # the base, not a view (the backward may write it)


def linear_logprobs_bwd(
    kern,
    hidden,
    weight,
    bias,
    labels,
    lse,
    ent,
    g_logp,
    g_ent,
    temperature,
    ignore_index,
    saved=None,
    logit_scale=1.0,
    softcap=0.0,
    own_entropy=True,
):
    """(dh, dW, db); ``saved``: the forward's fourth output (or None: recompute all);
    ``own_entropy``: ``ent`` is the rows' own entropy (contract.RowKernel)."""
    n, v = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    head = Head(kern, hidden, weight, bias, LogitCap(logit_scale, softcap))
    ckw = cap_kwargs(head.cap)
    if _low_memory(kern, weight):
        norm = None
        if saved is not None and saved.numel() == 2 * n and takes_norm(kern):
            norm = saved.view(2, n)
        return _backward_by_vocab(
            kern,
            head,
            hidden,
            weight,
            bias,
            labels,
            lse,
            ent,
            g_logp,
            g_ent,
            inv_t,
            ignore_index,
            norm,
            centre=own_entropy or g_ent is None,  # each row of dL/dz sums to zero
        )
    kept, k = kept_from(saved, n, v)
    spans = grad_spans(n, v, k, head.low)

    def grad(z, g, a, b):  # the kernel on rows [a, b): dL/dz in place, or into g
        kern.grad_(
            z,
            labels[a:b],
            lse[a:b],
            None if ent is None else ent[a:b],
            g_logp[a:b],
            None if g_ent is None else g_ent[a:b],
            inv_t,
            ignore_index,
            **_out(g, 0, b - a),
            **ckw,
        )

    return _run_backward(
        head, hidden, weight, bias, spans, kept, k, grad, chunk_rows(v), need_dw=True
    )


def logprobs_from_logits_fwd(kern, logits, labels, temperature, ignore_index, with_ent):
    acc = acc_dtype(logits)
    n, v = logits.shape
    inv_t = 1.0 / temperature
    logp = logits.new_empty(n, dtype=acc)
    lse = logits.new_empty(n, dtype=acc)
    ent = logits.new_empty(n if with_ent else 0, dtype=acc)
    for s, e in balanced(n, chunk_rows(v)):
        z = upcast(logits[s:e]).contiguous()
        lp, en, ls = kern.stats(z, labels[s:e], inv_t, ignore_index, with_ent)
        logp[s:e] = lp
        lse[s:e] = ls
        if with_ent:
            ent[s:e] = en
    return logp, ent, lse, logits.new_empty(0, dtype=torch.float32)  # no saved state


def logprobs_from_logits_bwd(
    kern, logits, labels, lse, ent, g_logp, g_ent, temperature, ignore_index, saved=None
):
    acc = acc_dtype(logits)
    n, v = logits.shape
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    out = torch.empty_like(logits)
    c = chunk_rows(v)
    # fp32/fp64 logits: the gradient is computed in place in the output's rows; other
    # dtypes go through one reused accumulation-dtype buffer
    buf = None if logits.dtype == acc else _buffer(c, n, v, logits, acc)
    for s, e in balanced(n, c):
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
