"""The chunk driver's two backward walks (backends/_chunked.py lists the driver's
modules), shared by the log-probs backward and the policy loss:

- ``_run_backward``: by token. Per gradient buffer (``grad_spans``), the logits of its
  rows, the row kernel's logit gradient, then dh = G W and dW = G^T h once for the buffer
  (the policy loss's forward with gradient runs the same walk).
- ``_backward_by_vocab``: the low-memory mode (``_low_memory``: ``MRTPO_LOW_MEMORY``, see
  _saved_state.low_memory_for). Per vocabulary chunk of all N rows, the logits again, the
  column kernel's gradient, dW for the chunk's rows written once and dh accumulated in fp32
  (fp32 mode: dh += G (W - c) with the head centred, ``_Centred``).
"""

from __future__ import annotations

import torch

from .. import settings
from .._types import acc_dtype
from . import _lm_head
from ._chunk_sizes import _buffer, _out, balanced
from ._lm_head import cap_kwargs, upcast
from ._row_lanes import _RowLanes
from ._saved_state import low_memory_for


def _run_backward(head, hidden, weight, bias, spans, kept, k, row_fn, c, need_dw):
    """The token-chunked backward (and the policy loss's forward with gradient): for each
    gradient buffer [s, e) of ``spans``, the logits of its rows (the ``kept`` block of the
    last k rows, read only, or a GEMM), ``row_fn(z, g, a, b)`` on slices [a, b) of at most
    c rows (the logit gradient into g, the slice of the separate 16-bit buffer, or in place
    in z: then kept rows are first copied into the chunk), then dh[s:e] = G W and dW
    (=, first buffer; +=, later ones) G^T h[s:e]. In place mode one logits GEMM (or copy)
    covers the whole buffer."""
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    dh = torch.empty_like(hidden) if need_dw else hidden.new_empty(0)
    dw = torch.empty(weight.shape if need_dw else (0,), dtype=acc, device=weight.device)
    db = hidden.new_zeros(v if bias is not None and need_dw else 0, dtype=acc)
    if need_dw and not spans:
        dw.zero_()
    sep = head.low and need_dw
    g_buf = head.grad_buffer(max(e - s for s, e, _ in spans), v, hidden) if sep and spans else None
    # the fp32 logits chunk: a slice of rows in the 16-bit path, a whole buffer in place
    rows = [e - s for s, e, fk in spans if not (sep and fk)]
    z_buf = _buffer(min(c, max(rows)) if sep else max(rows), n, v, hidden, acc) if rows else None
    overlap = sep and z_buf is not None and _RowLanes.enabled(head.low, hidden)
    lanes = _RowLanes(z_buf, hidden) if overlap else None
    try:
        first = True
        for s, e, from_kept in spans:
            z_span = None
            if from_kept:
                z_span = kept[s - (n - k) : e - (n - k)]
                if not sep:  # in place: the gradient must not overwrite the forward's output
                    z_span = z_buf[: e - s].copy_(z_span)
            elif not sep:
                # logits = h[s:e] W^T (+ b), fp32, one GEMM for the whole buffer (in place)
                z_span = head.logits(hidden[s:e], z_buf)
            g = None if g_buf is None else g_buf[: e - s]
            for a, b in balanced(e - s, c, s):
                gs = None if g is None else g[a - s : b - s]
                if z_span is not None:
                    row_fn(z_span[a - s : b - s], gs, a, b)
                elif lanes is not None:
                    # logits = h[a:b] W^T (+ b), fp32, per slice; its row kernel on the side
                    lanes.run(lambda zb, a=a, b=b: head.logits(hidden[a:b], zb), row_fn, gs, a, b)
                else:
                    # logits = h[a:b] W^T (+ b), fp32, per slice (16-bit path)
                    row_fn(head.logits(hidden[a:b], z_buf), gs, a, b)
            if lanes is not None:
                lanes.join()  # the gradient buffer is complete before dh and dW read it
            if need_dw:
                gd = g if sep else z_span
                # dh[s:e] = G W and dW (=, first buffer; +=, later) G^T h[s:e]: Head.backward
                head.backward(gd, hidden[s:e], dh[s:e], dw, db if bias is not None else None, first)
                first = False
    finally:
        if lanes is not None:  # also on an exception: see _RowLanes
            lanes.join()
    return dh, dw, db


def _low_memory(kern, weight) -> bool:
    return low_memory_for(kern, weight.numel())


