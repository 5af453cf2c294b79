"""GDPO per-reward advantages and MRTPO token advantages (METHOD.md sections 1, 4, 5).

GDPO: each reward is normalized inside its group, A_k = (r_k - mean_g) / (std_g + eps)
(unbiased std; 0 for a group of one or a reward with zero variance in the group), summed
with weights lambda_k to S, then S is normalized over the batch.

MRTPO: reward k's advantage is spread over response i's tokens by allocation weights
w_k[t] = (1 - alpha) + alpha d_k[t]^gamma / mean_t d_k^gamma (uniform where reward k has no
verifier spans or the mean is below delta), so that sum_t A[i, t] = T_i x GDPO advantage.
"""

from __future__ import annotations

import math

import torch

from . import _dispatch, _ops
from . import _validation as check
from .types import GDPOAdvantages, TokenAdvantages, acc_dtype

BATCH_NORMS = ("sequence", "token")
NAN_POLICIES = ("error", "zero")


def _check_rewards(rewards, group_ids, weights, nan):
    check.float_tensor("rewards", rewards, ndim=(1, 2))
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(-1)
    n, k = rewards.shape
    check.non_empty("rewards", n, "responses")
    if k == 0:
        raise ValueError("rewards: expected at least one reward column (K >= 1), got K = 0")
    check.int_tensor("group_ids", group_ids, ndim=1)
    check.shape_eq("group_ids", group_ids, (n,), "one group id per response")
    check.same_device(rewards=rewards, group_ids=group_ids, weights=weights)
    check.choice("nan", nan, NAN_POLICIES)
    if weights is not None:
        check.float_tensor("weights", weights, ndim=1)
        check.shape_eq("weights", weights, (k,), "one weight per reward")
    finite = torch.isfinite(rewards)
    if nan == "zero":
        rewards = torch.where(finite, rewards, torch.zeros_like(rewards))
    elif check.value_checks_enabled() and not bool(finite.all()):
        i, j = (~finite).nonzero()[0].tolist()
        raise ValueError(
            f"rewards: non-finite value {rewards[i, j].item()} at response {i}, reward {j}; "
            "pass nan='zero' to count it as 0"
        )
    return rewards


def _gdpo(rewards, group_ids, weights, eps, eps_batch, batch_norm, lengths):
    r = rewards.to(acc_dtype(rewards))
    n, k = r.shape
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = n  # upper bound on the number of groups: no data-dependent shape below
    cnt = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones(n, dtype=r.dtype, device=r.device)
    )
    total = torch.zeros((g, k), dtype=r.dtype, device=r.device).index_add_(0, inv, r)
    mean = total / cnt.clamp(min=1.0)[:, None]
    dev = r - mean[inv]
    ss = torch.zeros((g, k), dtype=r.dtype, device=r.device).index_add_(0, inv, dev * dev)
    std = torch.sqrt(ss / (cnt - 1.0).clamp(min=1.0)[:, None])
    idx = inv[:, None].expand(n, k)
    hi = torch.full((g, k), -math.inf, dtype=r.dtype, device=r.device)
    hi = hi.scatter_reduce(0, idx, r, reduce="amax")
    lo = torch.full((g, k), math.inf, dtype=r.dtype, device=r.device)
    lo = lo.scatter_reduce(0, idx, r, reduce="amin")
    moves = (cnt[:, None] >= 2) & (hi > lo)  # zero variance tested exactly
    a = torch.where(moves[inv], dev / (std[inv] + eps), torch.zeros_like(r))
    lam = torch.ones(k, dtype=r.dtype, device=r.device) if weights is None else weights.to(r.dtype)
    s = a @ lam
    if batch_norm == "sequence":
        mu = s.mean()
        sigma = s.std() if n > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
    else:
        w = lengths.to(r.dtype)
        tot = w.sum()
        mu = (w * s).sum() / tot
        var = (w * (s - mu) ** 2).sum() / (tot - 1.0).clamp(min=1.0)
        sigma = torch.where(tot > 1, var.sqrt(), torch.zeros_like(var))
    return GDPOAdvantages(a, (s - mu) / (sigma + eps_batch), mu, sigma), lam


