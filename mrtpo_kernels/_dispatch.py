"""Pick a backend for an op from the tensors' device, the ``backend=`` argument and
``MRTPO_BACKEND``.

auto on CPU  -> "cpu" (the C++ extension), else "torch" (chunked PyTorch)
auto on CUDA -> "triton", else "cuda", else "torch"
An explicit backend that is missing, or that lacks the op, falls back to "torch" with one
warning; ``MRTPO_STRICT_BACKEND=1`` turns that warning into an error (the benchmarks set it,
so a slow path never hides in a table).
"""

from __future__ import annotations

import os
import warnings

import torch

from . import backends

_warned: set[tuple[str, str]] = set()

_AUTO_ORDER = {"cpu": ("cpu", "torch"), "cuda": ("triton", "cuda", "torch")}


def _strict() -> bool:
    return os.environ.get("MRTPO_STRICT_BACKEND", "0") not in ("", "0", "false", "False")


def _fallback(wanted: str, op: str, reason: str):
    msg = f"mrtpo_kernels: backend {wanted!r} cannot run {op} ({reason}); falling back"
    if _strict():
        raise RuntimeError(msg + " [MRTPO_STRICT_BACKEND is set]")
    key = (wanted, op)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return "torch"


def resolve(op: str, device: torch.device, backend: str | None = None) -> str:
    """Name of the backend that will run ``op`` for tensors on ``device``."""
    if torch.compiler.is_compiling():
        # a constant of the traced graph: decided once at trace time, no import in the graph
        return _resolve_constant(op, device.type, backend)
    return _resolve(op, device, backend)


@torch.compiler.assume_constant_result
def _resolve_constant(op: str, device_type: str, backend: str | None) -> str:
    return _resolve(op, torch.device(device_type), backend)


def _resolve(op: str, device: torch.device, backend: str | None) -> str:
    wanted = backend or os.environ.get("MRTPO_BACKEND") or "auto"
    if wanted != "auto" and wanted not in backends.BACKENDS:
        raise ValueError(
            f"backend: expected one of 'auto', {', '.join(map(repr, backends.BACKENDS))}; "
            f"got {wanted!r}"
        )
    if wanted == "auto":
        order = _AUTO_ORDER.get(device.type, ("torch",))
        if backends.load(order[0]) is None:  # the fast path for this device is missing
            _fallback(order[0], "any op", backends.load_error(order[0]) or "not available")
        for name in order:
            mod = backends.load(name)
            if mod is not None and hasattr(mod, op):
                return name
        return "torch"
    if wanted == "cpu" and device.type != "cpu":
        raise ValueError(f"backend: 'cpu' needs CPU tensors, got tensors on {device}")
    if wanted == "cuda" and device.type != "cuda":
        raise ValueError(f"backend: 'cuda' needs CUDA tensors, got tensors on {device}")
    mod = backends.load(wanted)
    if mod is None:
        return _fallback(wanted, op, backends.load_error(wanted) or "not available")
    if not hasattr(mod, op):
        return _fallback(wanted, op, "op not implemented")
    return wanted


def get(name: str, op: str):
    """The function ``op`` of backend ``name`` (already resolved)."""
    mod = backends.load(name)
    return getattr(mod, op)


def available() -> dict[str, str]:
    """Every backend with 'ok' or the reason it cannot load (for `mrtpo env`)."""
    out = {}
    for name in backends.BACKENDS:
        out[name] = "ok" if backends.load(name) is not None else backends.load_error(name)
    return out
