"""Token-chunked drivers shared by the "cpu", "torch" and "triton" backends.

One plan for every backend (mrtpo_kernels/chunk_plan.py lists it without running it): the
tokens are walked in balanced gradient buffers (``grad_spans``), each filled by fp32
logits chunks of at most chunk_rows(V) rows (``MRTPO_CHUNK_BYTES``): one BLAS GEMM makes a
chunk's fp32 logits, a row kernel streams the reductions over them and, for gradients,
writes dL/dlogits, into a separate 16-bit buffer of grad_rows(V) rows
(``MRTPO_GRAD_BUFFER_BYTES``; kernels with GRAD_OUT, 16-bit inputs, 16-bit GEMMs with fp32
output on the device) or in place over the fp32 logits (the buffer is then the logits
block); then dh = G W and dW = G^T h (the first buffer writes dW, the others accumulate)
run once per buffer, K = its rows. Extra memory is the logits chunk and the gradient buffer
(plus an fp32 copy of the weight when the GEMMs run in fp32 on 16-bit inputs, and the fp32
weight-gradient accumulator), never O(N x V).

GEMMs (N d V multiply-adds each over the call):
    log-probs forward 1; log-probs backward 3 (recompute, dH, dW), 2 for the last rows of
    the call, whose logits the forward keeps (MRTPO_KEEP_LOGITS_BYTES, see kept_rows; the
    kept block also sets the GEMM span of the other rows, see logprobs_spans);
    policy loss (forward with gradient) 3; JS one-vs-K 1 + K (stacked into one GEMM per
    token chunk where the kernel has js_many).

The row kernel ``kern`` a backend binds these drivers to follows ``contract.RowKernel``
(backends/contract.py): its methods see contiguous fp32 chunks of logits, and its
optional abilities (GRAD_OUT, JS_MANY, GRAD_COLS, NORM) are flags the drivers read.
The linear ops' logit transform (``LogitCap``: logit scaling, final-logit softcapping) is
applied by the Head to each chunk right after its GEMM (kept logits included), so the row
kernels read the transformed logits z; the gradient kernels get the cap's keywords
(``cap_kwargs``) and multiply their dL/dz by the slope dz/dr in the same pass. The LM
head's GEMMs are in _lm_head.py, what the log-probs forward keeps for its backward in
_saved_state.py; this module walks the tokens (and, in low-memory mode, the vocabulary).
"""

from __future__ import annotations

import torch

from .. import settings
from .._types import LogitCap, acc_dtype
from . import _lm_head
from ._lm_head import Head, apply_logit_cap_, cap_kwargs, fp32_logits, upcast
from ._saved_state import kept_from, kept_rows, low_memory_for, norm_buffer, norm_rows, takes_norm

# The public ops these drivers implement (entry points: mrtpo_kernels/_catalog.py).
CHUNK_DRIVEN_OPS = (
    "linear_logprobs",
    "logprobs_from_logits",
    "linear_js_distance",
    "js_distance",
    "linear_policy_loss",
)


