"""Token-chunked drivers shared by the "cpu", "torch" and "triton" backends.

One plan for every backend (mrtpo_kernels/stages.py lists it without running it): the
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
(backends/contract.py): its methods see contiguous fp32 chunks of raw logits, and its
optional abilities (GRAD_OUT, JS_MANY, GRAD_COLS, NORM) are flags the drivers read.
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


# --------------------------------------------------------------------------- 16-bit GEMMs

_LOW = (torch.bfloat16, torch.float16)
_F32_OUT: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = a @ b for 16-bit a, b with fp32 accumulation and output."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def _addmm_f32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c (fp32) += a @ b for 16-bit a, b, in place, fp32 accumulation."""
    return torch.addmm(c, a, b, out_dtype=torch.float32, out=c)


def f32_out_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm / torch.addmm take 16-bit operands with out_dtype=float32 on this
    device (torch 2.9+ on CUDA; not on CPU): tried once on tiny tensors, checked against
    an fp32 product, cached."""
    key = (device.type, device.index, dtype)
    if key not in _F32_OUT:
        ok = False
        try:
            a = torch.arange(6, device=device).reshape(2, 3).to(dtype)
            b = torch.arange(12, device=device).reshape(3, 4).to(dtype) - 5
            want = a.float() @ b.float()
            out = torch.empty(2, 4, device=device)
            ok = torch.equal(_mm_f32(a, b, out), want)
            _addmm_f32(out, a, b)
            ok = ok and torch.equal(out, 2 * want)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _F32_OUT[key] = ok
    return _F32_OUT[key]


class _Head:
    """The LM head's GEMMs for one call. 16-bit mode (the kernel has GRAD_OUT, the inputs
    are 16-bit and the device has out_dtype): the weight is used as it is, logits come out
    in fp32, and the kernel writes each row's logit gradient into a separate 16-bit
    gradient buffer (``grad_buffer``), the operand of the dh and dW GEMMs. Otherwise fp32
    operands (the weight upcast once when it is not fp32) and the gradient overwrites the
    fp32 logits in place."""

    def __init__(self, kern, hidden, weight, bias):
        dt = hidden.dtype
        self.low = kern.GRAD_OUT and dt in _LOW and f32_out_supported(hidden.device, dt)
        self.dtype = dt
        self.w = weight if self.low else _upcast(weight)
        self.b32 = _upcast(bias)

    def logits(self, h, buf, w=None, b32=None):
        """fp32 logits of rows h into buf[:rows] (columns of w, default the whole head)."""
        w = self.w if w is None else w
        b32 = self.b32 if b32 is None else b32
        if not self.low:
            return _logits(h, w, b32, buf)
        out = buf[: h.shape[0]]
        _mm_f32(h, w.t(), out)
        if b32 is not None:
            out += b32
        return out

    def grad_buffer(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
        """The separate 16-bit gradient buffer (rows, cols) in 16-bit mode, else None (the
        gradient is written over the fp32 logits)."""
        if not self.low:
            return None
        return like.new_empty((rows, cols), dtype=self.dtype)

    def backward(self, g, h, dh_rows, dw, db, first):
        """dh_rows = g W (in hidden's dtype) and dw = g^T h for the first gradient buffer of
        the call, dw += g^T h after it (fp32, accumulated inside the GEMM); db += column
        sums of g."""
        if self.low:
            torch.mm(g, self.w, out=dh_rows)
            if first:
                _mm_f32(g.t(), h, dw)
            else:
                _addmm_f32(dw, g.t(), h)
            if db is not None:
                db += g.sum(0, dtype=db.dtype)
            return
        h32 = _upcast(h)
        if dh_rows.dtype == g.dtype:
            torch.mm(g, self.w, out=dh_rows)
        else:
            dh_rows.copy_(g @ self.w)
        if first:
            torch.mm(g.t(), h32, out=dw)
        else:
            dw.addmm_(g.t(), h32)
        if db is not None:
            db += g.sum(0)


def gemm_path(kern, device: torch.device, dtype: torch.dtype) -> str:
    """Which GEMMs the driver runs for ``kern`` on ``dtype`` inputs on ``device``:
    "16-bit, fp32 out" (the weight as it is, 16-bit gradient buffer), "fp32" (fp32 or
    float64 inputs, or a kernel without GRAD_OUT) or "fp32 fallback" (16-bit inputs and a
    kernel with GRAD_OUT, but torch has no out_dtype GEMM on the device: an fp32 copy of the
    weight and fp32 GEMMs, several times slower on a GPU)."""
    if dtype in _LOW and kern.GRAD_OUT:
        return "16-bit, fp32 out" if f32_out_supported(device, dtype) else "fp32 fallback"
    return "fp32"


def _out(g, a, b) -> dict:
    """The kernel's ``out=`` for rows [a, b) of a separate gradient buffer g, or none (the
    gradient in place)."""
    return {} if g is None else {"out": g[a:b]}


def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


# --------------------------------------------------------------------------- saved state
# What the log-probs backward needs from its forward travels as the forward's fourth
# output, ``saved`` (the op saves it for the backward, mrtpo_kernels/logprobs.py), a flat fp32
# tensor whose size says what it holds (saved_numel: the same rule for the op's fake):
#   fast mode      the fp32 logits of the call's last kept_rows(n, V) rows, (k, V)
#                  row-major: the backward takes them first and needs no recompute there
#                  (in place mode overwrites them with the gradient: the op declares the
#                  mutation, so a second backward of the same graph sees a new version and
#                  passes no state, recomputing every row)
#   low-memory     each row's raw max M and log s, (2, n), for the column kernel (kernels
#                  that take ``norm=``), so log p never comes from the rounded lse
#   otherwise      empty: the backward recomputes every row


def kept_rows(n: int, v: int) -> int:
    """Rows of fp32 logits the log-probs forward keeps for its backward (the last ones)."""
    return min(n, settings.keep_logits_bytes() // (4 * max(v, 1)))


def logprobs_spans(n: int, v: int, k: int) -> list[tuple[int, int]]:
    """The forward GEMM spans of the first n - k rows (the last k are kept): balanced, at
    most max(chunk_rows, k) rows each, so that a kept block also makes the GEMMs of the
    other rows larger (fewer passes over W). The row kernels still run on slices of at
    most chunk_rows rows."""
    return balanced(n - k, max(chunk_rows(v), k))


def saved_numel(kern, op: str, n: int, v: int, weight_numel: int) -> int:
    """Elements of the log-probs forward's ``saved`` output for public op ``op`` (only
    linear_logprobs saves anything), this kernel and shape (``contract.Backend``)."""
    if op != "linear_logprobs":
        return 0
    if _low_memory_for(kern, weight_numel):
        return 2 * n if _takes_norm(kern) else 0
    return kept_rows(n, v) * v


def _kept_from(saved, n: int, v: int):
    """(kept logits (k, V) or None, k) from a fast-mode ``saved``; none for an empty or a
    foreign one (a size that is not whole rows of at most n)."""
    if saved is None or saved.numel() == 0 or v == 0 or saved.numel() % v:
        return None, 0
    k = saved.numel() // v
    return (saved.view(k, v), k) if k <= n else (None, 0)


def _takes_norm(kern) -> bool:
    """Whether the kernel's stats and grad_cols_ take ``norm=`` (``RowKernel.NORM``)."""
    return kern.NORM


