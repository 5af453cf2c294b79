"""Token-level clipped policy loss fused with the LM head (METHOD.md section 6).

    ratio = exp(logp - logp_old)
    L_t   = -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + beta KL_k3(ref || pi)
    loss  = sum_t c_t L_t,  with c_t from the aggregation rule
    dL/dlogp_t = c_t (-A ratio [unclipped branch active] + beta (1 - exp(ref - logp)))

The gradient with respect to the logits is known in the forward pass (the loss is a scalar),
so the backend computes it there, chunk by chunk, and the backward pass only scales the saved
gradients by the upstream scalar: three GEMMs in all (logits, dH, dW), no recompute.
"""

from __future__ import annotations

import torch

from . import _dispatch, _ops
from . import _validation as check
from .types import acc_dtype

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _token_coefficients(valid, aggregation, cu_seqlens, padded_shape, norm_len, dtype):
    """c_t such that sum_t c_t L_t is the aggregated loss; valid is (N,) bool."""
    v = valid.to(dtype)
    if aggregation == "token-mean":
        return v / v.sum().clamp(min=1.0)
    n_tok = valid.shape[0]
    if padded_shape is not None:
        b, t = padded_shape
        seq_ids = torch.arange(b, device=valid.device).repeat_interleave(t)
        num_seqs, max_len = b, t
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        num_seqs = lengths.shape[0]
        seq_ids = torch.repeat_interleave(
            torch.arange(num_seqs, device=valid.device), lengths, output_size=n_tok
        )
        max_len = lengths.max().to(dtype)
    counts = torch.zeros(num_seqs, dtype=dtype, device=valid.device).index_add_(0, seq_ids, v)
    present = (counts > 0).to(dtype).sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        return v / (counts.clamp(min=1.0)[seq_ids] * present)
    denom = norm_len if norm_len is not None else max_len
    return v / (denom * present)


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ignore_index: int = -100,
    aggregation: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    norm_len: float | None = None,
    backend: str | None = None,
):
    """Clipped-surrogate policy loss with the LM head fused in; gradient in the forward.

    Args:
        hidden: (N, d) packed or (B, T, d) padded policy hidden states.
        weight: (V, d) LM head; bias: optional (V,).
        labels: (N,) or (B, T) sampled tokens; ``ignore_index`` marks padding/prompt.
        old_logprobs, advantages: per-token, labels' shape (the rollout log-probs and the
            token advantages, e.g. from ``mrtpo_token_advantages``).
        temperature: the sampling temperature.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        aggregation: "token-mean" (mean over all valid tokens), "seq-mean-token-mean"
            (mean over sequences of each one's token mean), "seq-mean-token-sum-norm" (mean
            over sequences of the token sum divided by ``norm_len``, default the longest
            sequence). The sequence rules need (B, T) inputs or ``cu_seqlens`` (n+1,).
        ref_logprobs, beta: optional k3 KL penalty to a reference policy.

    Returns:
        (loss, metrics): a float32 scalar differentiable with respect to hidden, weight and
        bias, and a dict of detached scalars: clip_fraction, mean_ratio (and kl with beta).
    """
    h, lab = check.flatten_tokens(hidden, labels)
    check.lm_head(hidden, weight, bias)
    check.choice("aggregation", aggregation, AGGREGATIONS)
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages)):
        check.float_tensor(name, t)
        check.shape_eq(name, t, labels.shape, "labels' shape")
    if ref_logprobs is not None:
        check.float_tensor("ref_logprobs", ref_logprobs)
        check.shape_eq("ref_logprobs", ref_logprobs, labels.shape, "labels' shape")
    check.same_device(
        hidden=hidden, weight=weight, labels=labels, old_logprobs=old_logprobs,
        advantages=advantages, bias=bias, ref_logprobs=ref_logprobs, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    temperature = check.positive_finite("temperature", temperature)
    clip_low = check.non_negative("clip_low", clip_low)
    clip_high = check.non_negative("clip_high", clip_high)
    beta = check.non_negative("beta", beta)
    check.non_empty("hidden", h.shape[0])
    check.labels_in_range(lab, weight.shape[0], ignore_index)
    padded_shape = None
    if aggregation != "token-mean":
        if hidden.dim() == 3:
            padded_shape = tuple(labels.shape)
        elif cu_seqlens is None:
            raise ValueError(
                f"cu_seqlens: aggregation={aggregation!r} on packed (N, d) input needs the "
                "sequence boundaries cu_seqlens (n+1,), or pass (B, T, d) padded input"
            )
        else:
            check.int_tensor("cu_seqlens", cu_seqlens, ndim=1)
            if cu_seqlens.shape[0] < 2:
                raise ValueError("cu_seqlens: expected at least 2 entries (0 and N)")

    valid = lab != ignore_index
    acc = acc_dtype(hidden)
    coef = _token_coefficients(valid, aggregation, cu_seqlens, padded_shape, norm_len, acc)
    old = old_logprobs.reshape(-1).to(acc).contiguous()
    adv = advantages.reshape(-1).to(acc).contiguous()
    coef = coef.to(acc)
    ref = (
        ref_logprobs.reshape(-1).to(acc).contiguous()
        if ref_logprobs is not None and beta != 0.0
        else h.new_empty(0, dtype=acc)
    )
    need_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    be = _dispatch.resolve("linear_policy_loss", h.device, h.dtype, backend)
    loss, logp, clipped, _, _, _ = _ops.linear_policy_loss(
        h.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
        lab.contiguous(), old, adv, coef.contiguous(), ref, temperature, clip_low, clip_high,
        beta, int(ignore_index), bool(need_grad), be,
    )  # fmt: skip
    with torch.no_grad():
        v = valid.to(acc)
        n = v.sum().clamp(min=1.0)
        metrics = {
            "clip_fraction": (clipped * v).sum() / n,
            "mean_ratio": (torch.exp(logp - old) * v).sum() / n,
        }
        if ref.numel():
            diff = ref - logp
            metrics["kl"] = ((torch.exp(diff) - diff - 1.0) * v).sum() / n
    return loss, metrics
