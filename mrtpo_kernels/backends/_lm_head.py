"""The LM head's GEMMs for the chunk driver (backends/_chunked.py): fp32 logits of row
blocks, and dh = G W, dW (+)= G^T h from a block's logit gradient G.

Two paths (``gemm_path`` names them): fp32 operands (fp32 or float64 inputs, a kernel
without GRAD_OUT, or a device whose torch has no 16-bit GEMM with fp32 output: the weight
upcast once), or 16-bit operands with fp32 accumulation and output (torch.mm's out_dtype;
``f32_out_supported`` tries it once per device and dtype and caches the answer).

On the CPU, where torch.mm has no out_dtype, the fp32 path's logits GEMM of bf16 hidden
states and a bf16 head runs in oneDNN's bf16 mode for fp32 matmuls (``cpu_bf16_logits``):
the upcast operands hold bf16 values, so rounding them to bf16 changes nothing, and the
products are accumulated and written in fp32, which is what out_dtype=float32 computes.
The gradient GEMMs keep fp32 operands (the logit gradient is not a bf16 value).

The logit transform (``LogitCap``: logit scaling, final-logit softcapping) is applied here,
in place on each fp32 block of logits a GEMM wrote (``apply_logit_cap_``), so the row
kernels always read the transformed logits z; their gradient kernels multiply by the slope
dz/dr (the cap's ``slope``), formed from the z they read.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import settings
from .._types import LogitCap

NO_CAP = LogitCap()


def upcast(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def fp32_logits(
    h: torch.Tensor, w32: torch.Tensor, b32: torch.Tensor | None, buf: torch.Tensor
) -> torch.Tensor:
    """fp32 logits of the rows h into buf[:rows] (one buffer reused by every chunk: a fresh
    [C, V] allocation per chunk would page-fault and zero a few hundred MB each time)."""
    h32 = upcast(h)
    out = buf[: h.shape[0]]
    if b32 is None:
        return torch.mm(h32, w32.t(), out=out)
    return torch.addmm(b32, h32, w32.t(), out=out)


def apply_logit_cap_(z: torch.Tensor, cap: LogitCap) -> torch.Tensor:
    """z <- softcap tanh(scale z / softcap) (z <- scale z without a cap), in place on an
    fp32 (or float64) block of raw logits; nothing for the identity. Elementwise in PyTorch
    ops (vectorized, threaded on the CPU): the multiply by scale / softcap rounds once."""
    if cap.softcap:
        z.mul_(cap.scale / cap.softcap).tanh_().mul_(cap.softcap)
    elif cap.scale != 1.0:
        z.mul_(cap.scale)
    return z


def cap_kwargs(cap: LogitCap) -> dict:
    """The row kernels' keywords for the slope of an active cap; none for the identity (the
    kernels' plain path, and no keyword an older kernel would not know)."""
    return {"logit_scale": cap.scale, "softcap": cap.softcap} if cap.active else {}


LOW = (torch.bfloat16, torch.float16)  # 16-bit input dtypes


@functools.lru_cache(maxsize=1)
def _cpu_bf16_gemm_available() -> bool:
    """oneDNN with bf16 GEMMs on this CPU and torch's per-backend fp32 precision switch."""
    try:
        return bool(
            torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and hasattr(torch.backends.mkldnn, "matmul")
            and hasattr(torch.backends.mkldnn.matmul, "fp32_precision")
        )
    except (AttributeError, RuntimeError):
        return False