def _norm_buffer(kern, n, like) -> torch.Tensor | None:
    """A (2, n) fp32 buffer for stats(..., norm=) where the kernel takes one, else None."""
    return like.new_empty((2, n), dtype=torch.float32) if _takes_norm(kern) else None


def _norm_rows(norm, a, b) -> dict:
    """stats' keyword for rows [a, b): the column slice of the (2, N) buffer, or none."""
    return {} if norm is None else {"norm": norm[:, a:b]}


def linear_logprobs_fwd(kern, hidden, weight, bias, labels, temperature, ignore_index, with_ent):
    """(logp, entropy, lse, saved): ``saved`` is what the backward needs (above)."""
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    head = _Head(kern, hidden, weight, bias)
    inv_t = 1.0 / temperature
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    ent = hidden.new_empty(n if with_ent else 0, dtype=acc)
    c = chunk_rows(v)
    low = _low_memory(kern, weight)
    k = 0 if low else kept_rows(n, v)
    # low-memory mode: each row's (raw max, log s) for the column kernel of the backward
    saved = hidden.new_empty(2 * n if low and _takes_norm(kern) else k * v, dtype=acc)
    norm = saved.view(2, n) if low and _takes_norm(kern) else None
    spans = logprobs_spans(n, v, k)
    span_rows = max([0] + [e - s for s, e in spans])
    kept = saved.view(k, v) if not low else saved[:0].view(0, v)
    # the kept block doubles as the buffer of the spans before it where it is large enough
    buf = kept if k >= span_rows else _buffer(span_rows, n, v, hidden, acc)

    def stats(z, s, e):  # the kernel on slices of at most c rows of the span's logits z
        for a, b in balanced(e - s, c, s):
            lp, en, ls = kern.stats(
                z[a - s : b - s], labels[a:b], inv_t, ignore_index, with_ent,
                **_norm_rows(norm, a, b),
            )  # fmt: skip
            logp[a:b] = lp
            lse[a:b] = ls
            if with_ent:
                ent[a:b] = en

    for s, e in spans:
        stats(head.logits(hidden[s:e], buf), s, e)
    del buf
    if k:
        stats(head.logits(hidden[n - k :], kept), n - k, n)  # one GEMM for the kept rows
    return logp, ent, lse, saved  # the base, not a view (the backward may write it)


