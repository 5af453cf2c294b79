"""Token-level clipped policy loss fused with the LM head (METHOD.md section 6).

    ratio = exp(logp - logp_old)
    L_t   = -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + beta KL_k3(ref || pi)
    loss  = sum_t c_t L_t,  with c_t from the aggregation rule
    dL/dlogp_t = c_t (-A ratio [unclipped branch active] + beta (1 - exp(ref - logp)))

The logits may first be transformed (``logit_scale``, ``softcap``: softcap tanh(scale z /
softcap) before the temperature, _types.LogitCap; the logit gradient times its slope).

The gradient with respect to the logits is known in the forward pass (the loss is a scalar),
so the backend computes it there, chunk by chunk, and the backward pass only scales the saved
gradients by the upstream scalar: three GEMMs in all (logits, dH, dW), no recompute.

The public function comes first; its torch.library registration (custom op, fake,
autograd) follows it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _dispatch, _vocab_parallel, settings
from . import _validation as check
from ._token_terms import kl_k3
from ._types import LOGIT_SCALE, SOFTCAP, PolicyLossSettings, acc_dtype
from ._types import POLICY_LOSS_DEFAULTS as _D

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
        num_seqs = b
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        num_seqs = lengths.shape[0]
        seq_ids = torch.repeat_interleave(
            torch.arange(num_seqs, device=valid.device), lengths, output_size=n_tok
        )
    counts = torch.zeros(num_seqs, dtype=dtype, device=valid.device).index_add_(0, seq_ids, v)
    present = (counts > 0).to(dtype).sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        return v / (counts.clamp(min=1.0)[seq_ids] * present)
    # seq-mean-token-sum-norm: norm_len, by default the most valid (not ignored) tokens of
    # one sequence, a count of the tokens themselves: the same for padded and packed
    # layouts of the same tokens (never the padded width T or a span holding ignored ones)
    denom = norm_len if norm_len is not None else counts.amax().clamp(min=1.0)
    return v / (denom * present)


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = _D.temperature,
    clip_low: float = _D.clip_low,
    clip_high: float = _D.clip_high,
    ignore_index: int = _D.ignore_index,
    aggregation: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = _D.beta,
    cu_seqlens: torch.Tensor | None = None,
    norm_len: float | None = None,
    clip_ratio_c: float | None = None,
    kl_importance_weight: bool = _D.kl_importance_weight,
    logit_scale: float = LOGIT_SCALE,
    softcap: float | None = SOFTCAP,
    process_group=None,
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
            over sequences of the token sum divided by ``norm_len``; by default the largest
            number of valid, i.e. not ignored, tokens in one sequence of the call, so that
            padded and packed layouts of the same tokens give the same loss; pass a
            constant, e.g. the maximum response length, for Dr. GRPO's fixed normalizer).
            The sequence rules need (B, T) inputs or ``cu_seqlens`` (n+1,).
        ref_logprobs, beta: optional k3 KL penalty to a reference policy.
        clip_ratio_c: the dual clip (an option outside METHOD.md; verl's ``clip_ratio_c``,
            e.g. 3): a token with A < 0 has its loss capped at -A clip_ratio_c, i.e.
            L_t = min(-min(ratio A, r_c A), -A clip_ratio_c), with zero gradient where the
            cap binds. Must be > 1; None: no dual clip.
        kl_importance_weight: multiply each token's k3 KL term by the importance ratio
            exp(logp - old), not detached (TRL's ``use_bias_correction_kl``; an option
            outside METHOD.md): the term is beta r k3, its gradient beta r (logp - ref).
        logit_scale, softcap: the head's logit transform before the temperature (see
            ``linear_logprobs``; defaults: none, the plain head bit for bit).
        process_group: a vocabulary-parallel head (``torch.distributed`` group): weight and
            bias hold this rank's equal shard of the vocabulary (rows [r V_loc, (r+1) V_loc)
            for rank r of the group), labels are global ids, everything else is the same on
            every rank. Per-token statistics are combined by all-reduce; the loss is the
            same on every rank, the weight's gradient is this shard's, the hidden states'
            is all-reduced. See mrtpo_kernels/_vocab_parallel.py.

    Returns:
        (loss, metrics): a float32 scalar differentiable with respect to hidden, weight and
        bias, and a dict of detached scalars: clip_fraction, mean_ratio (and kl with beta,
        the mean KL term as weighted in the loss; dual_clip_fraction with clip_ratio_c, the
        share of valid tokens whose loss the dual clip caps).
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
    if cu_seqlens is not None:
        check.int_tensor("cu_seqlens", cu_seqlens, ndim=1)
    check.same_device(
        hidden=hidden,
        weight=weight,
        labels=labels,
        old_logprobs=old_logprobs,
        advantages=advantages,
        bias=bias,
        ref_logprobs=ref_logprobs,
        cu_seqlens=cu_seqlens,
    )
    temperature = check.temperature(temperature)
    clip_low = check.non_negative("clip_low", clip_low)
    clip_high = check.non_negative("clip_high", clip_high)
    beta = check.non_negative("beta", beta)
    logit_scale, softcap = check.logit_cap(logit_scale, softcap)
    ignore_index = check.int64("ignore_index", ignore_index)
    if norm_len is not None:
        norm_len = check.positive_finite("norm_len", norm_len)
    if clip_ratio_c is not None:
        clip_ratio_c = check.number("clip_ratio_c", clip_ratio_c)
        if not (clip_ratio_c > 1.0 and check.finite(clip_ratio_c)):
            raise ValueError(
                f"clip_ratio_c: expected a finite number > 1 (the dual clip) or None, "
                f"got {clip_ratio_c}"
            )
    cfg = PolicyLossSettings(
        temperature=temperature,
        clip_low=clip_low,
        clip_high=clip_high,
        beta=beta,
        ignore_index=int(ignore_index),
        clip_ratio_c=math.inf if clip_ratio_c is None else clip_ratio_c,
        kl_importance_weight=bool(kl_importance_weight),
        logit_scale=logit_scale,
        softcap=softcap,
    )
    check.non_empty("hidden", h.shape[0])
    vocab = weight.shape[0]
    if process_group is not None:
        vocab = _vocab_parallel.shard_info(weight, process_group)[2]
    check.labels_in_range(lab, vocab, ignore_index)
    # ignored tokens' old log-probs, advantages and reference log-probs are never read
    scored = lab != ignore_index
    check.all_finite("old_logprobs", old_logprobs.reshape(-1), scored)
    check.all_finite("advantages", advantages.reshape(-1), scored)
    if ref_logprobs is not None and beta != 0.0:
        check.all_finite("ref_logprobs", ref_logprobs.reshape(-1), scored)
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
            cu_seqlens = check.boundaries("cu_seqlens", cu_seqlens, h.shape[0])

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
    if process_group is not None:
        # the sharded head: the log-prob kernels on the shard, combined by all-reduce
        be = _dispatch.resolve("linear_logprobs", h.device, h.dtype, backend)
        loss, logp, clipped = _vocab_parallel.linear_policy_loss(
            h.contiguous(),
            weight.contiguous(),
            None if bias is None else bias.contiguous(),
            lab.contiguous(),
            old,
            adv,
            coef.contiguous(),
            ref,
            cfg,
            be,
            process_group,
        )
    else:
        be = _dispatch.resolve("linear_policy_loss", h.device, h.dtype, backend)
        loss, logp, clipped, _, _, _ = linear_policy_loss_op(
            h.contiguous(),
            weight.contiguous(),
            None if bias is None else bias.contiguous(),
            lab.contiguous(),
            old,
            adv,
            coef.contiguous(),
            ref,
            cfg.temperature,
            cfg.clip_low,
            cfg.clip_high,
            cfg.beta,
            cfg.ignore_index,
            bool(need_grad),
            cfg.clip_ratio_c,
            cfg.kl_importance_weight,
            be,
            cfg.logit_scale,
            cfg.softcap,
        )
    with torch.no_grad():
        v = valid.to(acc)
        n = v.sum().clamp(min=1.0)
        # ignored tokens are excluded before exp (their old log-prob may be -inf)
        ratio = torch.exp(torch.where(valid, logp - old, torch.zeros_like(old)))
        metrics = {
            "clip_fraction": (clipped * v).sum() / n,
            "mean_ratio": (ratio * v).sum() / n,
        }
        if clip_ratio_c is not None:
            cr = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
            surr = -torch.minimum(ratio * adv, cr * adv)
            dual = (adv < 0) & (surr > -adv * clip_ratio_c)
            metrics["dual_clip_fraction"] = (dual.to(acc) * v).sum() / n
        if ref.numel():
            diff = torch.where(valid, ref - logp, torch.zeros_like(ref))
            kl = kl_k3(diff)  # exp(d) - d - 1 without its cancellation
            if kl_importance_weight:
                kl = kl * ratio
            metrics["kl"] = (kl * v).sum() / n
    return loss, metrics


# --------------------------------------------------------------------------- registration


@torch.library.custom_op("mrtpo::linear_policy_loss", mutates_args=())
def linear_policy_loss_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    token_weight: Tensor,
    ref_logp: Tensor,
    temperature: float,
    clip_low: float,
    clip_high: float,
    beta: float,
    ignore_index: int,
    need_grad: bool,
    clip_ratio_c: float,
    kl_importance_weight: bool,
    backend: str,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # the scalar settings travel below the op as one value (clip_ratio_c: the dual clip,
    # inf for none; kl_importance_weight: the KL term times the ratio; logit_scale and
    # softcap, 0 for none: the head's logit transform)
    cfg = PolicyLossSettings(
        temperature=temperature,
        clip_low=clip_low,
        clip_high=clip_high,
        beta=beta,
        ignore_index=ignore_index,
        clip_ratio_c=clip_ratio_c,
        kl_importance_weight=kl_importance_weight,
        logit_scale=logit_scale,
        softcap=softcap,
    )
    fn = _dispatch.get(backend, "linear_policy_loss")
    return fn(
        hidden,
        weight,
        bias,
        labels,
        old_logp,
        advantages,
        token_weight,
        ref_logp,
        cfg,
        need_grad,
    )


@linear_policy_loss_op.register_fake
def _(
    hidden,
    weight,
    bias,
    labels,
    old_logp,
    advantages,
    token_weight,
    ref_logp,
    temperature,
    clip_low,
    clip_high,
    beta,
    ignore_index,
    need_grad,
    clip_ratio_c,
    kl_importance_weight,
    backend,
    logit_scale=1.0,
    softcap=0.0,
):
    n = hidden.shape[0]
    v = weight.shape[0]
    f32 = acc_dtype(hidden)
    return (
        hidden.new_empty((), dtype=f32),
        hidden.new_empty(n, dtype=f32),
        hidden.new_empty(n, dtype=f32),
        torch.empty_like(hidden) if need_grad else hidden.new_empty(0),
        weight.new_empty(weight.shape if need_grad else (0,), dtype=f32),
        weight.new_empty((v if need_grad and bias is not None else 0,), dtype=f32),
    )


def _policy_setup(ctx, inputs, output):
    weight, bias = inputs[1], inputs[2]
    _, _, _, dh, dw, db = output
    # Kept as detached attributes, not saved tensors: _policy_backward does its own
    # version check (see there) so that it can hand these buffers to autograd.
    ctx.grads = tuple(t.detach() for t in (dh, dw, db))
    # no upstream gradient reaches the gradient outputs: without this, autograd would
    # materialize a zero tensor of the weight's size for each of them in backward
    ctx.set_materialize_grads(False)
    ctx.handed_versions = None
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)


def _policy_backward(ctx, g_loss, g_logp, g_clipped, g_dh, g_dw, g_db):
    # The gradient was computed in the forward pass (no recompute): scale it by the
    # upstream gradient of the scalar loss. For loss.backward() (upstream exactly 1, eager
    # mode) the buffers themselves are handed to autograd, which adopts them as .grad
    # without a copy: the peak then holds one weight gradient, not two. A later backward
    # through the same graph still works while those buffers are unmodified, and raises
    # once something (an accumulation into .grad) has written to them.
    # Gradients through the returned log-probs are not supported (they are metrics).
    dh, dw, db = ctx.grads
    w_dtype, b_dtype = ctx.dtypes
    if g_loss is None:  # nothing flowed into the loss (only into the metrics outputs)
        return (None,) * len(ctx.needs_input_grad)
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: the saved gradient is a constant, so a graph built from it
        # would silently drop every second-order term
        raise RuntimeError(
            "linear_policy_loss: double backward (create_graph=True) is not supported: the "
            "gradient is computed in the forward pass and has no graph of its own"
        )
    if dw.numel() == 0:
        raise RuntimeError(
            "mrtpo::linear_policy_loss ran with need_grad=False, so it computed no gradient; "
            "call it with need_grad=True (linear_policy_loss does this when inputs need grad)"
        )
    if ctx.handed_versions is not None and ctx.handed_versions != tuple(
        t._version for t in ctx.grads
    ):
        raise RuntimeError(
            "linear_policy_loss: its gradient buffers, handed to autograd by the first "
            "backward, were modified since (e.g. accumulated into .grad); run the loss again "
            "for another backward"
        )
    eager = type(g_loss) is torch.Tensor and not torch.compiler.is_compiling()  # not traced
    if eager and ctx.handed_versions is None and bool(g_loss == 1):
        out = tuple(t.detach() for t in ctx.grads)  # new aliases: stealable by autograd
        ctx.handed_versions = tuple(t._version for t in ctx.grads)
        gh = out[0] if ctx.needs_input_grad[0] else None
        gw = out[1].to(w_dtype) if ctx.needs_input_grad[1] else None
        gb = out[2].to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        return (gh, gw, gb) + (None,) * (len(ctx.needs_input_grad) - 3)
    gh = _scaled(dh, g_loss, dh.dtype, eager) if ctx.needs_input_grad[0] else None
    gw = _scaled(dw, g_loss, w_dtype, eager) if ctx.needs_input_grad[1] else None
    need_b = b_dtype is not None and ctx.needs_input_grad[2]
    gb = _scaled(db, g_loss, b_dtype, eager) if need_b else None
    return (gh, gw, gb) + (None,) * (len(ctx.needs_input_grad) - 3)


def _scaled(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, eager: bool) -> torch.Tensor:
    """t * g computed in t's dtype and written in ``dtype``, by row blocks of at most
    MRTPO_CHUNK_BYTES: no full-size copy in t's dtype before the cast (for a bf16 weight
    that would be a second fp32 [V, d] dW; the CPU's mixed-dtype ``out=`` stages each block
    in t's dtype). The saved t stays intact for a retained graph. Traced code keeps the
    plain form, which the compiler fuses."""
    g = g.to(t.dtype)
    if not eager or dtype == t.dtype or t.dim() == 0 or t.numel() == 0:
        return (t * g).to(dtype)
    out = torch.empty_like(t, dtype=dtype)
    rows = max(1, settings.chunk_bytes() // max(1, t[0].numel() * t.element_size()))
    for a in range(0, t.shape[0], rows):
        torch.mul(t[a : a + rows], g, out=out[a : a + rows])
    return out


linear_policy_loss_op.register_autograd(_policy_backward, setup_context=_policy_setup)
