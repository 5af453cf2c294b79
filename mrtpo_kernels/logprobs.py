"""Per-token log-probabilities (and entropy) of the labels, fused with the LM head or from
logits that already exist, streaming over the vocabulary; autograd to every float input.

Math (z = logits / temperature, per token):
    lse = log sum_v exp(z_v),  logp = z_y - lse,  H = lse - sum_v p_v z_v
    dlogp/dz_v = [v == y] - p_v,   dH/dz_v = -p_v (log p_v + H)
The fused op's logits may first be transformed (``logit_scale``, ``softcap``; the order of
Hugging Face's models, _types.LogitCap): r = h W^T + b, logits = softcap tanh(scale r /
softcap) (scale r without a cap), then the temperature; the chain rule multiplies the
logit gradient by scale (1 - (logits / softcap)^2).

The public functions come first; their torch.library registration (custom ops, fakes,
autograd) follows them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch, _vocab_parallel
from . import _validation as check
from ._registration import empty_rows, keep_saved, saved_state
from ._types import IGNORE_INDEX, LOGIT_SCALE, SOFTCAP, TEMPERATURE, LogitCap, acc_dtype


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = TEMPERATURE,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    logit_scale: float = LOGIT_SCALE,
    softcap: float | None = SOFTCAP,
    process_group=None,
    backend: str | None = None,
):
    """log p(label) under softmax(cap(scale (hidden @ weight.T + bias)) / temperature),
    never materializing the [tokens x vocab] logits.

    Args:
        hidden: (N, d) packed or (B, T, d) padded hidden states, fp32/bf16/fp16/fp64.
        weight: (V, d) LM head, same dtype as hidden.
        labels: (N,) or (B, T) integer targets in [0, V), or ``ignore_index``.
        bias: optional (V,) LM-head bias.
        temperature: positive; logits are divided by it before the softmax.
        ignore_index: label value whose tokens get logp = entropy = 0 and no gradient.
        return_entropy: also return the entropy of each token's distribution.
        logit_scale: finite, non-zero; the head's output is multiplied by it first
            (Cohere's ``logit_scale``; Granite's ``logits_scaling`` divides: pass 1 / it).
        softcap: None, or s > 0: the scaled logits become s tanh(logits / s) before the
            temperature (Gemma 2 / 3's ``final_logit_softcapping``). The defaults (1.0,
            None) are the plain head, bit for bit.
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
    logit_scale, softcap = check.logit_cap(logit_scale, softcap)
    ignore_index = check.int64("ignore_index", ignore_index)
    check.non_empty("hidden", h.shape[0])
    vocab = weight.shape[0]
    if process_group is not None:
        vocab = _vocab_parallel.shard_info(weight, process_group)[2]
    check.labels_in_range(lab, vocab, ignore_index)
    be = _dispatch.resolve("linear_logprobs", h.device, h.dtype, backend)
    if process_group is not None:
        logp, ent = _vocab_parallel.linear_logprobs(
            h.contiguous(),
            weight.contiguous(),
            None if bias is None else bias.contiguous(),
            lab.contiguous(),
            temperature,
            int(ignore_index),
            bool(return_entropy),
            be,
            process_group,
            LogitCap(logit_scale, softcap),
        )
        logp = logp.view(labels.shape)
        return (logp, ent.view(labels.shape)) if return_entropy else logp
    logp, ent, _ = linear_logprobs_fwd(
        h.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        lab.contiguous(),
        temperature,
        int(ignore_index),
        bool(return_entropy),
        be,
        logit_scale,
        softcap,
    )
    logp = logp.view(labels.shape)
    if return_entropy:
        return logp, ent.view(labels.shape)
    return logp


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = TEMPERATURE,
    ignore_index: int = IGNORE_INDEX,
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
    logp, ent, _ = logprobs_from_logits_fwd(
        z.contiguous(), lab.contiguous(), temperature, int(ignore_index), bool(return_entropy), be
    )
    logp = logp.view(labels.shape)
    if return_entropy:
        return logp, ent.view(labels.shape)
    return logp


