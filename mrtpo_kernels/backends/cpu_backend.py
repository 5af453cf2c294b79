"""The "cpu" backend: the chunked drivers with the C++ chunk kernels of mrtpo_kernels._C.

Each chunk's logits come from one BLAS GEMM (fp32); one C++ pass over them (OpenMP over
rows, vectorized exp/log) does the reductions or writes dL/dlogits in place, so no further
[chunk x V] temporaries exist.
"""

from __future__ import annotations

import functools

from . import _chunked

try:
    from .. import _C  # noqa: F401
except ImportError as exc:  # not built: the dispatcher reports the reason
    _C = None
    _IMPORT_ERROR = str(exc)


def available() -> bool:
    return _C is not None


def unavailable_reason() -> str:
    return f"the C++ extension mrtpo_kernels._C is not built ({_IMPORT_ERROR}); run `make build`"
