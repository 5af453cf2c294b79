"""Per-token Jensen-Shannon distance between two next-token distributions (METHOD.md
section 3), fused with a shared LM head or from existing logits. No gradient.

    P = softmax(z_p / tau), Q = softmax(z_q / tau), M = (P + Q) / 2
    JSD = 1/2 KL(P || M) + 1/2 KL(Q || M),   d = sqrt(JSD / ln 2) in [0, 1]

The fused op's logits may first be transformed (``logit_scale``, ``softcap``:
softcap tanh(scale z / softcap), _types.LogitCap) before the temperature, as in the
log-probs op; ``js_distance`` takes logits as they are (a model's final logits, already
capped).

One-vs-many: with hidden_q / logits_q of K streams, P's logits are computed once per chunk
of tokens and compared with each Q stream.

The public functions come first; their torch.library registration (custom ops and fakes;
no autograd) follows them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch, _vocab_parallel
from . import _validation as check
from ._types import LOGIT_SCALE, SOFTCAP, TEMPERATURE, LogitCap, acc_dtype


def _pair_shapes(p: torch.Tensor, q: torch.Tensor, pname: str, qname: str):
    """Flatten p to (N, last) and q to (K, N, last); return them and the output shape."""
    if q.dim() == p.dim():
        if q.shape != p.shape:
            raise ValueError(
                f"{qname}: expected shape {tuple(p.shape)} (like {pname}) or "
                f"(K, {', '.join(map(str, p.shape))}), got {tuple(q.shape)}"
            )
        k, out_shape = 1, tuple(p.shape[:-1])
        squeeze = True
    elif q.dim() == p.dim() + 1 and q.shape[1:] == p.shape:
        if q.shape[0] == 0:
            raise ValueError(f"{qname}: expected K >= 1 streams, got shape {tuple(q.shape)}")
        k, out_shape = q.shape[0], (q.shape[0],) + tuple(p.shape[:-1])
        squeeze = False
    else:
        raise ValueError(
            f"{qname}: expected shape {tuple(p.shape)} (like {pname}) or "
            f"(K, {', '.join(map(str, p.shape))}), got {tuple(q.shape)}"
        )
    last = p.shape[-1]
    p2 = p.reshape(-1, last)
    q3 = q.reshape(k, -1, last)
    return p2, q3, out_shape, squeeze


def linear_js_distance(
    hidden_p: torch.Tensor,
    hidden_q: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = TEMPERATURE,
    logit_scale: float = LOGIT_SCALE,
    softcap: float | None = SOFTCAP,
    process_group=None,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-token JS distance between the LM head's distributions at two hidden streams.

    Args:
        hidden_p: (N, d) or (B, T, d), the stream with the verifier's information.
        hidden_q: same shape as hidden_p, or (K, *hidden_p.shape) for K streams (one per
            reward), each compared with hidden_p.
        weight: (V, d) LM head shared by both streams; bias: optional (V,).
        temperature: the sampling temperature.
        logit_scale, softcap: the head's logit transform, both streams alike (see
            ``linear_logprobs``; defaults: none).
        process_group: a vocabulary-parallel head (``torch.distributed`` group): weight and
            bias hold this rank's equal shard of the vocabulary; the hidden streams are the
            same on every rank and so are the distances returned. The shard's part of each
            row's statistics and divergence is combined by all-reduce, in PyTorch ops
            (mrtpo_kernels/_vocab_parallel.py; backend is not used).

    Returns:
        float32 distances in [0, 1] of shape hidden_p.shape[:-1], or (K, *that) for K streams.
    """
    check.float_tensor("hidden_p", hidden_p, min_ndim=2)
    check.float_tensor("hidden_q", hidden_q, min_ndim=2)
    check.last_dim_positive("hidden_p", hidden_p)
    check.lm_head(hidden_p, weight, bias)
    check.same_dtype(hidden_p=hidden_p, hidden_q=hidden_q)
    check.same_device(hidden_p=hidden_p, hidden_q=hidden_q, weight=weight, bias=bias)
    temperature = check.temperature(temperature)
    logit_scale, softcap = check.logit_cap(logit_scale, softcap)
    p2, q3, out_shape, squeeze = _pair_shapes(hidden_p, hidden_q, "hidden_p", "hidden_q")
    check.non_empty("hidden_p", p2.shape[0])
    if process_group is not None:
        _vocab_parallel.shard_info(weight, process_group)
        out = _vocab_parallel.linear_js_distance(
            p2.detach().contiguous(),
            q3.detach().contiguous(),
            weight.detach(),
            None if bias is None else bias.detach(),
            temperature,
            process_group,
            LogitCap(logit_scale, softcap),
        )
        return out[0].view(out_shape) if squeeze else out.view(out_shape)
    be = _dispatch.resolve("linear_js_distance", p2.device, p2.dtype, backend)
    out = linear_js_distance_op(
        p2.detach().contiguous(),
        q3.detach().contiguous(),
        weight.detach().contiguous(),
        None if bias is None else bias.detach().contiguous(),
        temperature,
        be,
        logit_scale,
        softcap,
    )
    return out[0].view(out_shape) if squeeze else out.view(out_shape)


