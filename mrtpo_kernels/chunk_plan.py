"""The chunk driver's plan and its stages, public for benchmarks and tools.

The fused LM-head ops (``linear_logprobs``, ``linear_policy_loss``, ``linear_js_distance``)
run on the "cpu", "torch" and "triton" backends as one chunk driver: per token chunk, a
GEMM makes the chunk's fp32 logits into a reused buffer, a row kernel reduces them (and
writes the logit gradient in place), and two more GEMMs turn that gradient into dh and dW.
This module says what that driver will do for a shape, without running it, and gives each
stage on its own so that a benchmark can time it alone:

- ``chunk_plan(op, n, v, d, ...)``: rows per chunk, the rows whose logits the log-probs
  forward keeps, and every GEMM the driver issues (``plan.gemms``, ``plan.flops``).
- ``chunk_rows``, ``js_chunk_rows``, ``kept_rows``, ``logprobs_spans``: the sizing rules
  (from ``MRTPO_CHUNK_BYTES``, ``MRTPO_JS_SCRATCH_BYTES``, ``MRTPO_KEEP_LOGITS_BYTES``,
  read at each call; see mrtpo_kernels/settings.py).
- ``f32_out_supported``, ``mm_f32``, ``addmm_f32``: the 16-bit GEMMs with fp32 output the
  driver uses where torch.mm has ``out_dtype`` on the device.
- ``row_kernel(backend)``: the backend's row kernel ("cpu", "torch" or "triton"); its
  methods ``stats``, ``grad_``, ``policy_`` (and on "triton" ``js_many``, ``grad_cols_``,
  ``policy_terms``) follow ``RowKernel`` in mrtpo_kernels/backends/contract.py.

Everything here reads the same functions the driver does, so the plan cannot drift from
what runs (tests/test_chunk_driver.py counts the GEMMs of real calls against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings
from .backends import _chunk_sizes, _lm_head, _saved_state
from .backends import load as _load
from .backends import load_error as _load_error

__all__ = [
    "ChunkPlan",
    "Gemm",
    "RowPass",
    "addmm_f32",
    "balanced",
    "chunk_plan",
    "chunk_rows",
    "f32_out_supported",
    "gemm_path",
    "grad_rows",
    "grad_spans",
    "js_chunk_rows",
    "kept_rows",
    "logprobs_spans",
    "mm_f32",
    "row_kernel",
]

ROW_KERNEL_BACKENDS = ("cpu", "torch", "triton")
PLAN_OPS = ("linear_logprobs", "linear_policy_loss", "linear_js_distance")

chunk_rows = _chunk_sizes.chunk_rows
grad_rows = _chunk_sizes.grad_rows
balanced = _chunk_sizes.balanced
grad_spans = _chunk_sizes.grad_spans
kept_rows = _saved_state.kept_rows
logprobs_spans = _chunk_sizes.logprobs_spans
js_chunk_rows = _chunk_sizes.js_chunk_rows
f32_out_supported = _lm_head.f32_out_supported
mm_f32 = _lm_head.mm_f32
addmm_f32 = _lm_head.addmm_f32


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the plan: an (m x k) by (k x n) product, ``stage`` one of "logits",
    "recompute" (the logits again, in a backward), "dh" or "dw"; operands of ``in_bytes``
    per element, the output of ``out_bytes``, read as well as written when
    ``accumulate`` (C += A B)."""

    stage: str
    m: int
    n: int
    k: int
    accumulate: bool = False
    in_bytes: int = 4
    out_bytes: int = 4

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def bytes(self) -> int:
        """Compulsory memory traffic: both operands read once, the output written (and
        read first when accumulating)."""
        out = self.m * self.n * self.out_bytes * (2 if self.accumulate else 1)
        return self.in_bytes * (self.m * self.k + self.k * self.n) + out


@dataclass(frozen=True)
class RowPass:
    """One row-kernel call: ``rows`` x ``cols`` elements, ``read_bytes`` read and
    ``write_bytes`` written per element (the kernels' passes over the row: a statistics
    pass reads each fp32 logit once, a gradient pass ("grad", or "policy" for the policy
    loss's kernel) reads it twice and writes the gradient; JS reads every stream
    twice)."""

    stage: str
    rows: int
    cols: int
    read_bytes: int
    write_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * (self.read_bytes + self.write_bytes)


