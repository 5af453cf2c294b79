"""The "triton" backend: the chunk driver (backends/_chunked.py) with Triton row kernels
(mrtpo_kernels/triton_kernels/rows.py), or the older fused-GEMM Triton kernels.

Default variant (``MRTPO_TRITON_VARIANT=rows``): per token chunk, one cuBLAS GEMM
(torch.mm with out_dtype=float32 where torch has it on the device, else fp32 operands)
into a reused fp32 buffer, one Triton row kernel (statistics, and the logit gradient in
place), then dh_c = G W and dW += G^T h_c with fp32 accumulation: 3 GEMMs for a policy-loss
step, no recompute; 1 + K stacked rows in one GEMM for JS. ``MRTPO_LOW_MEMORY`` switches
the backward to vocabulary chunks (no fp32 dW accumulator, one GEMM more).
``MRTPO_TRITON_VARIANT=fused``: the fused-GEMM kernels of triton_kernels/logprobs.py, policy_loss.py
and js.py (logits never leave the chip; 4 GEMMs for the policy loss), kept only until a
GPU measurement compares the two (docs/kernels.md).

On CUDA tensors this is the fast path. On CPU tensors the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported), which the tests use. The kernels
take fp32, bf16 and fp16 (Triton has no fp64 dots): the dispatcher sends float64 inputs to
the "torch" backend. The advantage kernel computes in its input's dtype, float64 included.
"""

from __future__ import annotations

import functools

import torch

from .. import settings
from . import KERNEL_DTYPES, Serves, _chunked, _saved_state

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
ROW_KERNEL = None

if _ERR is None:
    from ..triton_kernels import js as _fused_js
    from ..triton_kernels import logprobs as _fused_logprobs
    from ..triton_kernels import policy_loss as _fused_policy
    from ..triton_kernels._common import check_device, interpreting
    from ..triton_kernels.advantages import mrtpo_token_advantages  # noqa: F401
    from ..triton_kernels.rows import TritonRowKernel

    _K = TritonRowKernel()
    ROW_KERNEL = _K  # public: mrtpo_kernels.chunk_plan.row_kernel("triton")

    def _variant(name: str, fused, first_tensor_arg: str):
        """The entry point ``name``: the chunk driver with the row kernels, or the fused
        kernel when MRTPO_TRITON_VARIANT=fused (read at each call)."""
        chunked = functools.partial(getattr(_chunked, name), _K)

        @functools.wraps(fused)
        def entry(*args, **kwargs):
            if settings.triton_variant() == "fused":
                return fused(*args, **kwargs)
            check_device(first_tensor_arg, args[0])
            return chunked(*args, **kwargs)

        return entry

    linear_logprobs_fwd = _variant(
        "linear_logprobs_fwd", _fused_logprobs.linear_logprobs_fwd, "hidden"
    )
    linear_logprobs_bwd = _variant(
        "linear_logprobs_bwd", _fused_logprobs.linear_logprobs_bwd, "hidden"
    )
    logprobs_from_logits_fwd = _variant(
        "logprobs_from_logits_fwd", _fused_logprobs.logprobs_from_logits_fwd, "logits"
    )
    logprobs_from_logits_bwd = _variant(
        "logprobs_from_logits_bwd", _fused_logprobs.logprobs_from_logits_bwd, "logits"
    )
    linear_js_distance = _variant("linear_js_distance", _fused_js.linear_js_distance, "hidden_p")
    js_distance = _variant("js_distance", _fused_js.js_distance, "logits_p")
    linear_policy_loss = _variant("linear_policy_loss", _fused_policy.linear_policy_loss, "hidden")

    def saved_numel(op: str, n: int, v: int, weight_numel: int) -> int:
        """Elements of the log-probs forwards' ``saved`` output (mrtpo_kernels/_dispatch.py)."""
        if settings.triton_variant() == "fused":
            return _fused_logprobs.saved_numel(n)
        return _saved_state.saved_numel(_K, op, n, v, weight_numel)

    _DEVICES = ("cuda", "cpu") if interpreting() else ("cuda",)
    SERVES = {op: Serves(_DEVICES, KERNEL_DTYPES) for op in _chunked.CHUNK_DRIVEN_OPS}
    SERVES["mrtpo_token_advantages"] = Serves(_DEVICES, (torch.float32, torch.float64))
