"""The "cuda" backend: hand-written CUDA kernels (mrtpo_kernels._cuda, csrc/cuda) for the
memory-bound stages.

Implemented here:
    logprobs_from_logits_fwd / logprobs_from_logits_bwd / js_distance: streaming over
        existing logits, one CTA per token row, one read of the logits (two for JS), fp32
        math from fp32, bf16 or fp16 logits
    mrtpo_token_advantages: one segmented kernel over responses

The fused LM-head ops (linear_*) are not here, and the kernels compute in fp32 from fp32,
bf16 or fp16 inputs: ``SERVES`` says so and the dispatcher sends everything else (float64
included) to another backend.
"""

from __future__ import annotations

import torch

from . import KERNEL_DTYPES, Serves

try:
    from .. import _cuda
except ImportError as exc:  # not built (no nvcc, CPU-only torch) or built for another torch
    _cuda = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

ROW_KERNEL = None  # no chunk-driven op here
SERVES = {
    "logprobs_from_logits": Serves(("cuda",), KERNEL_DTYPES),
    "js_distance": Serves(("cuda",), KERNEL_DTYPES),
    "mrtpo_token_advantages": Serves(("cuda",), (torch.float32,)),
}


def unavailable_reason() -> str:
    """Why the backend cannot run here ("" when it can)."""
    if _cuda is None:
        return (
            f"the CUDA extension mrtpo_kernels._cuda is not built ({_IMPORT_ERROR}); it is "
            "built by `make build` where torch is a CUDA build and nvcc is found"
        )
    if not torch.cuda.is_available():
        return "mrtpo_kernels._cuda is built but torch sees no CUDA device"
    return ""


def available() -> bool:
    return unavailable_reason() == ""


def saved_numel(op: str, n: int, v: int, weight_numel: int) -> int:
    """Nothing: the logits backward needs only the lse (``saved`` is empty)."""
    return 0


def logprobs_from_logits_fwd(logits, labels, temperature, ignore_index, with_entropy):
    """(logp (N,), entropy (N,) or (0,), lse (N,), saved (0,)) float32 from logits (N, V).

    lse is 0 on rows whose label is ignore_index (never read: their gradient is 0); the
    backward needs nothing else (``saved`` is empty)."""
    logp, ent, lse = _cuda.logprobs_from_logits_fwd(
        logits=logits,
        labels=labels,
        temperature=float(temperature),
        ignore_index=int(ignore_index),
        with_entropy=bool(with_entropy),
    )
    return logp, ent, lse, lse.new_empty(0)


def logprobs_from_logits_bwd(
    logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, saved=None
):
    """dL/dlogits (N, V) in the logits' dtype."""
    f32 = torch.float32
    if entropy.numel() == 0 or grad_entropy.numel() == 0:
        # No entropy term: entropy not computed, or no gradient flows into it.
        entropy = grad_entropy = lse.new_empty(0, dtype=f32)
    return _cuda.logprobs_from_logits_bwd(
        logits=logits,
        labels=labels,
        lse=lse.to(f32).contiguous(),
        entropy=entropy.to(f32).contiguous(),
        grad_logp=grad_logp.to(f32).contiguous(),
        grad_entropy=grad_entropy.to(f32).contiguous(),
        temperature=float(temperature),
        ignore_index=int(ignore_index),
    )


def js_distance(logits_p, logits_q, temperature):
    """(K, N) float32 JS distances between logits_p (N, V) and logits_q (K, N, V)."""
    return _cuda.js_distance(logits_p=logits_p, logits_q=logits_q, temperature=float(temperature))


def mrtpo_token_advantages(
    per_reward,
    lam,
    has_info,
    relevance,
    cu_seqlens,
    sequence,
    divisor,
    alpha,
    gamma,
    delta,
    clip_min,
    clip_max,
):
    """(token (N,), allocation (K, N)); see the backend interface. One program per response
    walks its tokens from cu_seqlens."""
    f32 = torch.float32
    return _cuda.mrtpo_token_advantages(
        per_reward=per_reward.to(f32).contiguous(),
        lam=lam.to(f32).contiguous(),
        has_info=has_info.contiguous(),
        relevance=relevance.contiguous(),
        cu_seqlens=cu_seqlens.long().contiguous(),
        sequence=sequence.to(f32).contiguous(),
        divisor=divisor.to(f32).reshape(1),
        alpha=float(alpha),
        gamma=float(gamma),
        delta=float(delta),
        clip_min=float(clip_min),
        clip_max=float(clip_max),
    )
