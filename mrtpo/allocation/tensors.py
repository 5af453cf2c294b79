"""The allocation decisions (``mrtpo.allocation``) applied to a batch: the relevance that
allocates each reward, the has_info mask and the gamma that ``mrtpo_token_advantages`` (or
an adapter's ``mrtpo_advantages_for_grpo``) receives, from the replay's relevance.

In order: truncated credit (a cut response's pairs lose their spans: GDPO's broadcast),
the relevance form (``allocating_relevance``), stop credit (``stop_token_at_mean``). The
packed layout ((K, N) relevance, (n,) lengths) is ``mrtpo train``'s; ``mask=`` in place of
``lengths=`` takes TRL's padded layout ((K, B, T) relevance, (B, T) mask).
"""

from __future__ import annotations

import torch

from mrtpo_kernels import specific_relevance

from . import RELEVANCES, Allocation

__all__ = [
    "allocating_relevance",
    "allocation_inputs",
    "stop_token_at_mean",
]


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def allocating_relevance(form: str, relevance, has_info, lengths=None, control=None):
    """The relevance that allocates each reward under the relevance ``form``, from the step's
    relevance (the replay's d; its log-ratio under ``logratio``, the oracle's mask under
    ``oracle``): ``specific`` and ``control`` go through ``specific_relevance``
    (``control``: d_ctrl, which ``control`` needs); every other form allocates as it is
    (the same tensor). Packed: (K, N) with ``lengths`` (n,); padded: (K, B, T) with
    ``lengths`` None. ``has_info``: (n, K) or (B, K)."""
    if form not in RELEVANCES:
        raise ValueError(f"relevance: expected one of {RELEVANCES}, got {form!r}")
    if form not in ("specific", "control"):
        return relevance
    if form == "control" and control is None:
        raise ValueError("relevance: 'control' needs the control replay's distances")
    cu = None if lengths is None else _cu_seqlens(lengths)
    ctrl = control if form == "control" else None  # specific: d_k minus the other rewards' d
    return specific_relevance(relevance, has_info, control=ctrl, cu_seqlens=cu)


def stop_token_at_mean(relevance, lengths, finished, gamma):
    """``relevance`` (K, N) raised to ``gamma`` in float64, with the last token of each
    finished response (``finished`` (n,) bool, at least 2 tokens) set to the mean of d^gamma
    over the response's other tokens. Allocate it with gamma 1: its weight is then 1 for
    every reward (GDPO's share of the stop decision), every other token's weight is d^gamma
    over that mean (as in the response without its stop token), and the delta test sees the
    same mean.

    The power is handed over, not the d whose power it is ((mean d^gamma)^(1/gamma)): that d
    leaves every float's range at small gamma (0.5^1000 at gamma 1e-3), and even in range
    rounding it to float32 before the kernel raises it again to gamma moved the weights; at
    gamma 0.01 the stop token's d underflowed to 0 (weight 0, the others' weights shifted).
    d^gamma itself lies in [0, 1] (d is a distance) and needs no range."""
    last = torch.cumsum(lengths, 0) - 1
    pick = finished & (lengths >= 2)
    p = relevance.clamp(min=0).double() ** gamma
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    sums = torch.zeros(p.shape[0], len(lengths), dtype=p.dtype, device=p.device)
    sums = sums.index_add_(1, seg, p)
    at = last[pick]  # only the picked responses' last tokens (an empty response has none)
    p[:, at] = (sums[:, pick] - p[:, at]) / (lengths[pick] - 1)
    return p


def allocation_inputs(
    allocation: Allocation,
    relevance,
    has_info,
    gamma,
    *,
    lengths=None,
    mask=None,
    finished=None,
    control=None,
):
    """``(relevance, has_info, gamma)`` for the advantage op, from the step's relevance.

    Packed (``lengths`` (n,)): ``relevance`` (K, N), ``has_info`` (n, K). Padded (``mask``
    (B, T), the completion tokens): ``relevance`` (K, B, T), ``has_info`` (B, K); where stop
    credit changes it, the relevance comes back float64 with 0 on padding. ``finished``
    (n,) or (B,) bool: the response ended with its stop token (None where unknown: neither
    credit rule then applies). ``control``: d_ctrl (N,) of the control form."""
    if (lengths is None) == (mask is None):
        raise ValueError("lengths, mask: give exactly one (packed or padded layout)")
    if allocation.truncated_credit == "uniform" and finished is not None:
        has_info = has_info & finished[:, None]  # a cut response: GDPO's broadcast
    relevance = allocating_relevance(allocation.relevance, relevance, has_info, lengths, control)
    if allocation.stop_credit == "uniform" and finished is not None:
        # float64 d^gamma allocated with gamma 1 (the op computes in float64 for it)
        if mask is None:
            relevance = stop_token_at_mean(relevance, lengths, finished, gamma)
        else:
            m = mask.bool()
            packed = stop_token_at_mean(relevance[:, m], m.sum(dim=1), finished, gamma)
            relevance = torch.zeros(relevance.shape, dtype=packed.dtype, device=packed.device)
            relevance[:, m] = packed
        gamma = 1.0
    return relevance, has_info, gamma