# --------------------------------------------------------------------------- registration
# torch.library custom ops over the backends, their fakes and autograd (_registration.py).
#
# The forwards return a fourth output, ``saved``: what the backend's backward needs from
# its forward (the chunk driver's kept logits or per-row norms; empty where nothing),
# sized by ``_dispatch.saved_numel``. The op saves it for its backward (eager), which
# passes it back; the Python-level ``linear_logprobs_fwd`` and
# ``logprobs_from_logits_fwd`` return the first three outputs. The backward may overwrite
# ``saved`` (the chunk driver writes the kept rows' gradient over their fp32 logits where
# its kernel works in place): the backward op declares the mutation, which advances the
# tensor's version, so a later backward of the same graph (retain_graph, gradcheck) passes
# none and the backend recomputes. Traced code (torch.compile) passes none either: its
# backward recomputes what it needs. ``saved`` has no default on purpose: torch before 2.12
# drops a trailing argument equal to its default before its ADInplaceOrView kernel indexes
# the mutated arguments by position, so a defaulted ``saved`` that is None made every traced
# backward fail there (IndexError, seen on the H200 under torch 2.11). The
# vocabulary-parallel path (_vocab_parallel.py) calls the linear ops through
# ``torch.ops.mrtpo``.


@torch.library.custom_op("mrtpo::linear_logprobs_fwd", mutates_args=())
def linear_logprobs_fwd_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    backend: str,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # the logit transform (logit_scale, softcap: 0 for none) goes to the backend only where
    # it is active: the identity calls the backend exactly as before it existed
    fn = _dispatch.get(backend, "linear_logprobs_fwd")
    return fn(
        hidden,
        weight,
        bias,
        labels,
        temperature,
        ignore_index,
        with_entropy,
        **_cap_kw(logit_scale, softcap),
    )


def _cap_kw(logit_scale: float, softcap: float) -> dict:
    """The backends' keywords of an active logit transform; none for the identity."""
    if logit_scale == 1.0 and softcap == 0.0:
        return {}
    return {"logit_scale": logit_scale, "softcap": softcap}


@linear_logprobs_fwd_op.register_fake
def _(
    hidden,
    weight,
    bias,
    labels,
    temperature,
    ignore_index,
    with_entropy,
    backend,
    logit_scale=1.0,
    softcap=0.0,
):
    n, v = hidden.shape[0], weight.shape[0]
    saved = _dispatch.saved_numel(backend, "linear_logprobs", n, v, weight.numel())
    return (
        empty_rows(hidden, n),
        empty_rows(hidden, n if with_entropy else 0),
        empty_rows(hidden, n),
        empty_rows(hidden, saved),
    )


def linear_logprobs_fwd(
    hidden,
    weight,
    bias,
    labels,
    temperature,
    ignore_index,
    with_entropy,
    backend,
    logit_scale=1.0,
    softcap=0.0,
):
    """(logp, entropy, lse) of ``mrtpo::linear_logprobs_fwd`` (its ``saved`` goes to the
    autograd graph only)."""
    out = linear_logprobs_fwd_op(
        hidden,
        weight,
        bias,
        labels,
        temperature,
        ignore_index,
        with_entropy,
        backend,
        logit_scale,
        softcap,
    )
    return out[0], out[1], out[2]


@torch.library.custom_op("mrtpo::linear_logprobs_bwd", mutates_args=("saved",))
def linear_logprobs_bwd_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    ignore_index: int,
    logit_scale: float,
    softcap: float,
    backend: str,
    own_entropy: bool,
    saved: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    fn = _dispatch.get(backend, "linear_logprobs_bwd")
    return fn(
        hidden,
        weight,
        bias,
        labels,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        temperature,
        ignore_index,
        saved,
        **_cap_kw(logit_scale, softcap),
        own_entropy=own_entropy,
    )


@linear_logprobs_bwd_op.register_fake
def _(
    hidden,
    weight,
    bias,
    labels,
    lse,
    entropy,
    grad_logp,
    grad_entropy,
    temperature,
    ignore_index,
    logit_scale,
    softcap,
    backend,
    own_entropy,
    saved,
):
    return (
        torch.empty_like(hidden),
        weight.new_empty(weight.shape, dtype=acc_dtype(hidden)),
        weight.new_empty(bias.shape[0] if bias is not None else 0, dtype=acc_dtype(hidden)),
    )