def cpu_bf16_logits(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the logits GEMM of these operands runs on bf16 operands on the CPU: both
    bf16 CPU tensors, MRTPO_CPU_BF16_GEMM on and oneDNN able to."""
    return (
        hidden.device.type == "cpu"
        and hidden.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and settings.cpu_bf16_gemm()
        and _cpu_bf16_gemm_available()
    )


@contextlib.contextmanager
def bf16_operand_gemms():
    """fp32 matmuls on the CPU inside run on bf16-rounded operands with fp32 accumulation
    (oneDNN); the previous setting is restored on exit. The switch is process-wide: an fp32
    matmul of another thread at the same moment would round its operands too."""
    mm = torch.backends.mkldnn.matmul
    before = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = before


_F32_OUT: dict[tuple[str, int | None, torch.dtype], bool] = {}


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = a @ b for 16-bit a, b with fp32 accumulation and output."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def addmm_f32(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
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
            ok = torch.equal(mm_f32(a, b, out), want)
            addmm_f32(out, a, b)
            ok = ok and torch.equal(out, 2 * want)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _F32_OUT[key] = ok
    return _F32_OUT[key]


# the bf16-operand logits GEMM on the CPU upcasts the bf16 head a block of rows at a time into
# one reused fp32 buffer of about this size: an fp32 copy of the whole head would be a fresh
# allocation per call (a 150k x 4096 head: 2.4 GB; page faults and zeroing cost as much as a
# third of the GEMM at the replay's shapes, bench/results/cpu-js-blocked-upcast-2026-12-05.md)
WEIGHT_BLOCK_BYTES = 8 << 20


def weight_block_rows(vocab: int, d: int) -> int:
    """Rows of the head per block of the blocked bf16-operand logits GEMM."""
    return max(1, min(vocab, WEIGHT_BLOCK_BYTES // (4 * max(d, 1))))


class Head:
    """The LM head's GEMMs for one call. 16-bit mode (the kernel has GRAD_OUT, the inputs
    are 16-bit and the device has out_dtype): the weight is used as it is, logits come out
    in fp32, and the kernel writes each row's logit gradient into a separate 16-bit
    gradient buffer (``grad_buffer``), the operand of the dh and dW GEMMs. Otherwise fp32
    operands (the weight upcast once when it is not fp32) and the gradient overwrites the
    fp32 logits in place. With bf16 operands on the CPU (``bf16_operands``) the logits GEMM
    upcasts the head block by block into one small reused buffer; the whole fp32 copy
    (``w``) is made only if a backward asks for it. ``cap``: the logit transform, applied
    to every block of logits it returns."""

    def __init__(self, kern, hidden, weight, bias, cap: LogitCap = NO_CAP):
        dt = hidden.dtype
        self.low = kern.GRAD_OUT and dt in LOW and f32_out_supported(hidden.device, dt)
        self.dtype = dt
        self.weight = weight
        self.bf16_operands = not self.low and cpu_bf16_logits(hidden, weight)
        self._w = weight if self.low else (None if self.bf16_operands else upcast(weight))
        self.b32 = upcast(bias)
        self._block = None  # the reused fp32 block of the head (bf16 operands)
        self.cap = cap

    @property
    def w(self) -> torch.Tensor:
        """The head for the GEMMs: as it is in 16-bit mode, else fp32 (upcast once)."""
        if self._w is None:
            self._w = upcast(self.weight)
        return self._w

    def logits(self, h, buf, w=None, b32=None):
        """fp32 logits of rows h into buf[:rows] (columns of w, default the whole head),
        transformed by the cap (z, not r, when it is active)."""
        return apply_logit_cap_(self._raw_logits(h, buf, w, b32), self.cap)

    def _raw_logits(self, h, buf, w=None, b32=None):
        """fp32 logits r = h W^T (+ b) of rows h into buf[:rows]."""
        b32 = self.b32 if b32 is None else b32
        if self.bf16_operands:
            if w is None:
                return self._blocked_bf16_logits(h, buf, b32)
            with bf16_operand_gemms():  # fp32 copies of bf16 values: nothing is rounded
                return fp32_logits(h, w, b32, buf)
        w = self.w if w is None else w
        if not self.low:
            return fp32_logits(h, w, b32, buf)
        out = buf[: h.shape[0]]
        mm_f32(h, w.t(), out)  # logits = h W^T, 16-bit operands, fp32 out
        if b32 is not None:
            out += b32
        return out

    def _blocked_bf16_logits(self, h, buf, b32):
        """The whole head's logits of rows h into buf[:rows] on bf16 operands, the head
        upcast a block of rows at a time (fp32 copies of bf16 values: nothing is rounded;
        each logit is the same dot product over d as in one GEMM)."""
        v, d = self.weight.shape
        out = buf[: h.shape[0]]
        h32 = upcast(h)
        cols = weight_block_rows(v, d)
        if self._block is None:
            self._block = h.new_empty((cols, d), dtype=torch.float32)
        with bf16_operand_gemms():
            for v0 in range(0, v, cols):
                v1 = min(v, v0 + cols)
                w_blk = self._block[: v1 - v0]
                w_blk.copy_(self.weight[v0:v1])
                b_blk = None if b32 is None else b32[v0:v1]
                fp32_logits(h32, w_blk, b_blk, out[:, v0:v1])  # columns v0:v1 of the rows
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
            torch.mm(g, self.w, out=dh_rows)  # dh = G W (16-bit, fp32 inside the GEMM)
            if first:
                mm_f32(g.t(), h, dw)  # dW = G^T h, fp32, written (no zeroing first)
            else:
                addmm_f32(dw, g.t(), h)  # dW += G^T h, fp32, accumulated in the GEMM
            if db is not None:
                db += g.sum(0, dtype=db.dtype)
            return
        h32 = upcast(h)
        if dh_rows.dtype == g.dtype:  # dh = G W, fp32 (or float64)
            torch.mm(g, self.w, out=dh_rows)
        else:
            dh_rows.copy_(g @ self.w)  # dh = G W, rounded to hidden's dtype
        if first:
            torch.mm(g.t(), h32, out=dw)  # dW = G^T h, written
        else:
            dw.addmm_(g.t(), h32)  # dW += G^T h
        if db is not None:
            db += g.sum(0)


def gemm_path(kern, device: torch.device, dtype: torch.dtype) -> str:
    """Which GEMMs the driver runs for ``kern`` on ``dtype`` inputs on ``device``:
    "16-bit, fp32 out" (the weight as it is, 16-bit gradient buffer), "fp32" (fp32 or
    float64 inputs, or a kernel without GRAD_OUT) or "fp32 fallback" (16-bit inputs and a
    kernel with GRAD_OUT, but torch has no out_dtype GEMM on the device: an fp32 copy of the
    weight and fp32 GEMMs, several times slower on a GPU); either fp32 path with
    ", bf16-operand logits" for bf16 inputs on a CPU whose oneDNN runs the logits GEMM of
    bf16 hidden states and head on bf16 operands (``cpu_bf16_logits``; the gradient GEMMs
    stay fp32)."""
    if dtype in LOW and kern.GRAD_OUT and f32_out_supported(device, dtype):
        return "16-bit, fp32 out"
    path = "fp32 fallback" if dtype in LOW and kern.GRAD_OUT else "fp32"
    probe = torch.empty(0, dtype=dtype, device=device)
    return path + (", bf16-operand logits" if cpu_bf16_logits(probe, probe) else "")