def linear_logprobs_bwd(
    kern, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, temperature, ignore_index,
    saved=None,
):  # fmt: skip
    """(dh, dW, db); ``saved``: the forward's fourth output (or None: recompute all)."""
    n, v = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    head = _Head(kern, hidden, weight, bias)
    if _low_memory(kern, weight):
        norm = None
        if saved is not None and saved.numel() == 2 * n and _takes_norm(kern):
            norm = saved.view(2, n)
        return _backward_by_vocab(
            kern, head, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, inv_t,
            ignore_index, norm,
        )  # fmt: skip
    kept, k = _kept_from(saved, n, v)
    spans = grad_spans(n, v, k, head.low)

    def grad(z, g, a, b):  # the kernel on rows [a, b): dL/dz in place, or into g
        kern.grad_(
            z, labels[a:b], lse[a:b], None if ent is None else ent[a:b], g_logp[a:b],
            None if g_ent is None else g_ent[a:b], inv_t, ignore_index, **_out(g, 0, b - a),
        )  # fmt: skip

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
    first = True
    for s, e, from_kept in spans:
        z_span = None
        if from_kept:
            z_span = kept[s - (n - k) : e - (n - k)]
            if not sep:  # in place: the gradient must not overwrite the forward's output
                z_span = z_buf[: e - s].copy_(z_span)
        elif not sep:
            z_span = head.logits(hidden[s:e], z_buf)
        g = None if g_buf is None else g_buf[: e - s]
        for a, b in balanced(e - s, c, s):
            z = z_span[a - s : b - s] if z_span is not None else head.logits(hidden[a:b], z_buf)
            row_fn(z, None if g is None else g[a - s : b - s], a, b)
        if need_dw:
            gd = g if sep else z_span
            head.backward(gd, hidden[s:e], dh[s:e], dw, db if bias is not None else None, first)
            first = False
    return dh, dw, db


def _low_memory(kern, weight) -> bool:
    return _low_memory_for(kern, weight.numel())


def _low_memory_for(kern, weight_numel: int) -> bool:
    return kern.GRAD_COLS and settings.low_memory(4 * weight_numel)


def _backward_by_vocab(kern, head, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, inv_t,
                       ignore_index, norm=None):  # fmt: skip
    """The low-memory backward: per vocabulary chunk [v0, v1) of all N rows, the logits
    again (GEMM), dz from each row's saved (raw max, log s) ``norm`` (the forward's;
    without one, from the saved lse), dW[v0:v1] = dz^T h written once in the weight's dtype
    (GEMM), dh += dz W[v0:v1] in an fp32 (N, d) accumulator (GEMM).
    Memory: the chunk (MRTPO_CHUNK_BYTES), in 16-bit mode a 16-bit gradient chunk of the
    same shape, and the fp32 dh accumulator (none for fp32)."""
    nkw = {} if norm is None else {"norm": norm}
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
        z = head.logits(hidden, flat[: n * (v1 - v0)].view(n, v1 - v0), w_c, b_c)
        g = None if g16 is None else g16[: n * (v1 - v0)].view(n, v1 - v0)
        kern.grad_cols_(z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index, v0, v,
                        **_out(g, 0, n), **nkw)  # fmt: skip
        if head.low:
            torch.mm(g.t(), hidden, out=dw[v0:v1])  # fp32 accumulation inside the GEMM
            _addmm_f32(dh32, g, w_c)
        else:
            g = z
            dw[v0:v1] = g.t() @ _upcast(hidden)
            dh32.addmm_(g, w_c)
        if bias is not None:
            db[v0:v1] = g.sum(0, dtype=acc)
    return dh32.to(hidden.dtype), dw, db