def _linear_setup(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, ignore_index, with_entropy, backend = inputs[:8]
    logit_scale, softcap = inputs[8:] if len(inputs) > 8 else (1.0, 0.0)
    logp, entropy, lse, saved = output
    ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
    keep_saved(ctx, saved)
    ctx.cfg = (temperature, ignore_index, with_entropy, backend, bias is not None)
    ctx.cap = (logit_scale, softcap)
    ctx.set_materialize_grads(False)  # lse gets no gradient; unused ones stay None


def _linear_backward(ctx, g_logp, g_entropy, g_lse, g_saved):
    hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, with_entropy, backend, has_bias = ctx.cfg
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    if g_entropy is None or not with_entropy:
        g_entropy = lse.new_empty(0)
    dh, dw, db = linear_logprobs_bwd_op(
        hidden,
        weight,
        bias,
        labels,
        lse,
        entropy,
        g_logp.to(lse.dtype).contiguous(),
        g_entropy.to(lse.dtype).contiguous(),
        temperature,
        ignore_index,
        *ctx.cap,
        backend,
        True,  # the forward's own entropy
        saved_state(ctx),
    )
    dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
    db = db.to(bias.dtype) if has_bias and ctx.needs_input_grad[2] else None
    dh = dh if ctx.needs_input_grad[0] else None
    return (dh, dw, db) + (None,) * (len(ctx.needs_input_grad) - 3)


linear_logprobs_fwd_op.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("mrtpo::logprobs_from_logits_fwd", mutates_args=())
def logprobs_from_logits_fwd_op(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = _dispatch.get(backend, "logprobs_from_logits_fwd")
    return fn(logits, labels, temperature, ignore_index, with_entropy)


@logprobs_from_logits_fwd_op.register_fake
def _(logits, labels, temperature, ignore_index, with_entropy, backend):
    n = logits.shape[0]
    saved = _dispatch.saved_numel(backend, "logprobs_from_logits", n, logits.shape[1], 0)
    return (
        empty_rows(logits, n),
        empty_rows(logits, n if with_entropy else 0),
        empty_rows(logits, n),
        empty_rows(logits, saved),
    )


def logprobs_from_logits_fwd(logits, labels, temperature, ignore_index, with_entropy, backend):
    """(logp, entropy, lse) of ``mrtpo::logprobs_from_logits_fwd`` (its ``saved`` goes to the
    autograd graph only)."""
    out = logprobs_from_logits_fwd_op(
        logits, labels, temperature, ignore_index, with_entropy, backend
    )
    return out[0], out[1], out[2]


@torch.library.custom_op("mrtpo::logprobs_from_logits_bwd", mutates_args=("saved",))
def logprobs_from_logits_bwd_op(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    ignore_index: int,
    backend: str,
    saved: Tensor | None,
) -> Tensor:
    fn = _dispatch.get(backend, "logprobs_from_logits_bwd")
    return fn(
        logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, saved
    )


@logprobs_from_logits_bwd_op.register_fake
def _(
    logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, backend, saved
):
    return torch.empty_like(logits)


def _logits_setup(ctx, inputs, output):
    logits, labels, temperature, ignore_index, with_entropy, backend = inputs
    logp, entropy, lse, saved = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    keep_saved(ctx, saved)
    ctx.cfg = (temperature, ignore_index, with_entropy, backend)
    ctx.set_materialize_grads(False)


def _logits_backward(ctx, g_logp, g_entropy, g_lse, g_saved):
    logits, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, with_entropy, backend = ctx.cfg
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    if g_entropy is None or not with_entropy:
        g_entropy = lse.new_empty(0)
    dl = logprobs_from_logits_bwd_op(
        logits,
        labels,
        lse,
        entropy,
        g_logp.to(lse.dtype).contiguous(),
        g_entropy.to(lse.dtype).contiguous(),
        temperature,
        ignore_index,
        backend,
        saved_state(ctx),
    )
    return dl, None, None, None, None, None


logprobs_from_logits_fwd_op.register_autograd(_logits_backward, setup_context=_logits_setup)
