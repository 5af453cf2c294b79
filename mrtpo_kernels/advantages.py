"""GDPO per-reward advantages and MRTPO token advantages (METHOD.md sections 1, 4, 5).

GDPO: each reward is normalized inside its group, A_k = (r_k - mean_g) / (std_g + eps)
(unbiased std; 0 for a group of one or a reward with zero variance in the group), summed
with weights lambda_k to S, then S is normalized over the batch. ``scale_rewards`` (TRL's
option, per reward): "group" is that; "batch" divides r_k - mean_g by reward k's std over
the whole batch + eps instead, "none" by nothing.

MRTPO: reward k's advantage is spread over response i's tokens by allocation weights
w_k[t] = (1 - alpha) + alpha d_k[t]^gamma / mean_t d_k^gamma (uniform where reward k has no
verifier spans, the mean is below delta, or below MEAN_FLOOR = 2^-126 whatever delta: an
all-zero relevance is uniform at delta = 0 too), so that sum_t A[i, t] = T_i x GDPO
advantage.

Settings: the keywords, or ``settings=`` one ``AdvantageSettings``, checked in one place
(``advantage_settings``) and carried down as one value; GDPO's statistics are in ``_gdpo``.
The reallocation kernels' output is final (GDPO's sequence advantage plus the zero-sum
redistribution over D, computed in the kernel): nothing patches it afterwards.

The public functions come first; the token advantages' torch.library registration (custom
op over the backends' reallocation kernels, and its fake) follows them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _dispatch
from . import _validation as check
from ._advantage_settings import BATCH_NORMS, NAN_POLICIES, SCALE_REWARDS, from_keywords
from ._gdpo import CANCEL_FLOOR, FLAT_REL, MEAN_FLOOR, check_rewards, gdpo_stats
from ._types import (
    ADVANTAGE_DEFAULTS,
    AdvantageSettings,
    GDPOAdvantages,
    TokenAdvantages,
    acc_dtype,
)

# the vocabularies and GDPO's constants live with the settings and the statistics; their
# names stay importable from here
__all__ = [
    "BATCH_NORMS",
    "CANCEL_FLOOR",
    "FLAT_REL",
    "MEAN_FLOOR",
    "NAN_POLICIES",
    "SCALE_REWARDS",
    "gdpo_advantages",
    "mrtpo_token_advantages",
    "mrtpo_token_advantages_op",
    "specific_relevance",
]


def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    eps: float = ADVANTAGE_DEFAULTS.eps,
    eps_batch: float | None = ADVANTAGE_DEFAULTS.eps_batch,
    batch_norm: str = ADVANTAGE_DEFAULTS.batch_norm,
    lengths: torch.Tensor | None = None,
    nan: str = ADVANTAGE_DEFAULTS.nan,
    scale_rewards: str = ADVANTAGE_DEFAULTS.scale_rewards,
    settings: AdvantageSettings | None = None,
) -> GDPOAdvantages:
    """GDPO advantages.

    Args:
        rewards: (n, K) float rewards, one column per verifier ((n,) is K = 1).
        group_ids: (n,) integer id of each response's prompt group.
        weights: optional (K,) reward weights lambda_k (default 1).
        eps: eps_group, added to each group's std; eps_batch: for the batch std
            (default eps).
        batch_norm: "sequence" (one entry per response) or "token" (each response counted
            ``lengths[i]`` times; then ``lengths`` (n,) is required).
        nan: "error" (non-finite rewards raise) or "zero" (count them as 0).
        scale_rewards: what each reward's r_k - mean_g is divided by (METHOD.md section
            1): "group" (its group's std + eps: GDPO), "batch" (reward k's unbiased std over
            every response of the batch + eps) or "none" (nothing: A_k in the rewards'
            units). The sum S and its batch normalization are the same for all three.
        settings: the keywords above as one ``AdvantageSettings`` instead (its fields
            alpha, gamma, delta, clip are checked and not used here); give the settings
            either way, not both (a keyword set away from its default beside ``settings``
            is a ValueError naming it).

    Zero variance gives advantage 0 whatever eps: a group's reward all equal (tested
    exactly), or the batch's S all equal (spread <= FLAT_REL times the largest
    sum_k |lambda_k A_k|). The statistics run in float64 whatever the rewards' dtype.

    Returns:
        GDPOAdvantages(per_reward (n, K), sequence (n,), mean (), std ()) in float32 (float64
        for float64 rewards).
    """
    block = dict(eps=eps, eps_batch=eps_batch, batch_norm=batch_norm, nan=nan)
    s = from_keywords(settings, block | dict(scale_rewards=scale_rewards))
    rewards = check_rewards(rewards, group_ids, weights, s.nan)
    if s.batch_norm == "token":
        if lengths is None:
            raise ValueError("lengths: batch_norm='token' needs each response's token count")
        check.counts("lengths", lengths, rewards.shape[0])
        check.same_device(rewards=rewards, lengths=lengths)
    return GDPOAdvantages(*gdpo_stats(rewards, group_ids, weights, lengths, s)[:4])


def mrtpo_token_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    relevance: torch.Tensor,
    *,
    has_info: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    alpha: float = ADVANTAGE_DEFAULTS.alpha,
    gamma: float = ADVANTAGE_DEFAULTS.gamma,
    eps: float = ADVANTAGE_DEFAULTS.eps,
    eps_batch: float | None = ADVANTAGE_DEFAULTS.eps_batch,
    batch_norm: str = ADVANTAGE_DEFAULTS.batch_norm,
    delta: float = ADVANTAGE_DEFAULTS.delta,
    clip: tuple[float, float] | None = ADVANTAGE_DEFAULTS.clip,
    nan: str = ADVANTAGE_DEFAULTS.nan,
    scale_rewards: str = ADVANTAGE_DEFAULTS.scale_rewards,
    settings: AdvantageSettings | None = None,
    backend: str | None = None,
) -> TokenAdvantages:
    """MRTPO token advantages: GDPO per-reward advantages, each reallocated to the tokens
    its verifier is relevant to.

    Args:
        rewards: (n, K); group_ids: (n,); weights: optional (K,) lambda.
        relevance: per-token relevance d_k (the JS distances), either padded (K, n, T) with
            ``response_mask`` (n, T) (1 on response tokens), or packed (K, N) with
            ``cu_seqlens`` (n+1,) int (response i owns tokens cu[i]:cu[i+1]).
        has_info: (n, K) bool, whether reward k's verifier checks spans of response i's
            prompt; where False, reward k is broadcast uniformly (plain GDPO).
        alpha: share of each reward's advantage that is reallocated, in [0, 1].
        gamma: sharpening exponent on d, > 0.
        delta: below this mean d^gamma, a response keeps uniform weights for that reward;
            so does a mean below MEAN_FLOOR (2^-126; an all-zero relevance included)
            whatever delta, 0 included.
        clip: optional (w_min, w_max) for the normalized weights, then renormalized.
        eps, eps_batch, batch_norm, nan, scale_rewards: as in ``gdpo_advantages`` (the
            reallocation starts from its A_k, whichever the scaling).
        settings: every keyword above from alpha to scale_rewards as one
            ``AdvantageSettings`` instead (what the framework adapters pass); give the
            settings either way, not both (a keyword set away from its default beside
            ``settings`` is a ValueError naming it).

    Returns:
        TokenAdvantages(token, allocation, per_reward, sequence, mean, std): token has the
        layout of the input, (n, T) with 0 at padding or (N,); allocation is (K, ...).
        The kernel's token advantages are final: GDPO's sequence advantage plus the
        zero-sum redistribution over the divisor D (METHOD.md section 5), exactly GDPO's
        value on a token whose every moving reward has weight 1.
    """
    block = dict(alpha=alpha, gamma=gamma, eps=eps, eps_batch=eps_batch, batch_norm=batch_norm)
    block |= dict(delta=delta, clip=clip, nan=nan, scale_rewards=scale_rewards)
    s = from_keywords(settings, block)
    rewards = check_rewards(rewards, group_ids, weights, s.nan)
    n, k = rewards.shape
    check.float_tensor("relevance", relevance, ndim=(2, 3))
    if relevance.shape[0] != k:
        raise ValueError(
            f"relevance: expected K = {k} rewards in dimension 0 (from rewards), "
            f"got {relevance.shape[0]}"
        )
    check.check_tensor("has_info", has_info, ndim=2)
    check.shape_eq("has_info", has_info, (n, k), "(n, K) like rewards")
    check.same_device(rewards=rewards, relevance=relevance, has_info=has_info)
    has_info = check.zero_one("has_info", has_info)

    if relevance.dim() == 3:
        if response_mask is None:
            raise ValueError("response_mask: padded relevance (K, n, T) needs response_mask (n, T)")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: give either response_mask (padded) or cu_seqlens")
        check.shape_eq("relevance", relevance, (k, n, relevance.shape[2]), "(K, n, T)")
        check.check_tensor("response_mask", response_mask)
        check.shape_eq("response_mask", response_mask, relevance.shape[1:], "(n, T)")
        check.same_device(relevance=relevance, response_mask=response_mask)
        mask = check.zero_one("response_mask", response_mask)
        lengths = mask.sum(1)
        rel_packed = relevance[:, mask]
        cu = torch.zeros(n + 1, dtype=torch.long, device=relevance.device)
        cu[1:] = torch.cumsum(lengths, 0)
    else:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: packed relevance (K, N) needs cu_seqlens (n+1,)")
        if response_mask is not None:
            raise ValueError("response_mask: give either response_mask (padded) or cu_seqlens")
        check.int_tensor("cu_seqlens", cu_seqlens, ndim=1)
        check.same_device(relevance=relevance, cu_seqlens=cu_seqlens)
        cu = check.boundaries("cu_seqlens", cu_seqlens, relevance.shape[1], n)
        lengths = cu[1:] - cu[:-1]
        rel_packed = relevance
    # only response tokens are read (padding may hold anything); d is a distance, >= 0
    check.all_finite("relevance", rel_packed)
    if check.value_checks_enabled() and bool((rel_packed < 0).any()):
        raise ValueError(
            f"relevance: expected values >= 0 (distances), found {rel_packed.min().item()}"
        )
    if check.value_checks_enabled():
        empty = (lengths == 0).nonzero()
        if empty.numel():
            raise ValueError(
                f"response_mask/cu_seqlens: response {int(empty[0])} has no valid token"
            )
    g = gdpo_stats(rewards, group_ids, weights, lengths, s)
    acc = acc_dtype(rel_packed)
    be = _dispatch.resolve("mrtpo_token_advantages", rel_packed.device, acc, backend)
    clip_min, clip_max = (0.0, math.inf) if s.clip is None else s.clip
    token, alloc = mrtpo_token_advantages_op(
        per_reward=g.a.to(acc).contiguous(),
        lam=g.lam.to(acc).contiguous(),
        has_info=has_info.bool().contiguous(),
        relevance=rel_packed.to(acc).contiguous(),
        cu_seqlens=cu,
        sequence=g.sequence.to(acc).contiguous(),
        divisor=g.divisor.to(acc),
        alpha=s.alpha,
        gamma=s.gamma,
        delta=max(s.delta, MEAN_FLOOR),
        clip_min=clip_min,
        clip_max=clip_max,
        backend=be,
    )
    if relevance.dim() == 3:  # back to the caller's padded layout
        token_p = torch.zeros(mask.shape, dtype=token.dtype, device=token.device)
        token_p[mask] = token
        alloc_p = torch.ones(relevance.shape, dtype=alloc.dtype, device=alloc.device)
        alloc_p[:, mask] = alloc
        token, alloc = token_p, alloc_p
    return TokenAdvantages(token, alloc, *g[:4])


def specific_relevance(
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    control: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sharper relevance (METHOD.md section 3b): what reward k's span removal moves beyond
    what any removal moves. Feed the result to ``mrtpo_token_advantages`` as ``relevance``.

    Args:
        relevance: the JS distances d_k, padded (K, n, T) or packed (K, N) with
            ``cu_seqlens`` (n+1,) (response i owns tokens cu[i]:cu[i+1]).
        has_info: (n, K) bool, whether reward k has verifier spans for response i.
        control: None for "specific": r_k = max(0, d_k - mean_{j != k with spans} d_j)
            (no extra forward; r_k = d_k when no other reward has spans). Or d_ctrl, the JS
            distance under removal of a prompt span no verifier checks, (n, T) padded or
            (N,) packed, for "control": r_k = max(0, d_k - d_ctrl).

    Returns:
        r, the same shape and dtype as ``relevance``; a reward without spans keeps d_k.
        NaN in the input stays NaN.
    """
    check.float_tensor("relevance", relevance, ndim=(2, 3))
    if relevance.shape[0] == 0:
        raise ValueError("relevance: expected at least one reward (K >= 1) in dimension 0, got 0")
    if check.value_checks_enabled() and bool(relevance.isinf().any()):
        raise ValueError("relevance: infinite value (a distance is at most 1); NaN stays NaN")
    k = relevance.shape[0]
    check.check_tensor("has_info", has_info, ndim=2)
    n = has_info.shape[0]
    check.shape_eq("has_info", has_info, (n, k), f"(n, K) with K = {k} from relevance")
    check.same_device(relevance=relevance, has_info=has_info, control=control)
    info = check.zero_one("has_info", has_info)
    if relevance.dim() == 3:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: padded relevance (K, n, T) takes no cu_seqlens")
        check.shape_eq("relevance", relevance, (k, n, relevance.shape[2]), "(K, n, T)")
        tok_info = info.t()[:, :, None].expand(relevance.shape)
    else:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: packed relevance (K, N) needs cu_seqlens (n+1,)")
        check.int_tensor("cu_seqlens", cu_seqlens, ndim=1)
        check.same_device(relevance=relevance, cu_seqlens=cu_seqlens)
        cu = check.boundaries("cu_seqlens", cu_seqlens, relevance.shape[1], n)
        lengths = cu[1:] - cu[:-1]
        tok_info = info.t().repeat_interleave(lengths, dim=1)
    if control is not None:
        check.float_tensor("control", control, ndim=relevance.dim() - 1)
        check.shape_eq("control", control, relevance.shape[1:], "one d_ctrl per token")
        base = control.to(relevance.dtype).unsqueeze(0).expand(relevance.shape)
        sharp = torch.clamp(relevance - base, min=0.0)
        return torch.where(tok_info, sharp, relevance)
    # mean over the OTHER rewards with spans, summed directly (no d_k subtracted back out)
    flat = relevance.reshape(k, -1)
    fi = tok_info.reshape(k, -1)
    masked = torch.where(fi, flat, torch.zeros_like(flat))
    others = 1.0 - torch.eye(k, dtype=relevance.dtype, device=relevance.device)
    other_sum = others @ masked
    other_cnt = others @ fi.to(relevance.dtype)
    base = other_sum / other_cnt.clamp(min=1.0)
    sharp = torch.clamp(flat - base, min=0.0)
    out = torch.where(fi & (other_cnt > 0), sharp, flat)
    return out.reshape(relevance.shape)


# --------------------------------------------------------------------------- registration


@torch.library.custom_op("mrtpo::mrtpo_token_advantages", mutates_args=())
def mrtpo_token_advantages_op(
    per_reward: Tensor,
    lam: Tensor,
    has_info: Tensor,
    relevance: Tensor,
    cu_seqlens: Tensor,
    sequence: Tensor,
    divisor: Tensor,
    alpha: float,
    gamma: float,
    delta: float,
    clip_min: float,
    clip_max: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    fn = _dispatch.get(backend, "mrtpo_token_advantages")
    return fn(
        per_reward=per_reward,
        lam=lam,
        has_info=has_info,
        relevance=relevance,
        cu_seqlens=cu_seqlens,
        sequence=sequence,
        divisor=divisor,
        alpha=alpha,
        gamma=gamma,
        delta=delta,
        clip_min=clip_min,
        clip_max=clip_max,
    )


@mrtpo_token_advantages_op.register_fake
def _(
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
    backend,
):
    f32 = acc_dtype(relevance)
    return (
        relevance.new_empty(relevance.shape[1], dtype=f32),
        relevance.new_empty(relevance.shape, dtype=f32),
    )
