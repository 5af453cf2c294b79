"""The "triton" backend: fused Triton kernels (mrtpo_kernels/triton), one op per module.

On CUDA tensors this is the fast path. On CPU tensors the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported), which the tests use. The kernels
take fp32, bf16 and fp16 (Triton has no fp64 dots): the dispatcher sends float64 inputs to
the "torch" backend. The advantage kernel computes in its input's dtype, float64 included.
"""

from __future__ import annotations

import torch

from . import KERNEL_DTYPES, Serves

try:
    import triton  # noqa: F401

    _ERR = None
except ImportError as exc:  # pragma: no cover - depends on the install
    _ERR = f"triton is not installed ({exc})"


def available() -> bool:
    return _ERR is None


def unavailable_reason() -> str:
    return _ERR or ""


SERVES: dict[str, Serves] = {}

if _ERR is None:
    from ..triton._common import interpreting
    from ..triton.advantages import reallocate_packed  # noqa: F401
    from ..triton.js import linear_js, logits_js  # noqa: F401
    from ..triton.logprobs import (  # noqa: F401
        linear_logprobs_bwd,
        linear_logprobs_fwd,
        logits_logprobs_bwd,
        logits_logprobs_fwd,
    )
    from ..triton.policy_loss import linear_policy_loss  # noqa: F401

    _DEVICES = ("cuda", "cpu") if interpreting() else ("cuda",)
    SERVES = {
        op: Serves(_DEVICES, KERNEL_DTYPES)
        for op in (
            "linear_logprobs",
            "logprobs_from_logits",
            "linear_js_distance",
            "js_distance",
            "linear_policy_loss",
        )
    }
    SERVES["mrtpo_token_advantages"] = Serves(_DEVICES, (torch.float32, torch.float64))
