"""The "triton" backend: fused Triton kernels (mrtpo_kernels/triton), one op per module.

On CUDA tensors this is the fast path. On CPU tensors the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported), which the tests use.
"""

from __future__ import annotations

import importlib.util
import os

try:
    import triton  # noqa: F401

    _ERR = None
except ImportError as exc:  # pragma: no cover - depends on the install
    _ERR = f"triton is not installed ({exc})"


def available() -> bool:
    return _ERR is None


def unavailable_reason() -> str:
    return _ERR or ""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _has(module: str) -> bool:
    return _ERR is None and importlib.util.find_spec(f"mrtpo_kernels.triton.{module}") is not None


if _has("logprobs"):
    from ..triton.logprobs import (  # noqa: F401
        linear_logprobs_bwd,
        linear_logprobs_fwd,
        logits_logprobs_bwd,
        logits_logprobs_fwd,
    )
if _has("policy_loss"):
    from ..triton.policy_loss import linear_policy_loss  # noqa: F401
if _has("js"):
    from ..triton.js import linear_js, logits_js  # noqa: F401
if _has("reallocate"):
    from ..triton.reallocate import reallocate_packed  # noqa: F401