def chunk_rows(vocab: int, streams: int = 1) -> int:
    """Rows per chunk so that ``streams`` fp32 [rows, vocab] chunks fit the budget."""
    return max(1, settings.chunk_bytes() // (4 * max(vocab, 1) * streams))


def grad_rows(vocab: int, elt: int = 2) -> int:
    """Rows of the separate 16-bit gradient buffer (MRTPO_GRAD_BUFFER_BYTES), at least one
    logits chunk."""
    return max(chunk_rows(vocab), settings.grad_buffer_bytes() // (elt * max(vocab, 1)))


def js_chunk_rows(vocab: int, k: int) -> int:
    """Tokens per chunk of the stacked JS GEMM: (1 + K) fp32 rows of V per token in the
    JS scratch budget (MRTPO_JS_SCRATCH_BYTES)."""
    return max(1, settings.js_scratch_bytes() // (4 * max(vocab, 1) * (1 + k)))


def balanced(n: int, cap: int, start: int = 0) -> list[tuple[int, int]]:
    """[start, start + n) in the fewest spans of at most ``cap`` rows, their sizes equal
    to within one row (no small tail)."""
    if n <= 0:
        return []
    parts = -(-n // max(cap, 1))
    q, r = divmod(n, parts)
    out, s = [], start
    for i in range(parts):
        e = s + q + (i < r)
        out.append((s, e))
        s = e
    return out


def grad_spans(n: int, v: int, kept: int, separate: bool) -> list[tuple[int, int, bool]]:
    """The gradient buffers of a backward, in the order they run: (start, end, from_kept).

    One buffer's rows get their logit gradient by row-kernel slices (``balanced(e - s,
    chunk_rows(v), s)``), then dh and dW run once for the whole buffer (K = e - s).
    ``separate``: a 16-bit gradient buffer apart from the fp32 logits chunk (the Triton row
    kernels with 16-bit GEMMs), of grad_rows(v) rows; otherwise the gradient overwrites the
    fp32 logits in place and the buffer is the logits chunk itself (chunk_rows(v) rows).
    The ``kept`` last rows of the call (whose logits the log-probs forward kept) come first;
    their logits are read, never written (in place mode copies them into the chunk)."""
    cap = grad_rows(v) if separate else chunk_rows(v)
    first = [(s, e, True) for s, e in balanced(kept, cap, n - kept)]
    return first + [(s, e, False) for s, e in balanced(n - kept, cap)]


def _buffer(rows: int, n: int, v: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((min(rows, n), v), dtype=dtype, device=like.device)


def _out(g, a, b) -> dict:
    """The kernel's ``out=`` for rows [a, b) of a separate gradient buffer g, or none (the
    gradient in place)."""
    return {} if g is None else {"out": g[a:b]}


def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


def logprobs_spans(n: int, v: int, k: int) -> list[tuple[int, int]]:
    """The forward GEMM spans of the first n - k rows (the last k are kept): balanced, at
    most max(chunk_rows, k) rows each, so that a kept block also makes the GEMMs of the
    other rows larger (fewer passes over W). The row kernels still run on slices of at
    most chunk_rows rows."""
    return balanced(n - k, max(chunk_rows(v), k))


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
):
    """(dh, dW, db); ``saved``: the forward's fourth output (or None: recompute all)."""
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


class _RowLanes:
    """MRTPO_OVERLAP_ROWS=1 on a CUDA device (16-bit GEMM path): each chunk's row kernel runs
    on a side stream while the current stream's GEMM makes the next chunk's logits into the
    other of two fp32 chunk buffers (one chunk buffer more of memory, counted in
    ``chunk_plan``'s buffer_bytes). Used by the backward and the policy loss
    (``_run_backward``) and by the log-probs forward's statistics. Ordering, by events: a
    chunk's row kernel waits for its logits GEMM (and so for all earlier work of the current
    stream: its inputs, and the dh / dW GEMMs that read the gradient buffer it writes); a
    GEMM into a buffer waits for the row kernel that last read it; ``join`` makes the
    current stream wait for every row kernel (before dh / dW, and before returning, so the
    outputs the row kernels write are ready for the caller's stream).

    Errors: the callers join in a ``finally``, so an exception between a side-stream row
    kernel and the join (a failing GEMM, a row kernel's launch, anything in between) still
    makes the current stream wait for the side stream before the exception leaves the
    driver: a buffer freed on the way out can only be reused by work ordered after every
    pending row kernel. The buffers the side stream reads or writes that the driver made on
    the current stream (the two chunk buffers, the gradient buffer's rows) are also marked
    with ``record_stream``, so the caching allocator holds them until the side stream's
    work on them is done, whichever stream asks for the memory next.
    JS is not covered: its chunk is the stacked (1 + K) C rows of a 768 MiB scratch, and a
    second one would pass the 1 GB target."""

    def __init__(self, z_buf, hidden):
        self.bufs = [z_buf, torch.empty_like(z_buf)]
        self.main = torch.cuda.current_stream(hidden.device)
        self.side = torch.cuda.Stream(device=hidden.device)
        self.free = [None, None]  # per buffer: the event after the row kernel that read it
        self.turn = 0
        for buf in self.bufs:
            buf.record_stream(self.side)

    @staticmethod
    def enabled(wanted: bool, hidden) -> bool:
        """Whether to overlap: ``wanted`` (the 16-bit GEMM path) on a CUDA device with
        MRTPO_OVERLAP_ROWS=1 (read at each call)."""
        return bool(wanted) and hidden.is_cuda and settings.overlap_rows()

    def run(self, logits_into, row_fn, g, a, b):
        """logits_into(buffer) on the current stream into the next of the two buffers, then
        row_fn(z, g, a, b) on the side stream (``on_side``)."""
        j = self.turn
        self.turn ^= 1
        if self.free[j] is not None:
            self.main.wait_event(self.free[j])
        z = logits_into(self.bufs[j])
        self.free[j] = self.on_side(row_fn, z, g, a, b)

    def on_side(self, row_fn, z, g, a, b):
        """row_fn(z, g, a, b) on the side stream after everything the current stream has
        queued so far; returns the event recorded after it."""
        ready = torch.cuda.Event()
        ready.record(self.main)
        if g is not None:
            g.record_stream(self.side)  # rows of the driver's gradient buffer
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            row_fn(z, g, a, b)
            done = torch.cuda.Event()
            done.record(self.side)
        return done

    def join(self):
        self.main.wait_stream(self.side)


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
):
    """The low-memory backward: per vocabulary chunk [v0, v1) of all N rows, the logits
    again (GEMM), dz from each row's saved (raw max, log s) ``norm`` (the forward's;
    without one, from the saved lse), dW[v0:v1] = dz^T h written once in the weight's dtype
    (GEMM), dh += dz W[v0:v1] in an fp32 (N, d) accumulator (GEMM).
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
            dh32.addmm_(g, w_c)  # dh += G W[v0:v1]
        if bias is not None:
            db[v0:v1] = g.sum(0, dtype=acc)
    return dh32.to(hidden.dtype), dw, db


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


def linear_policy_loss(
    kern,
    hidden,
    weight,
    bias,
    labels,
    old_logp,
    advantages,
    token_weight,
    ref_logp,
    cfg,
    need_grad,
):
    """(loss, logp, clipped, dh, dw, db): the clipped-surrogate loss sum_t token_weight[t]
    L_t and, with need_grad, its gradient in the same pass; ``cfg`` the op's scalar
    settings (``PolicyLossSettings``), handed to the row kernel as they are."""
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    head = Head(kern, hidden, weight, bias, cfg.logit_cap)
    ref_logp = _none_if_empty(ref_logp)
    if need_grad and _low_memory(kern, weight):
        return _policy_by_vocab(
            kern,
            head,
            hidden,
            weight,
            bias,
            labels,
            old_logp,
            advantages,
            token_weight,
            ref_logp,
            cfg,
        )
    logp = hidden.new_empty(n, dtype=acc)
    clipped = hidden.new_empty(n, dtype=acc)
    loss = hidden.new_zeros((), dtype=acc)

    def rows(z, g, a, b):  # the token terms and, with need_grad, dL/dz in place or into g
        per_tok, lp, cl = kern.policy_(
            z,
            labels[a:b],
            old_logp[a:b],
            advantages[a:b],
            token_weight[a:b],
            None if ref_logp is None else ref_logp[a:b],
            cfg,
            need_grad,
            **_out(g, 0, b - a),
        )
        loss.add_((per_tok * token_weight[a:b]).sum())
        logp[a:b] = lp
        clipped[a:b] = cl

    spans = grad_spans(n, v, 0, head.low and need_grad)
    dh, dw, db = _run_backward(
        head, hidden, weight, bias, spans, None, 0, rows, chunk_rows(v), need_dw=need_grad
    )
    return loss, logp, clipped, dh, dw, db


def _policy_by_vocab(
    kern, head, hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp, cfg
):
    """Low-memory policy loss: the log-probs and lse by token chunks (1 GEMM), the token
    terms from them, then the vocabulary-chunked backward (3 GEMMs: one is a recompute)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden)
    inv_t, ignore_index = 1.0 / cfg.temperature, cfg.ignore_index
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    norm = norm_buffer(kern, n, hidden) if n else None  # (raw max, log s) per row
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s, e in balanced(n, c):
        # logits = h[s:e] W^T (+ b), fp32: the forward's one GEMM per token chunk
        z = head.logits(hidden[s:e], buf)
        lp, _, ls = kern.stats(z, labels[s:e], inv_t, ignore_index, False, **norm_rows(norm, s, e))
        logp[s:e] = lp
        lse[s:e] = ls
    del buf
    per_tok, clipped, g = kern.policy_terms(
        logp, labels, old_logp, advantages, token_weight, ref_logp, v, cfg
    )
    loss = (per_tok * token_weight).sum()
    dh, dw, db = _backward_by_vocab(
        kern, head, hidden, weight, bias, labels, lse, None, g, None, inv_t, ignore_index, norm
    )  # the head's cap: the slope in its grad_cols_
    return loss, logp, clipped, dh, dw, db
