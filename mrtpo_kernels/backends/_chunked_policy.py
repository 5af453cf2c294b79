"""The chunk driver's policy loss (backends/_chunked.py lists the driver's modules):
``linear_policy_loss``, the clipped surrogate and, with a gradient, dL/dlogits from the
row kernel in the same pass, then dh and dW by the token-chunked backward walk
(_chunk_backward.py); in low-memory mode the token terms from the log-probs, then the
vocabulary-chunked backward.

GEMMs (N d V multiply-adds each over the call): 3 (forward with gradient).
"""

from __future__ import annotations

from .._types import acc_dtype
from ._chunk_backward import _backward_by_vocab, _low_memory, _run_backward
from ._chunk_sizes import _buffer, _none_if_empty, _out, balanced, chunk_rows, grad_spans
from ._lm_head import Head
from ._saved_state import norm_buffer, norm_rows


def linear_policy_loss(
    kern,
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
):
    """(loss, logp, clipped, dh, dw, db): the clipped-surrogate loss sum_t token_weight[t]
    L_t and, with need_grad, its gradient in the same pass; ``cfg`` the op's scalar
    settings (``PolicyLossSettings``), handed to the row kernel as they are."""
    acc = acc_dtype(hidden)
    n, v = hidden.shape[0], weight.shape[0]
    head = Head(kern, hidden, weight, bias, cfg.logit_cap)
    ref_logp = _none_if_empty(ref_logp)
    if need_grad and _low_memory(kern, weight):
        return _policy_by_vocab(
            kern,
            head,
            hidden,
            weight,
            bias,
            labels,
            old_logp,
            advantages,
            token_weight,
            ref_logp,
            cfg,
        )
    logp = hidden.new_empty(n, dtype=acc)
    clipped = hidden.new_empty(n, dtype=acc)
    loss = hidden.new_zeros((), dtype=acc)

    def rows(z, g, a, b):  # the token terms and, with need_grad, dL/dz in place or into g
        per_tok, lp, cl = kern.policy_(
            z,
            labels[a:b],
            old_logp[a:b],
            advantages[a:b],
            token_weight[a:b],
            None if ref_logp is None else ref_logp[a:b],
            cfg,
            need_grad,
            **_out(g, 0, b - a),
        )
        loss.add_((per_tok * token_weight[a:b]).sum())
        logp[a:b] = lp
        clipped[a:b] = cl

    spans = grad_spans(n, v, 0, head.low and need_grad)
    dh, dw, db = _run_backward(
        head, hidden, weight, bias, spans, None, 0, rows, chunk_rows(v), need_dw=need_grad
    )
    return loss, logp, clipped, dh, dw, db


def _policy_by_vocab(
    kern, head, hidden, weight, bias, labels, old_logp, advantages, token_weight, ref_logp, cfg
):
    """Low-memory policy loss: the log-probs and lse by token chunks (1 GEMM), the token
    terms from them, then the vocabulary-chunked backward (3 GEMMs: one is a recompute)."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = acc_dtype(hidden)
    inv_t, ignore_index = 1.0 / cfg.temperature, cfg.ignore_index
    logp = hidden.new_empty(n, dtype=acc)
    lse = hidden.new_empty(n, dtype=acc)
    norm = norm_buffer(kern, n, hidden) if n else None  # (raw max, log s) per row
    c = chunk_rows(v)
    buf = _buffer(c, n, v, hidden, acc)
    for s, e in balanced(n, c):
        # logits = h[s:e] W^T (+ b), fp32: the forward's one GEMM per token chunk
        z = head.logits(hidden[s:e], buf)
        lp, _, ls = kern.stats(z, labels[s:e], inv_t, ignore_index, False, **norm_rows(norm, s, e))
        logp[s:e] = lp
        lse[s:e] = ls
    del buf
    per_tok, clipped, g = kern.policy_terms(
        logp, labels, old_logp, advantages, token_weight, ref_logp, v, cfg
    )
    loss = (per_tok * token_weight).sum()
    dh, dw, db = _backward_by_vocab(
        kern, head, hidden, weight, bias, labels, lse, None, g, None, inv_t, ignore_index, norm
    )  # the head's cap: the slope in its grad_cols_
    return loss, logp, clipped, dh, dw, db