def js_distance(
    logits_p: torch.Tensor,
    logits_q: torch.Tensor,
    *,
    temperature: float = TEMPERATURE,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-token JS distance from existing logits: logits_p (..., V), logits_q of the same
    shape or (K, ..., V). Returns float32 (...) or (K, ...). No gradient."""
    check.float_tensor("logits_p", logits_p, min_ndim=1)
    check.float_tensor("logits_q", logits_q, min_ndim=1)
    check.last_dim_positive("logits_p", logits_p)
    check.same_dtype(logits_p=logits_p, logits_q=logits_q)
    check.same_device(logits_p=logits_p, logits_q=logits_q)
    temperature = check.temperature(temperature)
    if logits_p.dim() == 1:
        logits_p, logits_q = logits_p.unsqueeze(0), logits_q.unsqueeze(-2)
        p2, q3, out_shape, squeeze = _pair_shapes(logits_p, logits_q, "logits_p", "logits_q")
        out_shape = out_shape[:-1]
    else:
        p2, q3, out_shape, squeeze = _pair_shapes(logits_p, logits_q, "logits_p", "logits_q")
    check.non_empty("logits_p", p2.shape[0])
    if p2.shape[1] == 0:
        raise ValueError("logits_p: the vocabulary is empty (V = 0)")
    be = _dispatch.resolve("js_distance", p2.device, p2.dtype, backend)
    out = js_distance_op(p2.detach().contiguous(), q3.detach().contiguous(), temperature, be)
    return out[0].view(out_shape) if squeeze else out.view(out_shape)


# --------------------------------------------------------------------------- registration


@torch.library.custom_op("mrtpo::linear_js_distance", mutates_args=())
def linear_js_distance_op(
    hidden_p: Tensor,
    hidden_q: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    backend: str,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
) -> Tensor:
    # the logit transform (softcap 0: none) reaches the backend only where it is active
    cap = (
        {}
        if logit_scale == 1.0 and softcap == 0.0
        else {"logit_scale": logit_scale, "softcap": softcap}
    )
    return _dispatch.get(backend, "linear_js_distance")(
        hidden_p, hidden_q, weight, bias, temperature, **cap
    )


@linear_js_distance_op.register_fake
def _(hidden_p, hidden_q, weight, bias, temperature, backend, logit_scale=1.0, softcap=0.0):
    return hidden_p.new_empty((hidden_q.shape[0], hidden_p.shape[0]), dtype=acc_dtype(hidden_p))


@torch.library.custom_op("mrtpo::js_distance", mutates_args=())
def js_distance_op(logits_p: Tensor, logits_q: Tensor, temperature: float, backend: str) -> Tensor:
    return _dispatch.get(backend, "js_distance")(logits_p, logits_q, temperature)


@js_distance_op.register_fake
def _(logits_p, logits_q, temperature, backend):
    return logits_p.new_empty((logits_q.shape[0], logits_p.shape[0]), dtype=acc_dtype(logits_p))
