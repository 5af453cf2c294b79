"""Plain PyTorch references for every op: the ground truth (run them in float64).

Each function computes in the dtype of its inputs, so the same code serves two purposes:
called on float64 tensors it is the ground truth the kernels are tested against; called on
bf16/fp32 tensors it is "what plain PyTorch gives in that dtype", the yardstick for the
error budget (a kernel may be off the float64 truth by at most 2x what this is, plus atol).

Everything here materializes [tokens x vocab] tensors on purpose: clarity over memory.
The math follows docs/METHOD.md; section numbers refer to it. The advantage references
(``gdpo_advantages_ref``, ``mrtpo_token_advantages_ref``, ``specific_relevance_ref``) live in
``_reference_advantages`` and are importable from here.
"""

from __future__ import annotations

import math

import torch

from ._reference_advantages import (
    FLAT_REL,
    MEAN_FLOOR,
    gdpo_advantages_ref,
    mrtpo_token_advantages_ref,
    specific_relevance_ref,
)
from ._types import (
    IGNORE_INDEX,
    LOGIT_SCALE,
    SOFTCAP,
    TEMPERATURE,
    GDPOAdvantages,
    TokenAdvantages,
)
from ._types import POLICY_LOSS_DEFAULTS as _PD

__all__ = [
    "GDPOAdvantages",
    "TokenAdvantages",
    "logprobs_from_logits_ref",
    "head_logits_ref",
    "linear_logprobs_ref",
    "js_distance_ref",
    "linear_js_distance_ref",
    "policy_loss_ref",
    "kl_k3_ref",
    "linear_policy_loss_ref",
    "gdpo_advantages_ref",
    "mrtpo_token_advantages_ref",
    "specific_relevance_ref",
    "FLAT_REL",
    "MEAN_FLOOR",
]

LN2 = math.log(2.0)


# --------------------------------------------------------------------------- log-probs


