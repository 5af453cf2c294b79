"""The "triton" backend: the chunk driver (backends/_chunked.py) with Triton row kernels
(mrtpo_kernels/triton_kernels/rows.py).

Per token chunk, one cuBLAS GEMM (torch.mm with out_dtype=float32 where torch has it on
the device, else fp32 operands) into a reused fp32 buffer, one Triton row kernel
(statistics, and the logit gradient into a 16-bit buffer or in place), then dh = G W and
dW += G^T h with fp32 accumulation once per gradient buffer: 3 GEMMs for a policy-loss
step, no recompute; 1 + K stacked rows in one GEMM for JS. ``MRTPO_LOW_MEMORY`` switches
the backward to vocabulary chunks (no fp32 dW accumulator, one GEMM more). The fused-GEMM
Triton kernels this backend once had were measured 1.01-2.8x slower on the H200
(bench/results/gpu-2026-12-04-h200.md) and are gone: this is the one Triton path.

On CUDA tensors this is the fast path. On CPU tensors the kernels run only under
``TRITON_INTERPRET=1`` (set before triton is imported), which the tests use. The kernels
take fp32, bf16 and fp16: the dispatcher sends float64 inputs to the "torch" backend. The
advantage kernel computes in its input's dtype, float64 included.
"""

from __future__ import annotations

import inspect

import torch

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
    from ..triton_kernels._common import check_device, interpreting
    from ..triton_kernels.advantages import mrtpo_token_advantages  # noqa: F401
    from ..triton_kernels.rows import TritonRowKernel

    _K = TritonRowKernel()
    ROW_KERNEL = _K  # public: mrtpo_kernels.chunk_plan.row_kernel("triton")

    def _entry(name: str, first_tensor_arg: str):
        """The chunk driver's ``name`` bound to the Triton row kernels, refusing a tensor
        that cannot run here (CPU without the interpreter) by its argument's name."""
        driver = getattr(_chunked, name)

        def entry(*args, **kwargs):
            check_device(first_tensor_arg, args[0])
            return driver(_K, *args, **kwargs)

        entry.__name__ = entry.__qualname__ = name
        entry.__doc__ = driver.__doc__
        sig = inspect.signature(driver)  # the driver's, less the row kernel it is bound to
        entry.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        return entry

    linear_logprobs_fwd = _entry("linear_logprobs_fwd", "hidden")
    linear_logprobs_bwd = _entry("linear_logprobs_bwd", "hidden")
    logprobs_from_logits_fwd = _entry("logprobs_from_logits_fwd", "logits")
    logprobs_from_logits_bwd = _entry("logprobs_from_logits_bwd", "logits")
    linear_js_distance = _entry("linear_js_distance", "hidden_p")
    js_distance = _entry("js_distance", "logits_p")
    linear_policy_loss = _entry("linear_policy_loss", "hidden")

    def saved_numel(op: str, n: int, v: int, weight_numel: int) -> int:
        """Elements of the log-probs forwards' ``saved`` output (mrtpo_kernels/_dispatch.py)."""
        return _saved_state.saved_numel(_K, op, n, v, weight_numel)

    _DEVICES = ("cuda", "cpu") if interpreting() else ("cuda",)
    SERVES = {op: Serves(_DEVICES, KERNEL_DTYPES) for op in _chunked.CHUNK_DRIVEN_OPS}
    SERVES["mrtpo_token_advantages"] = Serves(_DEVICES, (torch.float32, torch.float64))