@dataclass(frozen=True)
class ChunkPlan:
    """What the chunk driver runs for one call: ``rows_per_chunk`` token rows per row-kernel
    slice (``streams`` stacked rows each for JS), ``grad_rows`` rows of the largest gradient
    buffer (the K of the dW GEMMs), ``kept_rows`` rows whose logits the log-probs forward
    keeps for its backward, ``low_memory`` whether the backward walks vocabulary chunks,
    ``grad16`` whether the gradient goes to a separate 16-bit buffer, ``gemms`` and
    ``row_passes`` in the order they run, and ``buffer_bytes`` the driver's largest set of
    buffers alive at once (beyond inputs, outputs and the fp32 dW)."""

    op: str
    rows_per_chunk: int
    kept_rows: int
    low_memory: bool
    gemms: tuple[Gemm, ...]
    row_passes: tuple[RowPass, ...] = ()
    grad_rows: int = 0
    grad16: bool = False
    buffer_bytes: int = 0

    @property
    def flops(self) -> int:
        return sum(g.flops for g in self.gemms)

    def count(self, stage: str | None = None) -> int:
        return sum(stage is None or g.stage == stage for g in self.gemms)


def _token_chunks(n: int, c: int) -> list[int]:
    return [e - s for s, e in balanced(n, c)]


