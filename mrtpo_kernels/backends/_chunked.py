"""Token-chunked drivers shared by the "cpu", "torch" and "triton" backends.

The backends walk the tokens in chunks of C rows sized from a memory budget
(``MRTPO_CHUNK_BYTES``, see mrtpo_kernels/settings.py): one BLAS GEMM makes the
chunk's fp32 logits [C, V], then a chunk kernel streams the reductions over them and, for
gradients, overwrites them in place with dL/dlogits, which two more GEMMs turn into the
gradients of hidden and weight. Extra memory is O(C x V) (plus an fp32 copy of the weight
when it is not fp32, and the fp32 weight-gradient accumulator), never O(N x V).

GEMM count per chunk (N d V multiply-adds each):
    log-probs forward 1; log-probs backward 3 (recompute, dH, dW), 2 for the last rows of
    the call, whose logits the forward keeps (MRTPO_KEEP_LOGITS_BYTES, see kept_rows; the
    kept block also sets the GEMM span of the other rows, see logprobs_spans);
    policy loss (forward with gradient) 3; JS one-vs-K 1 + K.

A chunk kernel ``kern`` provides:
    stats(z, labels, inv_temp, ignore_index, with_entropy) -> (logp, entropy|None, lse)
    grad_(z, labels, lse, entropy|None, g_logp, g_entropy|None, inv_temp, ignore_index)
    js(zp, zq, inv_temp, lse_p|None) -> (d, lse_p)
    policy_(z, labels, old, adv, token_weight, ref|None, inv_temp, clip_low, clip_high,
            beta, ignore_index, need_grad, clip_ratio_c=inf, kl_iw=False)
        -> (per_token_loss, logp, clipped)
        (clip_ratio_c: the dual clip, inf for none; kl_iw: the KL term times the ratio)
where z is a contiguous fp32 chunk of raw logits (before the temperature).

Optional, where a kernel has them (the Triton row kernels, mrtpo_kernels/triton/rows.py):
    GRAD_OUT = True: grad_ and policy_ take ``out=``, where the driver passes a 16-bit view
        of z's own storage (row stride 2 V), so that with 16-bit inputs the two gradient
        GEMMs run on 16-bit operands; the logits GEMM then writes fp32 from 16-bit
        operands (torch.mm's out_dtype, checked on the device at run time) and no fp32
        copy of the weight is made. Without out_dtype the driver upcasts as for the others.
    js_many(z (1 + K, C, V), inv_temp) -> (K, C): JS one-vs-many on the stacked rows of one
        GEMM (1 GEMM of (1 + K) C rows per chunk instead of 1 + K); the C++ kernels
        (cpu backend) have it too.
    grad_cols_(z, labels, lse, entropy|None, g_logp, g_entropy|None, inv_temp,
        ignore_index, v_lo, V, out=None) and policy_terms(logp, labels, old, adv, tw, ref|None,
        V, clip_low, clip_high, beta, ignore_index, clip_ratio_c, kl_iw)
        -> (per_token_loss, clipped, g): the low-memory mode (settings.low_memory): the
        backward walks vocabulary chunks of all N rows, each dW row block finished in one
        chunk and written in the weight's dtype (no fp32 dW accumulator), dh accumulated in
        fp32; 2 GEMMs per chunk plus the forward's, i.e. one GEMM more (a recompute).
    stats(..., norm=) and grad_cols_(..., norm=) (the Triton row kernels; declared by
        ``NORM = True``, as ``GRAD_OUT``): stats writes each row's raw max M and log s into
        ``norm``, the column slice [:, a:b] of one (2, N) fp32 buffer, and grad_cols_
        forms log p = (z/2 - M/2)(2/tau) - log s from it instead of z / tau - lse from the
        rounded fp32 lse (ulp(lse) / 2 off in every log p: 5e-4 at |z / tau| ~ 1e4, NaN
        past float max). The low-memory drivers use it where the kernel has it: the policy
        loss passes its buffer on; the log-probs forward files it under lse (_file_norm)
        for the backward, as the kept logits below.
"""

from __future__ import annotations

import weakref

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


