"""Pick the backend that runs an op, from the op table, the backends' declarations, the
tensors' device and dtype, the ``backend=`` argument and ``MRTPO_BACKEND``.

Every fallback is decided here (a backend never hands an input to another one):

- auto: the first backend in the device's order (CPU: cpu, torch; CUDA: triton, cuda,
  torch) that is installed and declares the op for the device and dtype. If the first
  (fast) backend of the order is not installed, one warning says why.
- explicit: the named backend. It must take tensors on that device (else ValueError).
  If it is not installed, or has no kernel for the op or the dtype, "torch" runs it with
  one warning. ``MRTPO_STRICT_BACKEND=1`` turns those warnings into errors (the
  benchmarks set it, so a slow path never hides in a table).
- float64: a backend with no float64 kernel (Triton has no fp64 dots, the CUDA kernels
  compute in fp32) passes float64 inputs to "torch", which keeps float64 end to end.
  That is the float64 contract, not a fallback: no warning, not an error in strict mode.
"""

from __future__ import annotations

import warnings

import torch

from . import backends, settings
from ._catalog import OPS

_warned: set[tuple[str, str]] = set()

# Preference order per device type: auto tries the _AUTO prefix; available_backends lists
# every installed backend that serves the op in this order.
_PREFERENCE = {"cpu": ("cpu", "torch", "triton"), "cuda": ("triton", "cuda", "torch")}
_AUTO = {"cpu": ("cpu", "torch"), "cuda": ("triton", "cuda", "torch")}
_HOME = "torch"  # serves every op on every device in every float dtype
_DEVICE_BOUND = {"cpu": "cpu", "cuda": "cuda"}  # backends tied to one device type


def _fallback(wanted: str, op: str, reason: str) -> str:
    msg = f"mrtpo_kernels: backend {wanted!r} cannot run {op} ({reason}); falling back"
    if settings.strict_backend():
        raise RuntimeError(msg + " [MRTPO_STRICT_BACKEND is set]")
    key = (wanted, op)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=5)
    return _HOME


def _declared(name: str, op: str):
    """The backend's declaration for op (a Serves), or None if it is missing or silent."""
    mod = backends.load(name)
    return None if mod is None else mod.SERVES.get(op)


def serves(name: str, op: str, device_type: str, dtype: torch.dtype) -> bool:
    decl = _declared(name, op)
    return decl is not None and decl.covers(device_type, dtype)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(map(repr, OPS))}; got {op!r}")


def resolve(op: str, device: torch.device, dtype: torch.dtype, backend: str | None = None) -> str:
    """Name of the backend that will run public op ``op`` on ``dtype`` tensors on ``device``."""
    if torch.compiler.is_compiling():
        # a constant of the traced graph: decided once at trace time, no import in the graph
        return _resolve_constant(op, device.type, dtype, backend)
    return _resolve(op, device.type, dtype, backend)


@torch.compiler.assume_constant_result
def _resolve_constant(op: str, device_type: str, dtype: torch.dtype, backend: str | None) -> str:
    return _resolve(op, device_type, dtype, backend)


def _resolve(op: str, device_type: str, dtype: torch.dtype, backend: str | None) -> str:
    _check_op(op)
    wanted = backend or settings.backend()
    if wanted != "auto" and wanted not in backends.BACKENDS:
        raise ValueError(
            f"backend: expected one of 'auto', {', '.join(map(repr, backends.BACKENDS))}; "
            f"got {wanted!r}"
        )
    if wanted == "auto":
        order = _AUTO.get(device_type, (_HOME,))
        if backends.load(order[0]) is None:  # the fast path for this device is missing
            _fallback(order[0], "any op", backends.load_error(order[0]) or "not available")
        for name in order:
            if serves(name, op, device_type, dtype):
                return name
        return _HOME
    bound = _DEVICE_BOUND.get(wanted)
    if bound is not None and bound != device_type:
        raise ValueError(
            f"backend: {wanted!r} needs {bound.upper()} tensors, got tensors on {device_type}"
        )
    if backends.load(wanted) is None:
        return _fallback(wanted, op, backends.load_error(wanted) or "not available")
    decl = _declared(wanted, op)
    if decl is None:
        return _fallback(wanted, op, "op not implemented")
    if dtype not in decl.dtypes:
        if dtype == torch.float64:
            return _HOME  # the float64 contract (module header)
        return _fallback(wanted, op, f"no {str(dtype).replace('torch.', '')} kernel")
    if not decl.covers(device_type, dtype):
        raise ValueError(
            f"backend: {wanted!r} cannot take tensors on {device_type} for {op} "
            f"(it takes {', '.join(decl.devices)})"
        )
    return wanted


def get(name: str, entry_point: str):
    """The function ``entry_point`` of backend ``name`` (already resolved)."""
    return getattr(backends.load(name), entry_point)


def saved_numel(name: str, op: str, n: int, v: int, weight_numel: int) -> int:
    """Elements of the ``saved`` output of backend ``name``'s log-probs forward for ``op``
    ("linear_logprobs" or "logprobs_from_logits"): the backend's ``saved_numel``
    (``contract.Backend``). The ops' fakes read it, so it must equal what the forward
    returns."""
    return backends.load(name).saved_numel(op, n, v, weight_numel)


def available(op: str, device_type: str, dtype: torch.dtype) -> list[str]:
    """Installed backends that serve op for device_type and dtype, in preference order."""
    _check_op(op)
    order = _PREFERENCE.get(device_type, (_HOME,))
    order = order + tuple(b for b in backends.BACKENDS if b not in order)
    return [name for name in order if serves(name, op, device_type, dtype)]


# --------------------------------------------------------------------------- public queries


def _device_type(device) -> str:
    return torch.device(device).type


def available_backends(
    op: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> list[str]:
    """Backends that are installed and serve public op ``op`` (a key of ``OPS``) for
    tensors of ``dtype`` on ``device``, in dispatch preference order."""
    return available(op, _device_type(device), dtype)


def resolve_backend(
    op: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
) -> str:
    """The backend that ``mrtpo_kernels.<op>(..., backend=backend)`` would run on tensors of
    ``dtype`` on ``device``: the same rules, warnings and strict-mode errors as the op."""
    return _resolve(op, _device_type(device), dtype, backend)


def backend_status() -> dict[str, str]:
    """Every backend with "ok" or the reason it cannot load here."""
    out = {}
    for name in backends.BACKENDS:
        out[name] = "ok" if backends.load(name) is not None else backends.load_error(name)
    return out
