"""The chunk driver's sizing rules and spans (backends/_chunked.py lists the driver's
modules): how many rows a logits chunk, a gradient buffer and a stacked JS chunk hold
(``MRTPO_CHUNK_BYTES``, ``MRTPO_GRAD_BUFFER_BYTES``, ``MRTPO_JS_SCRATCH_BYTES``, read at
each call), how a call's rows are cut into balanced spans, and the reused buffers those
spans run in. mrtpo_kernels/chunk_plan.py reads these same functions, so its plan cannot
drift from what the driver runs.
"""

from __future__ import annotations

import torch

from .. import settings


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
