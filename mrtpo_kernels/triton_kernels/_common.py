"""Helpers shared by the Triton kernels: launch-side queries and one device function.

Host side:
    interpreting()            TRITON_INTERPRET=1 (kernels then run on CPU tensors, slowly)
    check_device(name, t)     ValueError unless t can run here (CUDA, or CPU when interpreting)
    num_sms(device)           streaming multiprocessors (a small number under the interpreter)
    dot_precision(dtype)      "ieee" or "tf32" for fp32 dots, following torch's matmul setting
    interpreter_upcast(dtype) whether to upcast dot operands to fp32 (interpreter + bf16 only)
    chunk_bytes()             memory budget of one gradient chunk (``MRTPO_CHUNK_BYTES``)
Device side:
    grouped_pid(pid, num_m, num_n, GROUP_M)   program id -> (pid_m, pid_n), grouped order

This module is imported by several kernel files: keep its names and meanings stable.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .. import settings


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(name: str, t: torch.Tensor) -> None:
    """The Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.is_cuda or (t.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{name}: the 'triton' backend needs CUDA tensors (or CPU tensors with "
        f"TRITON_INTERPRET=1 set before triton is imported), got a tensor on {t.device}"
    )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Number of SMs of ``device``; 2 under the interpreter (so splits still get exercised)."""
    if device.type != "cuda":
        return 2
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision: fp32 dots use TF32 only where torch's own fp32 matmuls would
    (same error budget), else IEEE fp32; 16-bit dots get Triton's default ("tf32"), which
    does not affect them."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def interpreter_upcast(dtype: torch.dtype) -> bool:
    """True under the interpreter for bf16 operands: its tl.dot multiplies the raw bf16 bit
    patterns (wrong results, seen with Triton 3.9), so kernels pass this as a constexpr and
    upcast both operands to fp32 before the dot. Always False on a GPU."""
    return interpreting() and dtype == torch.bfloat16


def chunk_bytes() -> int:
    """Bytes allowed for one chunk of gradient-of-logits (the same knob as the torch backend)."""
    return settings.chunk_bytes()


def cdiv(a: int, b: int) -> int:
    return triton.cdiv(a, b)


@triton.jit
def grouped_pid(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id onto a (num_m x num_n) grid, GROUP_M rows of tiles at a time.

    Programs that run together then share a few row tiles and a few column tiles, so both
    operands of a tiled product stay in L2 instead of one of them streaming from HBM.
    """
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % per_group
    pid_m = first_m + local % rows_in_group
    pid_n = local // rows_in_group
    return pid_m, pid_n
