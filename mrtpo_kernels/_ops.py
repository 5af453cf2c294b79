"""torch.library custom ops over the backends, with fake (meta) implementations and autograd.

Registering the ops lets torch.compile(fullgraph=True) trace a caller without graph breaks
and lets torch.library.opcheck test them. The backend is a plain string argument that the
public functions resolve before the call, so no op looks at data to decide anything.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch, settings
from .types import acc_dtype


def _empty_like_rows(t: Tensor, n: int) -> Tensor:
    return t.new_empty(n, dtype=acc_dtype(t))


# --------------------------------------------------------------------------- linear log-probs
# The log-probs forwards return a fourth output, ``saved``: what the backend's backward
# needs from its forward (the chunk driver's kept logits or per-row norms, the fused Triton
# kernels' norms; empty where nothing), sized by ``_dispatch.saved_numel``. The op saves it
# for its backward (eager), which passes it back; the Python-level ``linear_logprobs_fwd``
# and ``logits_logprobs_fwd`` below return the first three outputs. The backward may
# overwrite ``saved`` (the chunk driver writes the kept rows' gradient over their fp32 logits
# where its kernel works in place): the backward op declares the mutation, which advances
# the tensor's version, so a later backward of the same graph (retain_graph, gradcheck)
# passes none and the backend recomputes. Traced code (torch.compile) passes none either:
# its backward recomputes what it needs.


def _saved_like(t: Tensor, n: int) -> Tensor:
    return t.new_empty(n, dtype=acc_dtype(t))


def _keep_saved(ctx, saved: Tensor) -> None:
    """Keep the forward's ``saved`` (eager: a plain tensor, not traced) and its version."""
    eager = type(saved) is torch.Tensor and not torch.compiler.is_compiling()
    ctx.saved = saved.detach() if eager else None
    ctx.saved_version = saved._version if eager else None


def _saved_state(ctx) -> Tensor | None:
    """The forward's ``saved`` for this backward, or None (traced, or overwritten by an
    earlier backward of the same graph)."""
    s = ctx.saved
    return s if s is not None and s._version == ctx.saved_version else None


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = _dispatch.get(backend, "linear_logprobs_fwd")
    return fn(hidden, weight, bias, labels, temperature, ignore_index, with_entropy)


@linear_logprobs_fwd_op.register_fake
def _(hidden, weight, bias, labels, temperature, ignore_index, with_entropy, backend):
    n, v = hidden.shape[0], weight.shape[0]
    saved = _dispatch.saved_numel(backend, "linear_logprobs", n, v, weight.numel())
    return (
        _empty_like_rows(hidden, n),
        _empty_like_rows(hidden, n if with_entropy else 0),
        _empty_like_rows(hidden, n),
        _saved_like(hidden, saved),
    )


def linear_logprobs_fwd(hidden, weight, bias, labels, temperature, ignore_index, with_entropy,
                        backend):  # fmt: skip
    """(logp, entropy, lse) of ``mrtpo::linear_logprobs_fwd`` (its ``saved`` goes to the
    autograd graph only)."""
    out = linear_logprobs_fwd_op(
        hidden, weight, bias, labels, temperature, ignore_index, with_entropy, backend
    )
    return out[0], out[1], out[2]