def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    eps: float = 1e-6,
    eps_batch: float | None = None,
    batch_norm: str = "sequence",
    lengths: torch.Tensor | None = None,
    nan: str = "error",
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

    Returns:
        GDPOAdvantages(per_reward (n, K), sequence (n,), mean (), std ()).
    """
    rewards = _check_rewards(rewards, group_ids, weights, nan)
    check.choice("batch_norm", batch_norm, BATCH_NORMS)
    eps = check.non_negative("eps", eps)
    eps_batch = eps if eps_batch is None else check.non_negative("eps_batch", eps_batch)
    if batch_norm == "token":
        if lengths is None:
            raise ValueError("lengths: batch_norm='token' needs each response's token count")
        check.check_tensor("lengths", lengths, ndim=1)
        check.shape_eq("lengths", lengths, (rewards.shape[0],), "one length per response")
    return _gdpo(rewards, group_ids, weights, eps, eps_batch, batch_norm, lengths)[0]


def mrtpo_token_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    relevance: torch.Tensor,
    *,
    has_info: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    alpha: float = 1.0,
    gamma: float = 1.0,
    eps: float = 1e-6,
    eps_batch: float | None = None,
    batch_norm: str = "sequence",
    delta: float = 1e-8,
    clip: tuple[float, float] | None = None,
    nan: str = "error",
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
        delta: below this mean d^gamma, a response keeps uniform weights for that reward.
        clip: optional (w_min, w_max) for the normalized weights, then renormalized.
        eps, eps_batch, batch_norm, nan: as in ``gdpo_advantages``.

    Returns:
        TokenAdvantages(token, allocation, per_reward, sequence, mean, std): token has the
        layout of the input, (n, T) with 0 at padding or (N,); allocation is (K, ...).
    """
    rewards = _check_rewards(rewards, group_ids, weights, nan)
    n, k = rewards.shape
    check.float_tensor("relevance", relevance, ndim=(2, 3))
    check.choice("batch_norm", batch_norm, BATCH_NORMS)
    eps = check.non_negative("eps", eps)
    eps_batch = eps if eps_batch is None else check.non_negative("eps_batch", eps_batch)
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a number in [0, 1], got {alpha}")
    gamma = check.positive_finite("gamma", gamma)
    delta = check.non_negative("delta", delta)
    clip_min, clip_max = 0.0, math.inf
    if clip is not None:
        clip_min, clip_max = float(clip[0]), float(clip[1])
        if not (0.0 <= clip_min <= 1.0 <= clip_max):
            raise ValueError(f"clip: expected (w_min, w_max) with w_min <= 1 <= w_max, got {clip}")
    if relevance.shape[0] != k:
        raise ValueError(
            f"relevance: expected K = {k} rewards in dimension 0 (from rewards), "
            f"got {relevance.shape[0]}"
        )
    check.check_tensor("has_info", has_info, ndim=2)
    check.shape_eq("has_info", has_info, (n, k), "(n, K) like rewards")
    check.same_device(rewards=rewards, relevance=relevance, has_info=has_info)

    if relevance.dim() == 3:
        if response_mask is None:
            raise ValueError("response_mask: padded relevance (K, n, T) needs response_mask (n, T)")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: give either response_mask (padded) or cu_seqlens")
        check.shape_eq("relevance", relevance, (k, n, relevance.shape[2]), "(K, n, T)")
        check.shape_eq("response_mask", response_mask, relevance.shape[1:], "(n, T)")
        check.same_device(relevance=relevance, response_mask=response_mask)
        mask = response_mask.bool()
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
        check.shape_eq("cu_seqlens", cu_seqlens, (n + 1,), "n + 1 boundaries")
        check.same_device(relevance=relevance, cu_seqlens=cu_seqlens)
        cu = cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        rel_packed = relevance
        if check.value_checks_enabled() and (
            int(cu[0]) != 0 or int(cu[-1]) != relevance.shape[1] or bool((lengths < 0).any())
        ):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing boundaries from 0 to N = "
                f"{relevance.shape[1]}, got {cu.tolist()[:8]}..."
            )
    if check.value_checks_enabled():
        empty = (lengths == 0).nonzero()
        if empty.numel():
            raise ValueError(
                f"response_mask/cu_seqlens: response {int(empty[0])} has no valid token"
            )
    g, lam = _gdpo(rewards, group_ids, weights, eps, eps_batch, batch_norm, lengths)
    acc = acc_dtype(rel_packed)
    be = _dispatch.resolve("mrtpo_token_advantages", rel_packed.device, acc, backend)
    token, alloc = _ops.reallocate_packed(
        per_reward=g.per_reward.to(acc).contiguous(),
        lam=lam.to(acc).contiguous(),
        has_info=has_info.bool().contiguous(),
        relevance=rel_packed.to(acc).contiguous(),
        cu_seqlens=cu,
        mean=g.mean.to(acc),
        std=g.std.to(acc),
        alpha=alpha,
        gamma=gamma,
        eps_batch=eps_batch,
        delta=delta,
        clip_min=clip_min,
        clip_max=clip_max,
        backend=be,
    )
    if relevance.dim() == 3:
        token_p = torch.zeros(mask.shape, dtype=token.dtype, device=token.device)
        token_p[mask] = token
        alloc_p = torch.ones(relevance.shape, dtype=alloc.dtype, device=alloc.device)
        alloc_p[:, mask] = alloc
        token, alloc = token_p, alloc_p
    return TokenAdvantages(token, alloc, g.per_reward, g.sequence, g.mean, g.std)


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
    k = relevance.shape[0]
    check.check_tensor("has_info", has_info, ndim=2)
    n = has_info.shape[0]
    check.shape_eq("has_info", has_info, (n, k), f"(n, K) with K = {k} from relevance")
    check.same_device(relevance=relevance, has_info=has_info, control=control)
    info = has_info.bool()
    if relevance.dim() == 3:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: padded relevance (K, n, T) takes no cu_seqlens")
        check.shape_eq("relevance", relevance, (k, n, relevance.shape[2]), "(K, n, T)")
        tok_info = info.t()[:, :, None].expand(relevance.shape)
    else:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: packed relevance (K, N) needs cu_seqlens (n+1,)")
        check.int_tensor("cu_seqlens", cu_seqlens, ndim=1)
        check.shape_eq("cu_seqlens", cu_seqlens, (n + 1,), "n + 1 boundaries")
        check.same_device(relevance=relevance, cu_seqlens=cu_seqlens)
        cu = cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        if check.value_checks_enabled() and (
            int(cu[0]) != 0 or int(cu[-1]) != relevance.shape[1] or bool((lengths < 0).any())
        ):
            raise ValueError(
                f"cu_seqlens: expected non-decreasing boundaries from 0 to N = "
                f"{relevance.shape[1]}, got {cu.tolist()[:8]}..."
            )
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
