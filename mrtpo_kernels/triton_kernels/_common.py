"""Launch-side helpers shared by the Triton kernels:

    interpreting()            TRITON_INTERPRET=1 (kernels then run on CPU tensors, slowly)
    check_device(name, t)     ValueError unless t can run here (CUDA, or CPU when interpreting)
    num_sms(device)           streaming multiprocessors (a small number under the interpreter)

This module is imported by several kernel files: keep its names and meanings stable.
"""

from __future__ import annotations

import functools
import os

import torch


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