def chunk_plan(
    op: str,
    n: int,
    v: int,
    d: int,
    *,
    backward: bool = True,
    k: int = 1,
    low_memory: bool = False,
    js_stacked: bool = True,
    grad16: bool = False,
    overlap: bool | None = None,
) -> ChunkPlan:
    """The GEMMs and row passes the chunk driver issues for ``op`` on n tokens, vocabulary
    v, hidden d.

    op: "linear_logprobs" (forward, and with ``backward`` its backward),
        "linear_policy_loss" (forward with gradient when ``backward``) or
        "linear_js_distance" (one P stream against ``k`` Q streams; forward only):
        ``js_stacked`` (the Triton and C++ row kernels) stacks the 1 + k streams of a chunk
        into one GEMM; otherwise (torch) P's logits once and each Q's per chunk, 1 + k GEMMs.
    low_memory: the backward by vocabulary chunks (the Triton row kernels in
        ``MRTPO_LOW_MEMORY`` mode; ``settings.low_memory(4 * v * d)`` says whether a call
        takes it).
    grad16: the 16-bit path (Triton row kernels, 16-bit inputs, a device whose torch has
        16-bit GEMMs with fp32 output; ``gemm_path`` says): 16-bit GEMM operands, the
        gradient in a separate 16-bit buffer of ``grad_rows(v)`` rows. Otherwise fp32
        operands and the gradient in place in the fp32 logits.
    overlap: MRTPO_OVERLAP_ROWS's second fp32 logits chunk (the row kernels on a side
        stream, 16-bit path on a CUDA device) in ``buffer_bytes``; None: the setting's
        value (read at the call), for the 16-bit path only. The GEMMs and row passes are
        the same either way.
    """
    if op not in PLAN_OPS:
        raise ValueError(f"op: expected one of {', '.join(PLAN_OPS)}, got {op!r}")
    for name, value in (("n", n), ("v", v), ("d", d), ("k", k)):
        if not isinstance(value, int) or value < (0 if name == "n" else 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if overlap is None:
        overlap = grad16 and settings.overlap_rows()
    lanes = 2 if overlap and grad16 else 1  # fp32 logits chunks alive at once
    eb = 2 if grad16 else 4  # GEMM operands (and dh) in bytes per element
    gb = 2 if grad16 else 4  # the written gradient
    gemms: list[Gemm] = []
    passes: list[RowPass] = []

    def gemm(stage, m, nn, kk, acc=False, out=4):
        gemms.append(Gemm(stage, m, nn, kk, acc, eb, out))

    if op == "linear_js_distance":
        if js_stacked:
            c = js_chunk_rows(v, k)
            for r in _token_chunks(n, c):
                gemm("logits", (1 + k) * r, v, d)
                passes.append(RowPass("js", (1 + k) * r, v, 8))
            mem = (1 + k) * min(c, n) * (4 * v + eb * d)
        else:
            c = chunk_rows(v, streams=2)
            for r in _token_chunks(n, c):
                for _ in range(1 + k):
                    gemm("logits", r, v, d)
                passes += [RowPass("js", 2 * r, v, 4) for _ in range(k)]
            mem = 2 * min(c, n) * 4 * v
        return ChunkPlan(op, c, 0, False, tuple(gemms), tuple(passes), 0, grad16, mem)
    c = chunk_rows(v)

    def stats_passes(rows):
        for s, e in balanced(rows, c):
            passes.append(RowPass("stats", e - s, v, 4))

    if low_memory and backward:
        if op == "linear_policy_loss":
            rows = _token_chunks(n, c)
        else:
            rows = [e - s for s, e in logprobs_spans(n, v, 0)]
        for r in rows:
            gemm("logits", r, v, d)
            stats_passes(r)
        cols = max(1, min(v, settings.chunk_bytes() // (4 * max(n, 1))))
        for s, e in balanced(v, cols):
            w = e - s
            gemm("recompute", n, w, d)
            passes.append(RowPass("cols", n, w, 4, gb))
            gemm("dw", w, d, n, out=4 if eb == 4 else eb)
            gemm("dh", n, d, w, acc=s > 0)
        mem = n * min(cols, v) * (4 + (gb if grad16 else 0)) + (4 * n * d if eb == 2 else 0)
        mem = max(mem, min(c, n) * 4 * v)
        return ChunkPlan(op, c, 0, True, tuple(gemms), tuple(passes), 0, grad16, mem)
    kept = 0 if op == "linear_policy_loss" else kept_rows(n, v)
    sep = grad16 and backward
    mem = 0
    if op == "linear_logprobs":
        spans = logprobs_spans(n, v, kept)
        for s, e in spans:
            gemm("logits", e - s, v, d)
            stats_passes(e - s)
        if kept:
            gemm("logits", kept, v, d)
            stats_passes(kept)
        span_rows = max([0] + [e - s for s, e in spans])
        if lanes == 2 and span_rows:  # two span buffers of their own, beside the kept block
            mem = (kept + 2 * span_rows) * 4 * v
        else:
            mem = (kept + (span_rows if span_rows > kept else 0)) * 4 * v
        if not backward:
            return ChunkPlan(op, c, kept, False, tuple(gemms), tuple(passes), 0, grad16, mem)
    bufs = grad_spans(n, v, kept, sep)
    first = True
    for s, e, from_kept in bufs:
        if from_kept and not sep:
            passes.append(RowPass("copy kept", e - s, v, 4, 4))
        if not from_kept and not sep:
            gemm("recompute" if op == "linear_logprobs" else "logits", e - s, v, d)
        for a, b in balanced(e - s, c):
            if not from_kept and sep:
                gemm("recompute" if op == "linear_logprobs" else "logits", b - a, v, d)
            if backward:  # the policy loss's pass is its own kernel (policy_)
                stage = "policy" if op == "linear_policy_loss" else "grad"
                passes.append(RowPass(stage, b - a, v, 8, gb))
            else:
                passes.append(RowPass("stats", b - a, v, 4))
        if backward:
            gemm("dh", e - s, d, v, out=eb)
            gemm("dw", v, d, e - s, acc=not first)
            first = False
    big = max([e - s for s, e, _ in bufs], default=0)
    rows = [e - s for s, e, fk in bufs if not (sep and fk)]
    z = (min(c, max(rows)) if sep else max(rows)) if rows else 0
    z *= lanes if sep else 1  # the overlap's second chunk (16-bit backward path)
    mem = max(mem, (kept + z) * 4 * v + (big * gb * v if sep else 0))
    return ChunkPlan(op, c, kept, False, tuple(gemms), tuple(passes), big, grad16, mem)


def gemm_path(backend: str, device, dtype) -> str:
    """The GEMMs the chunk driver runs on ``backend`` for ``dtype`` inputs on ``device``:
    "16-bit, fp32 out", "fp32", or "fp32 fallback" (16-bit inputs on a device where torch
    has no 16-bit GEMM with fp32 output: an fp32 weight copy and fp32 GEMMs), with
    ", bf16-operand logits" where a CPU's oneDNN runs the logits GEMM of bf16 inputs on
    bf16 operands. Benchmarks print it in every row, so the slow path never hides."""
    import torch

    return _lm_head.gemm_path(row_kernel(backend), torch.device(device), dtype)


def row_kernel(backend: str):
    """The row kernel the chunk driver calls on ``backend`` ("cpu", "torch", "triton").

    Raises ValueError for another name and RuntimeError (with the reason) when the backend
    cannot load here (no C++ extension, no triton)."""
    if backend not in ROW_KERNEL_BACKENDS:
        raise ValueError(
            f"backend: expected one of {', '.join(ROW_KERNEL_BACKENDS)}, got {backend!r}"
        )
    mod = _load(backend)
    if mod is None:
        raise RuntimeError(f"backend {backend!r} is not available: {_load_error(backend)}")
    return mod.ROW_KERNEL