def linear_js_distance(kern, hidden_p, hidden_q, weight, bias, temperature):
    acc = acc_dtype(hidden_p)
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    v = weight.shape[0]
    if kern.JS_MANY:
        return _js_stacked(kern, hidden_p, hidden_q, weight, bias, temperature)
    w32, b32 = _upcast(weight), _upcast(bias)
    inv_t = 1.0 / temperature
    out = hidden_p.new_empty((k, n), dtype=acc)
    c = chunk_rows(v, streams=2)
    buf_p = _buffer(c, n, v, hidden_p, acc)
    buf_q = _buffer(c, n, v, hidden_p, acc)
    for s, e in balanced(n, c):
        zp = _logits(hidden_p[s:e], w32, b32, buf_p)  # P's logits: once per chunk, for all K
        lse_p = None
        for j in range(k):
            zq = _logits(hidden_q[j, s:e], w32, b32, buf_q)
            d, lse_p = kern.js(zp, zq, inv_t, lse_p)
            out[j, s:e] = d
    return out


def _js_stacked(kern, hidden_p, hidden_q, weight, bias, temperature):
    """Per chunk of C tokens: the 1 + K streams' hidden rows stacked (P first) into one
    (1 + K) C x d operand, one GEMM into an fp32 scratch of (1 + K) C x V (C sized so it
    fits MRTPO_JS_SCRATCH_BYTES), then kern.js_many for the K distances."""
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    d, v = hidden_p.shape[1], weight.shape[0]
    acc = acc_dtype(hidden_p)
    out = hidden_p.new_empty((k, n), dtype=acc)
    if n == 0 or k == 0:
        return out
    head = _Head(kern, hidden_p, weight, bias)
    streams = 1 + k
    c = min(n, js_chunk_rows(v, k))
    a_buf = hidden_p.new_empty(streams * c * d)
    z_buf = hidden_p.new_empty(streams * c * v, dtype=acc)
    for s, e in balanced(n, c):
        rows = e - s
        a = a_buf[: streams * rows * d].view(streams, rows, d)
        a[0].copy_(hidden_p[s:e])
        a[1:].copy_(hidden_q[:, s:e])
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
        z = _upcast(logits[s:e]).contiguous()
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
    clip_ratio_c=float("inf"),
    kl_iw=False,
):
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    head = _Head(kern, hidden, weight, bias)
    inv_t = 1.0 / temperature
    ref_logp = _none_if_empty(ref_logp)
    if need_grad and _low_memory(kern, weight):
        return _policy_by_vocab(
            kern, head, hidden, weight, bias, labels, old_logp, adv, token_weight, ref_logp,
            inv_t, clip_low, clip_high, beta, ignore_index, clip_ratio_c, kl_iw,
        )  # fmt: skip
    logp = hidden.new_empty(n, dtype=acc)
    clipped = hidden.new_empty(n, dtype=acc)
    loss = hidden.new_zeros((), dtype=acc)

    def rows(z, g, a, b):  # the token terms and, with need_grad, dL/dz in place or into g
        per_tok, lp, cl = kern.policy_(
            z, labels[a:b], old_logp[a:b], adv[a:b], token_weight[a:b],
            None if ref_logp is None else ref_logp[a:b], inv_t, clip_low, clip_high, beta,
            ignore_index, need_grad, clip_ratio_c=clip_ratio_c, kl_iw=kl_iw,
            **_out(g, 0, b - a),
        )  # fmt: skip
        loss.add_((per_tok * token_weight[a:b]).sum())
        logp[a:b] = lp
        clipped[a:b] = cl

    spans = grad_spans(n, v, 0, head.low and need_grad)
    dh, dw, db = _run_backward(
        head, hidden, weight, bias, spans, None, 0, rows, chunk_rows(v), need_dw=need_grad
    )
    return loss, logp, clipped, dh, dw, db


def _policy_by_vocab(kern, head, hidden, weight, bias, labels, old, adv, tw, ref, inv_t,
                     clip_low, clip_high, beta, ii, clip_ratio_c, kl_iw):  # fmt: skip
    """Low-memory policy loss: the log-probs and lse by token chunks (1 GEMM), the token
    terms from them, then the vocabulary-chunked backward (3 GEMMs: one is a recompute)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden)
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    norm = _norm_buffer(kern, n, hidden) if n else None  # (raw max, log s) per row
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s, e in balanced(n, c):
        z = head.logits(hidden[s:e], buf)
        lp, _, ls = kern.stats(z, labels[s:e], inv_t, ii, False, **_norm_rows(norm, s, e))
        logp[s:e] = lp
        lse[s:e] = ls
    del buf
    per_tok, clipped, g = kern.policy_terms(
        logp, labels, old, adv, tw, ref, v, clip_low, clip_high, beta, ii, clip_ratio_c, kl_iw
    )
    loss = (per_tok * tw).sum()
    dh, dw, db = _backward_by_vocab(
        kern, head, hidden, weight, bias, labels, lse, None, g, None, inv_t, ii, norm
    )
    return loss, logp, clipped, dh, dw, db