@torch.library.custom_op("mrtpo::linear_logprobs_bwd", mutates_args=("saved",))
def linear_logprobs_bwd(
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
    backend: str,
    saved: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    fn = _dispatch.get(backend, "linear_logprobs_bwd")
    return fn(
        hidden, weight, bias, labels, lse, entropy, grad_logp, grad_entropy, temperature,
        ignore_index, saved,
    )  # fmt: skip


@linear_logprobs_bwd.register_fake
def _(hidden, weight, bias, labels, lse, entropy, grad_logp, grad_entropy, t, ii, backend,
      saved=None):  # fmt: skip
    return (
        torch.empty_like(hidden),
        weight.new_empty(weight.shape, dtype=acc_dtype(hidden)),
        weight.new_empty(bias.shape[0] if bias is not None else 0, dtype=acc_dtype(hidden)),
    )


def _logprobs_setup(ctx, inputs, output):
    hidden, weight, bias, labels, temperature, ignore_index, with_entropy, backend = inputs
    logp, entropy, lse, saved = output
    ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
    _keep_saved(ctx, saved)
    ctx.cfg = (temperature, ignore_index, with_entropy, backend, bias is not None)
    ctx.set_materialize_grads(False)  # lse gets no gradient; unused ones stay None


def _logprobs_backward(ctx, g_logp, g_entropy, g_lse, g_saved):
    hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, with_entropy, backend, has_bias = ctx.cfg
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    if g_entropy is None or not with_entropy:
        g_entropy = lse.new_empty(0)
    dh, dw, db = linear_logprobs_bwd(
        hidden, weight, bias, labels, lse, entropy, g_logp.to(lse.dtype).contiguous(),
        g_entropy.to(lse.dtype).contiguous(), temperature, ignore_index, backend,
        _saved_state(ctx),
    )  # fmt: skip
    dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
    db = db.to(bias.dtype) if has_bias and ctx.needs_input_grad[2] else None
    dh = dh if ctx.needs_input_grad[0] else None
    return dh, dw, db, None, None, None, None, None


linear_logprobs_fwd_op.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


# --------------------------------------------------------------------------- logits log-probs


@torch.library.custom_op("mrtpo::logits_logprobs_fwd", mutates_args=())
def logits_logprobs_fwd_op(
    logits: Tensor,
    labels: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = _dispatch.get(backend, "logits_logprobs_fwd")
    return fn(logits, labels, temperature, ignore_index, with_entropy)


@logits_logprobs_fwd_op.register_fake
def _(logits, labels, temperature, ignore_index, with_entropy, backend):
    n = logits.shape[0]
    saved = _dispatch.saved_numel(backend, "logprobs_from_logits", n, logits.shape[1], 0)
    return (
        _empty_like_rows(logits, n),
        _empty_like_rows(logits, n if with_entropy else 0),
        _empty_like_rows(logits, n),
        _saved_like(logits, saved),
    )


def logits_logprobs_fwd(logits, labels, temperature, ignore_index, with_entropy, backend):
    """(logp, entropy, lse) of ``mrtpo::logits_logprobs_fwd`` (its ``saved`` goes to the
    autograd graph only)."""
    out = logits_logprobs_fwd_op(logits, labels, temperature, ignore_index, with_entropy, backend)
    return out[0], out[1], out[2]


@torch.library.custom_op("mrtpo::logits_logprobs_bwd", mutates_args=("saved",))
def logits_logprobs_bwd(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor,
    temperature: float,
    ignore_index: int,
    backend: str,
    saved: Tensor | None = None,
) -> Tensor:
    fn = _dispatch.get(backend, "logits_logprobs_bwd")
    return fn(
        logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, saved
    )


@logits_logprobs_bwd.register_fake
def _(logits, labels, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index, backend,
      saved=None):  # fmt: skip
    return torch.empty_like(logits)


def _logits_setup(ctx, inputs, output):
    logits, labels, temperature, ignore_index, with_entropy, backend = inputs
    logp, entropy, lse, saved = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    _keep_saved(ctx, saved)
    ctx.cfg = (temperature, ignore_index, with_entropy, backend)
    ctx.set_materialize_grads(False)


def _logits_backward(ctx, g_logp, g_entropy, g_lse, g_saved):
    logits, labels, lse, entropy = ctx.saved_tensors
    temperature, ignore_index, with_entropy, backend = ctx.cfg
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    if g_entropy is None or not with_entropy:
        g_entropy = lse.new_empty(0)
    dl = logits_logprobs_bwd(
        logits, labels, lse, entropy, g_logp.to(lse.dtype).contiguous(),
        g_entropy.to(lse.dtype).contiguous(), temperature, ignore_index, backend,
        _saved_state(ctx),
    )  # fmt: skip
    return dl, None, None, None, None, None


logits_logprobs_fwd_op.register_autograd(_logits_backward, setup_context=_logits_setup)


# --------------------------------------------------------------------------- JS distance


@torch.library.custom_op("mrtpo::linear_js", mutates_args=())
def linear_js(
    hidden_p: Tensor,
    hidden_q: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    backend: str,
) -> Tensor:
    return _dispatch.get(backend, "linear_js")(hidden_p, hidden_q, weight, bias, temperature)


@linear_js.register_fake
def _(hidden_p, hidden_q, weight, bias, temperature, backend):
    return hidden_p.new_empty((hidden_q.shape[0], hidden_p.shape[0]), dtype=acc_dtype(hidden_p))


@torch.library.custom_op("mrtpo::logits_js", mutates_args=())
def logits_js(logits_p: Tensor, logits_q: Tensor, temperature: float, backend: str) -> Tensor:
    return _dispatch.get(backend, "logits_js")(logits_p, logits_q, temperature)


@logits_js.register_fake
def _(logits_p, logits_q, temperature, backend):
    return logits_p.new_empty((logits_q.shape[0], logits_p.shape[0]), dtype=acc_dtype(logits_p))


# --------------------------------------------------------------------------- policy loss


@torch.library.custom_op("mrtpo::linear_policy_loss", mutates_args=())
def linear_policy_loss(
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # clip_ratio_c: the dual clip, inf for none; kl_importance_weight: KL term times ratio
    fn = _dispatch.get(backend, "linear_policy_loss")
    return fn(
        hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp,
        temperature, clip_low, clip_high, beta, ignore_index, need_grad,
        clip_ratio_c=clip_ratio_c, kl_iw=kl_importance_weight,
    )  # fmt: skip


@linear_policy_loss.register_fake
def _(hidden, weight, bias, labels, old, adv, tw, ref, t, cl, ch, beta, ii, need_grad, cc, kiw,
      backend):  # fmt: skip
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
        return (None,) * 17
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
        return (gh, gw, gb) + (None,) * 14
    gh = _scaled(dh, g_loss, dh.dtype, eager) if ctx.needs_input_grad[0] else None
    gw = _scaled(dw, g_loss, w_dtype, eager) if ctx.needs_input_grad[1] else None
    need_b = b_dtype is not None and ctx.needs_input_grad[2]
    gb = _scaled(db, g_loss, b_dtype, eager) if need_b else None
    return (gh, gw, gb) + (None,) * 14


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


linear_policy_loss.register_autograd(_policy_backward, setup_context=_policy_setup)


# --------------------------------------------------------------------------- reallocation


@torch.library.custom_op("mrtpo::reallocate_packed", mutates_args=())
def reallocate_packed(
    per_reward: Tensor,
    lam: Tensor,
    has_info: Tensor,
    relevance: Tensor,
    cu_seqlens: Tensor,
    mean: Tensor,
    std: Tensor,
    alpha: float,
    gamma: float,
    eps_batch: float,
    delta: float,
    clip_min: float,
    clip_max: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    fn = _dispatch.get(backend, "reallocate_packed")
    return fn(
        per_reward=per_reward,
        lam=lam,
        has_info=has_info,
        relevance=relevance,
        cu_seqlens=cu_seqlens,
        mean=mean,
        std=std,
        alpha=alpha,
        gamma=gamma,
        eps_batch=eps_batch,
        delta=delta,
        clip_min=clip_min,
        clip_max=clip_max,
    )


@reallocate_packed.register_fake
def _(per_reward, lam, has_info, relevance, cu, mean, std, a, g, e, d, c0, c1, backend):
    f32 = acc_dtype(relevance)
    return (
        relevance.new_empty(relevance.shape[1], dtype=f32),
        relevance.new_empty(relevance.shape, dtype=f32),
    )