def _backward_by_vocab(
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
    norm=None,
    centre=True,
):
    """The low-memory backward: per vocabulary chunk [v0, v1) of all N rows, the logits
    again (GEMM), dz from each row's saved (raw max, log s) ``norm`` (the forward's;
    without one, from the saved lse), dW[v0:v1] = dz^T h written once in the weight's dtype
    (GEMM), dh += dz W[v0:v1] in an fp32 (N, d) accumulator (GEMM; in fp32 mode the head
    centred, dz (W[v0:v1] - c): ``_Centred``; ``centre``: each row of dz sums to zero).
    Memory: the chunk (MRTPO_CHUNK_BYTES), in 16-bit mode a 16-bit gradient chunk of the
    same shape, and the fp32 dh accumulator (none for fp32)."""
    nkw = {} if norm is None else {"norm": norm}
    nkw.update(cap_kwargs(head.cap))
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden)
    cols = max(1, min(v, settings.chunk_bytes() // (4 * max(n, 1))))
    flat = hidden.new_empty(n * cols, dtype=acc)
    g16 = hidden.new_empty(n * cols) if head.low else None  # the separate 16-bit gradient
    dw = torch.empty_like(weight)
    db = hidden.new_zeros(v if bias is not None else 0, dtype=acc)
    dh32 = hidden.new_zeros(hidden.shape, dtype=acc)
    centred = _Centred(head, labels if centre else None, ignore_index, settings.chunk_bytes())
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        w_c = weight[v0:v1] if head.low else head.w[v0:v1]
        b_c = None if head.b32 is None else head.b32[v0:v1]
        # logits[:, v0:v1] = h W[v0:v1]^T (+ b), fp32, all N rows: the recompute GEMM
        z = head.logits(hidden, flat[: n * (v1 - v0)].view(n, v1 - v0), w_c, b_c)
        g = None if g16 is None else g16[: n * (v1 - v0)].view(n, v1 - v0)
        kern.grad_cols_(
            z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index, v0, v, **_out(g, 0, n), **nkw
        )
        if head.low:
            # dW[v0:v1] = G^T h, written once in the weight's dtype (fp32 inside the GEMM)
            torch.mm(g.t(), hidden, out=dw[v0:v1])
            # dh += G W[v0:v1] into the fp32 (N, d) accumulator
            _lm_head.addmm_f32(dh32, g, w_c)
        else:
            g = z
            dw[v0:v1] = g.t() @ upcast(hidden)  # dW[v0:v1] = G^T h, fp32
            centred.addmm_(dh32, g, w_c)  # dh += G (W[v0:v1] - c)
        if bias is not None:
            db[v0:v1] = g.sum(0, dtype=acc)
    return dh32.to(hidden.dtype), dw, db


class _Centred:
    """dh += G (W[v0:v1] - c) for the low-memory backward's fp32 GEMMs, c one row for the
    whole call: the mean of the head's rows at the rows' labels.

    The ops depend on the logits through their log-softmax only, so with each row's own
    entropy as the entropy term's input, each row of the logit gradient G sums to zero over
    the vocabulary and G 1 c^T = 0: centring the head
    changes no exact value. It changes the rounding. The vocabulary is split into chunks
    here, and a chunk's partial sum of G W carries every column's share of a component the
    rows of W have in common (at logits ~1e4 from a common offset, partial sums ~1e4 g:
    each chunk rounds at ulp(1e4)), and the rows of G sum to zero only up to the fp32
    rounding of p (~1e-7 each row, times that component). Taking c near where p has its mass
    removes both: the labels are the completions' tokens, sampled from the policy, so their
    rows' mean estimates the p-weighted mean of the head's rows.
    Not applied: where the caller cannot promise the zero sums (``labels`` None: the
    vocabulary-parallel shard's entropy term), under a softcap (the gradient of the raw
    logits, G times the cap's slope, does not sum to zero; a logit scale keeps the sum
    zero), in 16-bit mode (G is rounded to 16 bits for its GEMM, an error centring cannot
    remove), with no row to learn from (every label ignored or out of the vocabulary), or
    when c is not finite. The centred head is formed a block of at most ``budget`` bytes at
    a time."""

    def __init__(self, head, labels, ignore_index, budget):
        self.c = None
        self.block = None
        if labels is None or head.cap.softcap != 0.0 or head.low:
            return
        v, d = head.weight.shape
        use = (labels != ignore_index) & (labels >= 0) & (labels < v)
        idx = labels[use]
        if idx.numel() == 0:
            return
        c = head.weight.index_select(0, idx).sum(0, dtype=torch.float32) / idx.numel()
        if bool(torch.isfinite(c).all()):
            self.c = c.to(acc_dtype(head.weight))
            self.rows = max(1, budget // (4 * max(d, 1)))

    def addmm_(self, dh, g, w):
        """dh += g (w - c), in blocks of the head's rows (w: rows [v0, v1) of the head)."""
        if self.c is None:
            dh.addmm_(g, w)
            return
        n = w.shape[0]
        step = min(n, self.rows)
        if self.block is None or self.block.shape[0] < step:
            self.block = w.new_empty((step, w.shape[1]), dtype=self.c.dtype)
        for a in range(0, n, step):
            b = min(n, a + step)
            blk = torch.sub(w[a:b], self.c, out=self.block[: b - a])
            dh.addmm_(g[:, a:b], blk)
