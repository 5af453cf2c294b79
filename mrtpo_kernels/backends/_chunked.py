"""Token-chunked drivers shared by the "cpu", "torch" and "triton" backends.

One plan for every backend (mrtpo_kernels/chunk_plan.py lists it without running it): the
tokens are walked in balanced gradient buffers (``grad_spans``), each filled by fp32
logits chunks of at most chunk_rows(V) rows (``MRTPO_CHUNK_BYTES``): one BLAS GEMM makes a
chunk's fp32 logits, a row kernel streams the reductions over them and, for gradients,
writes dL/dlogits, into a separate 16-bit buffer of grad_rows(V) rows
(``MRTPO_GRAD_BUFFER_BYTES``; kernels with GRAD_OUT, 16-bit inputs, 16-bit GEMMs with fp32
output on the device) or in place over the fp32 logits (the buffer is then the logits
block); then dh = G W and dW = G^T h (the first buffer writes dW, the others accumulate)
run once per buffer, K = its rows. Extra memory is the logits chunk and the gradient buffer
(plus an fp32 copy of the weight when the GEMMs run in fp32 on 16-bit inputs, and the fp32
weight-gradient accumulator), never O(N x V).

GEMMs (N d V multiply-adds each over the call):
    log-probs forward 1; log-probs backward 3 (recompute, dH, dW), 2 for the last rows of
    the call, whose logits the forward keeps (MRTPO_KEEP_LOGITS_BYTES, see kept_rows; the
    kept block also sets the GEMM span of the other rows, see logprobs_spans);
    policy loss (forward with gradient) 3; JS one-vs-K 1 + K (stacked into one GEMM per
    token chunk where the kernel has js_many).

The row kernel ``kern`` a backend binds these drivers to follows ``contract.RowKernel``
(backends/contract.py): its methods see contiguous fp32 chunks of logits, and its
optional abilities (GRAD_OUT, JS_MANY, GRAD_COLS, NORM) are flags the drivers read.
The linear ops' logit transform (``LogitCap``: logit scaling, final-logit softcapping) is
applied by the Head to each chunk right after its GEMM (kept logits included), so the row
kernels read the transformed logits z; the gradient kernels get the cap's keywords
(``cap_kwargs``) and multiply their dL/dz by the slope dz/dr in the same pass. The LM
head's GEMMs are in _lm_head.py, what the log-probs forward keeps for its backward in
_saved_state.py; the driver, which walks the tokens (and, in low-memory mode, the
vocabulary), is one module per concern (this one gathers the entry points the backends
bind to their row kernel):
    _chunk_sizes.py        rows per chunk, gradient buffer and JS chunk; balanced spans
    _chunked_logprobs.py   linear_logprobs (forward, backward), logprobs_from_logits
    _chunked_js.py         linear_js_distance (per stream, or stacked), js_distance
    _chunked_policy.py     linear_policy_loss (and its low-memory form)
    _chunk_backward.py     the backward walks: by token, and by vocabulary (low memory)
    _row_lanes.py          MRTPO_OVERLAP_ROWS: the row kernels on a side stream
"""

from __future__ import annotations

from ._chunked_js import js_distance, linear_js_distance
from ._chunked_logprobs import (
    linear_logprobs_bwd,
    linear_logprobs_fwd,
    logprobs_from_logits_bwd,
    logprobs_from_logits_fwd,
)
from ._chunked_policy import linear_policy_loss

# The public ops these drivers implement (entry points: mrtpo_kernels/_catalog.py).
CHUNK_DRIVEN_OPS = (
    "linear_logprobs",
    "logprobs_from_logits",
    "linear_js_distance",
    "js_distance",
    "linear_policy_loss",
)

__all__ = [
    "CHUNK_DRIVEN_OPS",
    "js_distance",
    "linear_js_distance",
    "linear_logprobs_bwd",
    "linear_logprobs_fwd",
    "linear_policy_loss",
    "logprobs_from_logits_bwd",
    "logprobs_from_logits_fwd",
]
