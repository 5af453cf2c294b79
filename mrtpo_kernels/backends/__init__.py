"""Backends: the low-level implementations behind the public ops.

A backend is a module that defines the entry points of the ops it serves and declares
them in ``SERVES``; its contract is written as ``typing.Protocol`` classes in
backends/contract.py (``Backend``, the entry points of each op, and ``RowKernel``, what
the chunk driver backends/_chunked.py calls on a row kernel). The dispatcher
(mrtpo_kernels/_dispatch.py) reads the declarations and owns every fallback: a backend
never hands an input to another backend itself.

Adding a backend: write the module to the Protocols, add it to ``BACKENDS`` and
``_MODULES`` below and to the dispatcher's preference order. A backend built on the chunk
driver binds its functions to its row kernel (see cpu_backend) and declares
``{op: Serves(...) for op in _chunked.CHUNK_DRIVEN_OPS}``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "cpu", "triton", "cuda")

_MODULES = {
    "torch": "mrtpo_kernels.backends.torch_backend",
    "cpu": "mrtpo_kernels.backends.cpu_backend",
    "triton": "mrtpo_kernels.backends.triton_backend",
    "cuda": "mrtpo_kernels.backends.cuda_backend",
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # kernels that compute in fp32
ANY_DEVICE = "*"


@dataclass(frozen=True)
class Serves:
    """What a backend's kernels for one op take: device types (``ANY_DEVICE``: all) and
    input dtypes (for the advantage op: the dtype of the relevance)."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES

    def covers(self, device_type: str, dtype: torch.dtype) -> bool:
        on_device = ANY_DEVICE in self.devices or device_type in self.devices
        return on_device and dtype in self.dtypes


_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}


def load(name: str):
    """Import backend ``name``; return the module, or None (reason in ``load_error``)."""
    if name in _loaded:
        return _loaded[name]
    if name in _errors:
        return None
    try:
        mod = importlib.import_module(_MODULES[name])
        if not mod.available():
            raise ImportError(mod.unavailable_reason() or "not available")
    except Exception as exc:  # ImportError, missing extension, no GPU
        _errors[name] = f"{type(exc).__name__}: {exc}"
        return None
    _loaded[name] = mod
    return mod


def load_error(name: str) -> str | None:
    return _errors.get(name)
