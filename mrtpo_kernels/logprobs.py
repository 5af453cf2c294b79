"""Per-token log-probabilities (and entropy) of the labels, fused with the LM head or from
logits that already exist, streaming over the vocabulary; autograd to every float input.

Math (z = logits / temperature, per token):
    lse = log sum_v exp(z_v),  logp = z_y - lse,  H = lse - sum_v p_v z_v
    dlogp/dz_v = [v == y] - p_v,   dH/dz_v = -p_v (log p_v + H)
"""

from __future__ import annotations

import torch

from . import _dispatch, _ops, _vocab_parallel
from . import _validation as check


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    process_group=None,
    backend: str | None = None,
):
    """log p(label) under softmax((hidden @ weight.T + bias) / temperature), never
    materializing the [tokens x vocab] logits.

    Args:
        hidden: (N, d) packed or (B, T, d) padded hidden states, fp32/bf16/fp16/fp64.
        weight: (V, d) LM head, same dtype as hidden.
        labels: (N,) or (B, T) integer targets in [0, V), or ``ignore_index``.
        bias: optional (V,) LM-head bias.
        temperature: positive; logits are divided by it before the softmax.
        ignore_index: label value whose tokens get logp = entropy = 0 and no gradient.
        return_entropy: also return the entropy of each token's distribution.
        process_group: a vocabulary-parallel head (``torch.distributed`` group): weight and
            bias hold this rank's equal shard of the vocabulary (rows [r V_loc, (r+1) V_loc)
            for rank r), labels are global ids, hidden is the same on every rank. The
            results are the full head's on every rank; the weight's gradient is this
            shard's, the hidden states' is all-reduced (mrtpo_kernels/_vocab_parallel.py).
        backend: "auto" (default, or ``MRTPO_BACKEND``), "cpu", "torch", "triton", "cuda".

    Returns:
        logp of labels' shape in float32, and entropy of the same shape when asked.
        Differentiable with respect to hidden, weight and bias.
    """
    h, lab = check.flatten_tokens(hidden, labels)
    check.lm_head(hidden, weight, bias)
    check.same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    temperature = check.temperature(temperature)
    ignore_index = check.int64("ignore_index", ignore_index)
    check.non_empty("hidden", h.shape[0])
    vocab = weight.shape[0]
    if process_group is not None:
        vocab = _vocab_parallel.shard_info(weight, process_group)[2]
    check.labels_in_range(lab, vocab, ignore_index)
    be = _dispatch.resolve("linear_logprobs", h.device, h.dtype, backend)
    if process_group is not None:
        logp, ent = _vocab_parallel.linear_logprobs(
            h.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
            lab.contiguous(), temperature, int(ignore_index), bool(return_entropy), be,
            process_group,
        )  # fmt: skip
        logp = logp.view(labels.shape)
        return (logp, ent.view(labels.shape)) if return_entropy else logp
    logp, ent, _ = _ops.linear_logprobs_fwd(
        h.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        lab.contiguous(),
        temperature,
        int(ignore_index),
        bool(return_entropy),
        be,
    )
    logp = logp.view(labels.shape)
    if return_entropy:
        return logp, ent.view(labels.shape)
    return logp


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    backend: str | None = None,
):
    """log p(label) (and entropy) from logits that already exist, (N, V) or (B, T, V),
    streaming over the vocabulary in fp32 (no log-softmax tensor is kept).
    Differentiable with respect to logits. See ``linear_logprobs`` for the arguments."""
    z, lab = check.flatten_tokens(logits, labels, "logits")
    temperature = check.temperature(temperature)
    ignore_index = check.int64("ignore_index", ignore_index)
    check.same_device(logits=logits, labels=labels)
    check.non_empty("logits", z.shape[0])
    if z.shape[1] == 0:
        raise ValueError("logits: the vocabulary is empty (V = 0)")
    check.labels_in_range(lab, z.shape[1], ignore_index)
    be = _dispatch.resolve("logprobs_from_logits", z.device, z.dtype, backend)
    logp, ent, _ = _ops.logits_logprobs_fwd(
        z.contiguous(), lab.contiguous(), temperature, int(ignore_index), bool(return_entropy), be
    )
    logp = logp.view(labels.shape)
    if return_entropy:
        return logp, ent.view(labels.shape)
    return logp