def js_chunk_rows(vocab: int, k: int) -> int:
    """Tokens per chunk of the stacked JS GEMM: (1 + K) fp32 rows of V per token in the
    JS scratch budget (MRTPO_JS_SCRATCH_BYTES)."""
    return max(1, settings.js_scratch_bytes() // (4 * max(vocab, 1) * (1 + k)))


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
    in fp32, the gradient of each chunk is a 16-bit view of the chunk buffer. Otherwise
    fp32 operands (the weight upcast once when it is not fp32)."""

    def __init__(self, kern, hidden, weight, bias):
        dt = hidden.dtype
        self.low = (
            getattr(kern, "GRAD_OUT", False) and dt in _LOW and f32_out_supported(hidden.device, dt)
        )
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

    def grad_view(self, z):
        """The tensor the kernel writes the gradient into: a 16-bit view of z's storage
        (row stride 2 V) in 16-bit mode, else z itself."""
        return z.view(self.dtype)[:, : z.shape[1]] if self.low else z

    def backward(self, g, h, dh_rows, dw, db):
        """dh_rows = g W (written in hidden's dtype) and dw += g^T h (fp32 accumulator)."""
        if self.low:
            g = _strided16(g)
            torch.mm(g, self.w, out=dh_rows)
            _addmm_f32(dw, g.t(), h)
            if db is not None:
                db += g.sum(0, dtype=db.dtype)
            return
        h32 = _upcast(h)
        dh_rows.copy_(g @ self.w)
        dw.addmm_(g.t(), h32)
        if db is not None:
            db += g.sum(0)


def _strided16(g: torch.Tensor) -> torch.Tensor:
    """The 16-bit gradient view (row stride 2 V) as a GEMM operand. torch's CPU bf16 GEMM
    (2.13, x86 with AVX512-BF16) reads past the V columns of a row-strided operand for
    some row counts (33 rows: NaN from the buffer's other half), so on the CPU, where this
    path runs only when tests emulate out_dtype GEMMs, the view is copied first; CUDA
    GEMMs take the strided view as it is."""
    return g.contiguous() if g.device.type == "cpu" and not g.is_contiguous() else g


def _kern_out(kern, head, z):
    """Keyword arguments that route a kernel's gradient into head.grad_view(z)."""
    return {"out": head.grad_view(z)} if head.low else {}


def _none_if_empty(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


# --------------------------------------------------------------------------- kept logits
# The log-probs forward keeps the fp32 logits of the call's last kept_rows(n, V) rows for
# its backward. The custom op's contract passes no extra tensor, so they are filed under
# the forward's lse output (its data pointer): lse is saved for the backward, so the entry
# lives exactly as long as that autograd graph; a finalizer on lse's storage drops it when
# lse is freed (at once after a no-grad call, or after the backward). A backward that
# finds no entry (lse from elsewhere, a second backward) recomputes every row.

_KEPT: dict[int, tuple] = {}


def kept_rows(n: int, v: int) -> int:
    """Rows of fp32 logits the log-probs forward keeps for its backward (the last ones)."""
    return min(n, settings.keep_logits_bytes() // (4 * max(v, 1)))


def logprobs_spans(n: int, v: int, k: int) -> list[tuple[int, int]]:
    """The GEMM spans of the first n - k rows (the last k are kept): balanced, at most
    max(chunk_rows, k) rows each, so that a kept block also makes the GEMMs of the other
    rows larger (fewer passes over W and the fp32 dW). The row kernels still run on
    slices of at most chunk_rows rows."""
    m = n - k
    if m <= 0:
        return []
    parts = -(-m // max(chunk_rows(v), k))
    step = -(-m // parts)
    return [(s, min(m, s + step)) for s in range(0, m, step)]


def _inputs_ident(hidden, weight) -> tuple:
    """What an entry filed under lse belongs to: the forward's input and weight."""
    return (hidden.data_ptr(), weight.data_ptr(), tuple(hidden.shape))


def _file_kept(lse, hidden, weight, region, k):
    key = lse.data_ptr()
    _KEPT[key] = (_inputs_ident(hidden, weight), region, k)
    weakref.finalize(lse.untyped_storage(), _KEPT.pop, key, None)


def _take_kept(lse, hidden, weight):
    """(region, k) filed by the forward that returned lse, or (None, 0); taken once."""
    entry = _KEPT.pop(lse.data_ptr(), None) if lse.numel() else None
    if entry is None or entry[0] != _inputs_ident(hidden, weight):
        return None, 0
    return entry[1], entry[2]


# The low-memory forward's (2, N) norm buffer (raw row max, log s) for its backward is
# filed under lse the same way (only where the kernel takes norm=, see _takes_norm), with
# the input, weight and temperature it belongs to. The backward reads it without taking it
# (it is not overwritten: a second backward of the same graph uses it too); one that finds
# none, or one for other inputs or another temperature, passes only lse.

_NORM: dict[int, tuple] = {}


def _takes_norm(kern) -> bool:
    """Whether the kernel's stats and grad_cols_ take ``norm=``: a declared capability
    (``NORM = True``, the Triton row kernels), like ``GRAD_OUT``; the C++ and PyTorch
    kernels have no column kernel."""
    return bool(getattr(kern, "NORM", False))


def _norm_buffer(kern, n, like) -> torch.Tensor | None:
    """A (2, n) fp32 buffer for stats(..., norm=) where the kernel takes one, else None."""
    return like.new_empty((2, n), dtype=torch.float32) if _takes_norm(kern) else None


def _norm_rows(norm, a, b) -> dict:
    """stats' keyword for rows [a, b): the column slice of the (2, N) buffer, or none."""
    return {} if norm is None else {"norm": norm[:, a:b]}


def _norm_ident(hidden, weight, inv_t) -> tuple:
    return (*_inputs_ident(hidden, weight), float(inv_t))


def _file_norm(lse, hidden, weight, inv_t, norm):
    key = lse.data_ptr()
    _NORM[key] = (_norm_ident(hidden, weight, inv_t), norm)
    weakref.finalize(lse.untyped_storage(), _NORM.pop, key, None)


def _find_norm(lse, hidden, weight, inv_t):
    """The norm buffer the low-memory forward that returned lse filed for these inputs and
    this temperature, or None."""
    entry = _NORM.get(lse.data_ptr()) if lse.numel() else None
    if entry is None or entry[0] != _norm_ident(hidden, weight, inv_t):
        return None
    return entry[1]


def linear_logprobs_fwd(kern, hidden, weight, bias, labels, temperature, ignore_index, with_ent):
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
    norm = _norm_buffer(kern, n, hidden) if low and n else None
    spans = logprobs_spans(n, v, k)
    # the kept block doubles as the buffer of the spans before it
    buf = _buffer(max([k] + [e - s for s, e in spans]), n, v, hidden, acc)

    def stats(z, s, e):  # the kernel on slices of at most c rows of the span's logits z
        for a in range(s, e, c):
            b = min(e, a + c)
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
    if k:
        stats(head.logits(hidden[n - k :], buf), n - k, n)  # one GEMM for the kept rows
        _file_kept(lse, hidden, weight, buf, k)
    if norm is not None:
        _file_norm(lse, hidden, weight, inv_t, norm)
    return logp, ent, lse


def linear_logprobs_bwd(
    kern, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, temperature, ignore_index
):
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    ent, g_ent = _none_if_empty(ent), _none_if_empty(g_ent)
    head = _Head(kern, hidden, weight, bias)
    if _low_memory(kern, weight):
        return _backward_by_vocab(
            kern, head, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, inv_t,
            ignore_index,
        )  # fmt: skip
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    db = torch.zeros(v if bias is not None else 0, dtype=acc, device=weight.device)
    c = chunk_rows(v)
    buf, k = _take_kept(lse, hidden, weight)
    spans = logprobs_spans(n, v, k)
    if buf is None:
        buf = _buffer(max(e - s for s, e in spans), n, v, hidden, acc)

    def grad(z, s, e):  # dL/dz in place by slices of at most c rows, then dh, dW for the span
        for a in range(s, e, c):
            b = min(e, a + c)
            za = z[a - s : b - s]
            kern.grad_(
                za,
                labels[a:b],
                lse[a:b],
                None if ent is None else ent[a:b],
                g_logp[a:b],
                None if g_ent is None else g_ent[a:b],
                inv_t,
                ignore_index,
                **_kern_out(kern, head, za),
            )
        head.backward(head.grad_view(z), hidden[s:e], dh[s:e], dw, db if bias is not None else None)

    if k:  # the kept rows first (no recompute), then the others through the same block
        grad(buf[:k], n - k, n)
    for s, e in spans:
        grad(head.logits(hidden[s:e], buf), s, e)
    return dh, dw, db


def _low_memory(kern, weight) -> bool:
    return hasattr(kern, "grad_cols_") and settings.low_memory(4 * weight.numel())


def _backward_by_vocab(kern, head, hidden, weight, bias, labels, lse, ent, g_logp, g_ent, inv_t,
                       ignore_index, norm=None):  # fmt: skip
    """The low-memory backward: per vocabulary chunk [v0, v1) of all N rows, the logits
    again (GEMM), dz in place from each row's saved (raw max, log s) ``norm`` (given, or
    filed under lse by the low-memory forward; where the kernel takes none: from the saved
    lse), dW[v0:v1] = dz^T h written once in the weight's dtype (GEMM), dh += dz W[v0:v1]
    in an fp32 (N, d) accumulator (GEMM).
    Memory: the chunk (MRTPO_CHUNK_BYTES) and the fp32 dh accumulator (none for fp32)."""
    if norm is None and _takes_norm(kern):
        norm = _find_norm(lse, hidden, weight, inv_t)
    nkw = {} if norm is None else {"norm": norm}
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden)
    cols = max(1, min(v, settings.chunk_bytes() // (4 * max(n, 1))))
    flat = hidden.new_empty(n * cols, dtype=acc)
    dw = torch.empty_like(weight)
    db = hidden.new_zeros(v if bias is not None else 0, dtype=acc)
    dh32 = hidden.new_zeros(hidden.shape, dtype=acc)
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        w_c = weight[v0:v1] if head.low else head.w[v0:v1]
        b_c = None if head.b32 is None else head.b32[v0:v1]
        z = head.logits(hidden, flat[: n * (v1 - v0)].view(n, v1 - v0), w_c, b_c)
        kern.grad_cols_(z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index, v0, v,
                        **_kern_out(kern, head, z), **nkw)  # fmt: skip
        g = head.grad_view(z)
        if head.low:
            g = _strided16(g)
            torch.mm(g.t(), hidden, out=dw[v0:v1])  # fp32 accumulation inside the GEMM
            _addmm_f32(dh32, g, w_c)
        else:
            dw[v0:v1] = g.t() @ _upcast(hidden)
            dh32.addmm_(g, w_c)
        if bias is not None:
            db[v0:v1] = g.sum(0, dtype=acc)
    return dh32.to(hidden.dtype), dw, db


def linear_js(kern, hidden_p, hidden_q, weight, bias, temperature):
    acc = acc_dtype(hidden_p)
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    v = weight.shape[0]
    if hasattr(kern, "js_many"):
        return _js_stacked(kern, hidden_p, hidden_q, weight, bias, temperature)
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
    for s in range(0, n, c):
        e = min(n, s + c)
        rows = e - s
        a = a_buf[: streams * rows * d].view(streams, rows, d)
        a[0].copy_(hidden_p[s:e])
        a[1:].copy_(hidden_q[:, s:e])
        z = head.logits(a.view(streams * rows, d), z_buf.view(-1, v))
        out[:, s:e] = kern.js_many(z.view(streams, rows, v), 1.0 / temperature)
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
        z = head.logits(hidden[s:e], buf)
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
            clip_ratio_c=clip_ratio_c,
            kl_iw=kl_iw,
            **(_kern_out(kern, head, z) if need_grad else {}),
        )
        loss += (per_tok * token_weight[s:e]).sum()
        logp[s:e] = lp
        clipped[s:e] = cl
        if need_grad:
            g = head.grad_view(z)
            head.backward(g, hidden[s:e], dh[s:e], dw, db if bias is not None else None)
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
    for s in range(0, n, c):
        e = min(n, s + c)
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