def logprobs_from_logits_ref(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = TEMPERATURE,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
):
    """log softmax(logits / temperature)[label] per row; 0 where label == ignore_index.

    logits: (N, V); labels: (N,). Returns logp (N,) [, entropy (N,)] in logits' dtype.
    Non-finite inputs follow the README's "Numerics" contract: a row with a NaN or a +inf
    (or nothing but -inf) gives NaN, -inf entries are masked, a label outside [0, V) that
    is not ignore_index gives a NaN log-prob; z / temperature never overflows (_scaled).
    """
    valid = labels != ignore_index
    # an ignored row is never read: 0 out, and a zero gradient even if it holds NaN / inf
    logits = torch.where(valid.unsqueeze(-1), logits, torch.zeros_like(logits))
    logp_all = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    use = valid & (labels >= 0) & (labels < logits.shape[-1])
    safe = torch.where(use, labels, torch.zeros_like(labels))
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(use, logp, torch.full_like(logp, float("nan")))
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    ent = -_plogp(logp_all).sum(-1)
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    return logp, ent


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - max) / temperature per row: equal to logits / temperature up to a per-row
    constant (which log_softmax drops), but it cannot overflow for finite logits unless the
    true value is beyond the float range (halved first: logits/2 - max/2 never overflows).
    A row with a NaN or a +inf, or all -inf, becomes NaN (inf - inf, NaN - NaN)."""
    half_max = 0.5 * logits.amax(-1, keepdim=True)
    return (0.5 * logits - half_max) / (0.5 * temperature)


def _plogp(logp: torch.Tensor) -> torch.Tensor:
    """p log p elementwise, 0 where p = 0 exactly (a -inf log-prob); NaN stays NaN."""
    out = logp.exp() * logp
    return torch.where(logp == float("-inf"), torch.zeros_like(out), out)


def head_logits_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    logit_scale: float = LOGIT_SCALE,
    softcap: float | None = SOFTCAP,
) -> torch.Tensor:
    """The LM head's logits before the temperature, in Hugging Face's order (Cohere's
    logit_scale, then Gemma 2 / 3's final_logit_softcapping; generation divides by the
    temperature after both): r = hidden @ weight.T + bias, z = r * logit_scale, then
    z = softcap * tanh(z / softcap) when softcap is not None."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def linear_logprobs_ref(
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
):
    """logprobs_from_logits_ref(head_logits_ref(hidden, weight, bias, ...), ...). hidden
    (N, d), weight (V, d)."""
    logits = head_logits_ref(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    return logprobs_from_logits_ref(
        logits,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
    )


# --------------------------------------------------------------------------- JS distance


def js_distance_ref(
    logits_p: torch.Tensor, logits_q: torch.Tensor, *, temperature: float = TEMPERATURE
) -> torch.Tensor:
    """Per-row Jensen-Shannon distance sqrt(JSD / ln 2) in [0, 1] (METHOD.md section 3).

    logits_p: (N, V); logits_q: (N, V) or (K, N, V). Returns (N,) or (K, N).
    Uses the stable form log m = logaddexp(log p, log q) - ln 2; terms with p = 0 give 0.
    A NaN (or +inf, or all -inf) row on either side gives NaN (README "Numerics").
    """
    lp = torch.log_softmax(_scaled(logits_p, temperature), dim=-1)
    lq = torch.log_softmax(_scaled(logits_q, temperature), dim=-1)
    if lq.dim() == 3:
        lp = lp.unsqueeze(0)
    lm = torch.logaddexp(lp, lq) - LN2
    ninf = float("-inf")
    kl_pm = torch.where(lp == ninf, torch.zeros_like(lp), lp.exp() * (lp - lm)).sum(-1)
    kl_qm = torch.where(lq == ninf, torch.zeros_like(lq), lq.exp() * (lq - lm)).sum(-1)
    jsd = 0.5 * kl_pm + 0.5 * kl_qm
    return torch.sqrt(torch.clamp(jsd, min=0.0) / LN2).clamp(max=1.0)


def linear_js_distance_ref(
    hidden_p: torch.Tensor,
    hidden_q: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = TEMPERATURE,
    logit_scale: float = LOGIT_SCALE,
    softcap: float | None = SOFTCAP,
) -> torch.Tensor:
    """js_distance_ref of the two streams' logits through one LM head (head_logits_ref).

    hidden_p: (N, d); hidden_q: (N, d) or (K, N, d); weight: (V, d). Returns (N,) or (K, N).
    """
    lp = head_logits_ref(hidden_p, weight, bias, logit_scale=logit_scale, softcap=softcap)
    lq = head_logits_ref(hidden_q, weight, bias, logit_scale=logit_scale, softcap=softcap)
    return js_distance_ref(lp, lq, temperature=temperature)


# --------------------------------------------------------------------------- policy loss


def _aggregate_ref(per_token, mask, aggregation, seq_ids, num_seqs, norm_len):
    """Reduce a per-token loss to a scalar by one of the METHOD.md section 6 rules."""
    m = mask.to(per_token.dtype)
    if aggregation == "token-mean":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    sums = torch.zeros(num_seqs, dtype=per_token.dtype, device=per_token.device)
    sums = sums.index_add(0, seq_ids, per_token * m)
    counts = torch.zeros(num_seqs, dtype=per_token.dtype, device=per_token.device)
    counts = counts.index_add(0, seq_ids, m)
    present = counts > 0
    if aggregation == "seq-mean-token-mean":
        per_seq = torch.where(present, sums / counts.clamp(min=1), torch.zeros_like(sums))
    elif aggregation == "seq-mean-token-sum-norm":
        # default: the most valid tokens of one sequence (the op's rule)
        per_seq = sums / (counts.max().clamp(min=1) if norm_len is None else norm_len)
    else:
        raise ValueError(f"aggregation: unknown {aggregation!r}")
    return per_seq.sum() / present.sum().clamp(min=1)


K3_SERIES = 0.5  # |d| below this: the k3 KL from its Taylor series (see kl_k3_ref)
K3_TERMS = tuple(1.0 / math.factorial(n) for n in range(2, 17))  # 1/2!, ..., 1/16!


def kl_k3_ref(d: torch.Tensor) -> torch.Tensor:
    """The k3 KL estimator exp(d) - d - 1 of d = ref - logp, without its cancellation.

    exp(d) - d - 1 written as such loses every digit for small |d| (float32 gives 0 or
    noise for |d| ~ 1e-5, float64 for |d| ~ 1e-8). Here: sum_{n >= 2} d^n / n! through
    1/16! for |d| < 1/2 (truncation below 2e-19 relative, every term of one sign or
    alternating with a shrinking magnitude), expm1(d) - d beyond (at most a few ulps).
    NaN stays NaN; d = +inf gives NaN (inf - inf) and d = -inf gives +inf, as the plain
    form does."""
    small = d.abs() < K3_SERIES
    ds = torch.where(small, d, torch.zeros_like(d))
    poly = torch.full_like(d, K3_TERMS[-1])
    for c in reversed(K3_TERMS[:-1]):
        poly = poly * ds + c
    return torch.where(small, ds * ds * poly, torch.expm1(d) - d)


def policy_loss_ref(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = _PD.clip_low,
    clip_high: float = _PD.clip_high,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = _PD.beta,
    aggregation: str = "token-mean",
    seq_ids: torch.Tensor | None = None,
    num_seqs: int = 1,
    norm_len: float | None = None,
    clip_ratio_c: float | None = None,
    kl_importance_weight: bool = _PD.kl_importance_weight,
):
    """Token-level clipped surrogate (METHOD.md section 6) from per-token log-probs.

    All per-token tensors are (N,); seq_ids (N,) names each token's sequence for the
    sequence-level aggregations; norm_len (seq-mean-token-sum-norm) defaults to the most
    valid tokens of one sequence. Returns (loss, metrics) with metrics clip_fraction and
    mean_ratio over the valid tokens (and kl when beta != 0).

    Two options outside METHOD.md: ``clip_ratio_c`` (> 1), the dual clip: a token with
    A < 0 has its loss capped at -A clip_ratio_c (metric dual_clip_fraction, the tokens
    where the cap binds); ``kl_importance_weight``: the k3 KL term of each token is
    multiplied by the importance ratio exp(logp - old) (not detached).
    """
    # ignored tokens are never read (an old log-prob there may be -inf): neutral values
    old_logprobs = torch.where(mask, old_logprobs, logprobs)
    advantages = torch.where(mask, advantages, torch.zeros_like(advantages))
    if ref_logprobs is not None:
        ref_logprobs = torch.where(mask, ref_logprobs, logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    per_token = -surrogate
    dual = None
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
    kl = None
    if ref_logprobs is not None and beta != 0.0:
        kl = kl_k3_ref(ref_logprobs - logprobs)
        if kl_importance_weight:
            kl = kl * ratio
        per_token = per_token + beta * kl
    if seq_ids is None:
        seq_ids = torch.zeros_like(mask, dtype=torch.long)
    loss = _aggregate_ref(per_token, mask, aggregation, seq_ids, num_seqs, norm_len)
    m = mask.to(per_token.dtype)
    n = m.sum().clamp(min=1)
    was_clipped = (ratio * advantages > clipped_ratio * advantages).to(per_token.dtype)
    metrics = {
        "clip_fraction": (was_clipped * m).sum() / n,
        "mean_ratio": (ratio * m).sum() / n,
    }
    if dual is not None:
        metrics["dual_clip_fraction"] = (dual.to(per_token.dtype) * m).sum() / n
    if kl is not None:
        metrics["kl"] = (kl * m).sum() / n
    return loss, metrics


def linear_policy_loss_ref(
    hidden,
    weight,
    labels,
    old_logprobs,
    advantages,
    *,
    bias=None,
    temperature=TEMPERATURE,
    clip_low=_PD.clip_low,
    clip_high=_PD.clip_high,
    ignore_index=IGNORE_INDEX,
    ref_logprobs=None,
    beta=_PD.beta,
    aggregation="token-mean",
    seq_ids=None,
    num_seqs=1,
    norm_len=None,
    clip_ratio_c=None,
    kl_importance_weight=_PD.kl_importance_weight,
    logit_scale=LOGIT_SCALE,
    softcap=SOFTCAP,
):
    """policy_loss_ref on linear_logprobs_ref(hidden, weight, labels). All (N, ...) packed."""
    logp = linear_logprobs_ref(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        ignore_index=ignore_index,
        logit_scale=logit_scale,
        softcap=softcap,
    )
    mask = labels != ignore_index
    return policy_loss_ref(
        logp,
        old_logprobs.to(logp.dtype),
        advantages.to(logp.dtype),
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        ref_logprobs=None if ref_logprobs is None else ref_logprobs.to(logp.dtype),
        beta=beta,
        aggregation=aggregation,
        seq_ids=seq_ids,
        num_seqs=num_seqs,
        norm_len=norm_len,
        clip_ratio_c=clip_ratio_c,
        kl_importance_weight=kl_importance_weight,
    )
