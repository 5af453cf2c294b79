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
  ``policy_terms``) are the contract documented in mrtpo_kernels/backends/_chunked.py.

Everything here reads the same functions the driver does, so the plan cannot drift from
what runs (tests/test_chunk_driver.py counts the GEMMs of real calls against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings
from .backends import _chunked
from .backends import load as _load
from .backends import load_error as _load_error

__all__ = [
    "ChunkPlan",
    "Gemm",
    "addmm_f32",
    "chunk_plan",
    "chunk_rows",
    "f32_out_supported",
    "js_chunk_rows",
    "kept_rows",
    "logprobs_spans",
    "mm_f32",
    "row_kernel",
]

ROW_KERNEL_BACKENDS = ("cpu", "torch", "triton")
PLAN_OPS = ("linear_logprobs", "linear_policy_loss", "linear_js_distance")

chunk_rows = _chunked.chunk_rows
kept_rows = _chunked.kept_rows
logprobs_spans = _chunked.logprobs_spans
js_chunk_rows = _chunked.js_chunk_rows
f32_out_supported = _chunked.f32_out_supported
mm_f32 = _chunked._mm_f32
addmm_f32 = _chunked._addmm_f32


@dataclass(frozen=True)
class Gemm:
    """One GEMM of the plan: an (m x k) by (k x n) product, ``stage`` one of "logits",
    "recompute" (the logits again, in a backward), "dh" or "dw"."""

    stage: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class ChunkPlan:
    """What the chunk driver runs for one call: ``rows_per_chunk`` token rows per row-kernel
    slice (``streams`` stacked rows each for JS), ``kept_rows`` rows whose logits the
    log-probs forward keeps for its backward, ``low_memory`` whether the backward walks
    vocabulary chunks, and ``gemms`` in the order they run."""

    op: str
    rows_per_chunk: int
    kept_rows: int
    low_memory: bool
    gemms: tuple[Gemm, ...]

    @property
    def flops(self) -> int:
        return sum(g.flops for g in self.gemms)

    def count(self, stage: str | None = None) -> int:
        return sum(stage is None or g.stage == stage for g in self.gemms)


def _token_chunks(n: int, c: int) -> list[int]:
    return [min(n, s + c) - s for s in range(0, n, c)]


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
) -> ChunkPlan:
    """The GEMMs the chunk driver issues for ``op`` on n tokens, vocabulary v, hidden d.

    op: "linear_logprobs" (forward, and with ``backward`` its backward),
        "linear_policy_loss" (forward with gradient when ``backward``) or
        "linear_js_distance" (one P stream against ``k`` Q streams; forward only):
        ``js_stacked`` (the Triton row kernels) stacks the 1 + k streams of a chunk into one
        GEMM; otherwise (cpu, torch) P's logits once and each Q's per chunk, 1 + k GEMMs.
    low_memory: the backward by vocabulary chunks (the Triton row kernels in
        ``MRTPO_LOW_MEMORY`` mode; ``settings.low_memory(4 * v * d)`` says whether a call
        takes it).
    """
    if op not in PLAN_OPS:
        raise ValueError(f"op: expected one of {', '.join(PLAN_OPS)}, got {op!r}")
    for name, value in (("n", n), ("v", v), ("d", d), ("k", k)):
        if not isinstance(value, int) or value < (0 if name == "n" else 1):
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    gemms: list[Gemm] = []
    if op == "linear_js_distance":
        if js_stacked:
            c = js_chunk_rows(v, k)
            gemms = [Gemm("logits", (1 + k) * r, v, d) for r in _token_chunks(n, c)]
        else:
            c = chunk_rows(v, streams=2)
            gemms = [Gemm("logits", r, v, d) for r in _token_chunks(n, c) for _ in range(1 + k)]
        return ChunkPlan(op, c, 0, False, tuple(gemms))
    c = chunk_rows(v)
    if low_memory and backward:
        if op == "linear_policy_loss":
            rows = _token_chunks(n, c)
        else:
            rows = [e - s for s, e in logprobs_spans(n, v, 0)]
        gemms = [Gemm("logits", r, v, d) for r in rows]
        cols = max(1, min(v, settings.chunk_bytes() // (4 * max(n, 1))))
        for v0 in range(0, v, cols):
            w = min(v, v0 + cols) - v0
            gemms += [Gemm("recompute", n, w, d), Gemm("dw", w, d, n), Gemm("dh", n, d, w)]
        return ChunkPlan(op, c, 0, True, tuple(gemms))
    if op == "linear_policy_loss":
        for r in _token_chunks(n, c):
            gemms.append(Gemm("logits", r, v, d))
            if backward:
                gemms += [Gemm("dh", r, d, v), Gemm("dw", v, d, r)]
        return ChunkPlan(op, c, 0, False, tuple(gemms))
    kept = 0 if low_memory else kept_rows(n, v)
    spans = logprobs_spans(n, v, kept)
    rows = [e - s for s, e in spans]
    gemms = [Gemm("logits", r, v, d) for r in rows]
    if kept:
        gemms.append(Gemm("logits", kept, v, d))
    if backward:
        if kept:
            gemms += [Gemm("dh", kept, d, v), Gemm("dw", v, d, kept)]
        for r in rows:
            gemms += [Gemm("recompute", r, v, d), Gemm("dh", r, d, v), Gemm("dw", v, d, r)]
    return ChunkPlan(op, c, kept, False, tuple(gemms))


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
