"""FLOP counts and memory estimates of the benchmarked ops, written down once.

FLOPs count the LM-head GEMMs only (2 N d V per stream and per GEMM); the softmax, the
reductions and the advantage stage are not counted (they are memory-bound, O(N V) or O(N)):

    one stream forward (log-probs, with or without entropy)    2 N d V
    forward + backward (log-probs, policy loss)                6 N d V   (logits, dH, dW)
    JS distance one-vs-K (P once, then K streams Q)            (1 + K) 2 N d V
    credit-assignment step (JS one-vs-K + policy fwd+bwd)      (1 + K) 2 N d V + 6 N d V

Memory estimates say how much a provider needs beyond its inputs and outputs, so that a
baseline that cannot fit reports the estimate instead of being run. For plain PyTorch the
count is in [N, V] float32 tensors alive at the peak (logits in the input dtype count
too); for the chunked providers it is a few [chunk, V] float32 blocks plus the float32
weight-gradient accumulator.
"""

from __future__ import annotations

import os

# Ops whose FLOPs follow the GEMM formula; value = GEMMs per stream, as (forward streams,
# backward GEMMs). Kept explicit so that the table and the tests read the same numbers.
_FWD_ONLY = ("linear_logprobs_fwd", "linear_logprobs_entropy")
_FWD_BWD = ("linear_logprobs_fwd_bwd", "linear_policy_loss_fwd_bwd")
_JS = ("linear_js_distance",)


def flops(op: str, n: int, d: int, v: int, k: int = 0) -> float:
    """GEMM FLOPs of one call of ``op`` at N = n tokens, hidden size d, vocabulary v, K = k
    Q streams. 0 for the advantage stage (no GEMM: report its time and bytes instead)."""
    if op in _FWD_ONLY:
        return 2.0 * n * d * v
    if op in _FWD_BWD:
        return 6.0 * n * d * v
    if op in _JS:
        return (1 + k) * 2.0 * n * d * v
    if op == "credit_assignment_step":
        return (1 + k) * 2.0 * n * d * v + 6.0 * n * d * v
    if op == "advantages":
        return 0.0
    raise ValueError(f"op: unknown {op!r}")


def advantage_bytes(n_tokens: int, k: int) -> float:
    """Bytes the advantage stage must move at least: read the relevance (K, N) fp32 and the
    segment ids (N,) int64, write the token advantages (N,) and the allocation (K, N) fp32."""
    return 4.0 * k * n_tokens + 8.0 * n_tokens + 4.0 * n_tokens + 4.0 * k * n_tokens


# [N, V] float32 tensors alive at the peak of the plain PyTorch implementations in
# bench/torch_impls.py (plus the logits in the input dtype when that is not float32):
#   forward: the fp32 logits and their log-softmax;
#   with entropy: the log-softmax, its exp and their product;
#   forward+backward: in the backward of the log-softmax, its saved output, the incoming
#     gradient (the gathered log-probs' gradient scattered to [N, V]) and the outgoing one;
#   JS one-vs-K: P's log-softmax and probabilities, Q_k's log-softmax, log M and one
#     difference in flight, the K streams compared one after the other.
# These count allocations; on the CPU the measured RSS can be lower (a zero-filled
# [N, V] gradient is not resident until written).
_PLAIN_NV_FP32 = {
    "linear_logprobs_fwd": 2,
    "linear_logprobs_entropy": 3,
    "linear_logprobs_fwd_bwd": 3,
    "linear_policy_loss_fwd_bwd": 3,
    "linear_js_distance": 5,
    "credit_assignment_step": 5,
}

DEFAULT_CHUNK_BYTES = 256 << 20


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}[dtype]


def estimate_extra_bytes(
    provider: str, op: str, n: int, d: int, v: int, k: int, dtype: str
) -> float:
    """Estimated memory beyond inputs and outputs of ``provider`` running ``op``."""
    if op == "advantages":
        # per-token temporaries of the stage: a few (K, N) fp32 / (N,) int64 arrays
        return 6.0 * advantage_bytes(n, k)
    nv = float(n) * float(v)
    if provider == "pytorch":
        extra = _PLAIN_NV_FP32[op] * 4.0 * nv
        if dtype_bytes(dtype) != 4:
            extra += dtype_bytes(dtype) * nv  # the GEMM's output before the fp32 cast
        return extra
    chunk = float(os.environ.get("MRTPO_CHUNK_BYTES", DEFAULT_CHUNK_BYTES))
    extra = 3.0 * min(chunk, 4.0 * nv)
    if op in _FWD_BWD or op == "credit_assignment_step":
        extra += 4.0 * v * d  # float32 weight-gradient accumulator
    if dtype_bytes(dtype) != 4:
        extra += 4.0 * v * d  # float32 copy of the weight
    return extra


def input_output_bytes(op: str, n: int, d: int, v: int, k: int, dtype: str) -> float:
    """Bytes of the inputs plus returned tensors and gradients (for the fit decision)."""
    s = dtype_bytes(dtype)
    if op == "advantages":
        return advantage_bytes(n, k)
    inputs = s * (n * d + v * d) + 8 * n
    if op in _JS:
        inputs += s * k * n * d
    if op == "credit_assignment_step":
        inputs += s * k * n * d
    outputs = 8.0 * n
    if op in _FWD_BWD or op == "credit_assignment_step":
        outputs += s * n * d + 4.0 * v * d
    return inputs + outputs


def fits(
    provider: str,
    op: str,
    n: int,
    d: int,
    v: int,
    k: int,
    dtype: str,
    available_bytes: float,
    headroom: float = 0.75,
) -> tuple[bool, float]:
    """Whether the cell should fit in ``available_bytes`` with ``headroom`` kept free, and
    the estimated total bytes (inputs, outputs and extra)."""
    need = estimate_extra_bytes(provider, op, n, d, v, k, dtype) + input_output_bytes(
        op, n, d, v, k, dtype
    )
    return need <= headroom * available_bytes, need
