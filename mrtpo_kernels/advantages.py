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

The public functions come first; the token advantages' torch.library registration (custom
op over the backends' reallocation kernels, and its fake) follows them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _dispatch
from . import _validation as check
from ._types import ADVANTAGE_DEFAULTS, GDPOAdvantages, TokenAdvantages, acc_dtype

BATCH_NORMS = ("sequence", "token")
NAN_POLICIES = ("error", "zero")
SCALE_REWARDS = ("group", "batch", "none")


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
        check.all_finite("weights", weights)
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


def _pow2_scale(m: torch.Tensor) -> torch.Tensor:
    """A power of two c with c <= m < 4c for m > 0 (1 elsewhere): dividing by it is exact, and
    brings values of magnitude <= m into [-4, 4), so that no sum of them can overflow."""
    _, e = torch.frexp(m)
    pos = (m > 0) & torch.isfinite(m)
    return torch.where(pos, torch.ldexp(torch.ones_like(m), e - 1), torch.ones_like(m))


# The batch's S count as all equal (no spread: sequence advantage 0) when their spread is at
# most FLAT_REL times the largest sum_k |lambda_k A_k| of a response, the magnitude of the
# terms S is summed from. Exact equality would hang on rounding: S equal in exact arithmetic
# may differ in their last bits (sums in another order), and S that differ only by rounding
# are no signal. The reference applies the same rule.
FLAT_REL = 2.0**-40

# A response's mean relevance d^gamma below MEAN_FLOOR (2^-126, float32's smallest normal)
# counts as zero, whatever delta (delta = 0 included): uniform weights. Below it the mean is
# subnormal in float32 and d / mean is no longer a ratio of exactly rounded numbers (the
# weights' mean is then not 1: mass is lost); the same floor for every dtype keeps float32
# and float64 inputs, and the reference, to one decision.
MEAN_FLOOR = 2.0**-126

# The token advantages' redistribution (sum_k lambda_k A_k w_k - S, zero mean per response)
# is divided by D = max(std, CANCEL_FLOOR * u) + eps_batch, u the std S would have if the K
# per-reward advantages were uncorrelated (METHOD.md section 5). Without the floor a batch
# whose rewards cancel in S (one response passes reward a and fails b, its group-mates the
# reverse: every S equal, std 0) divides a unit-scale redistribution by eps_batch alone
# (1e6x token advantages), while eps_batch = 0 dropped it. std^2 = u^2 + 2 * covariances, so
# at 1/2 the floor acts only when the rewards' anti-correlation removes over 3/4 of S's
# variance; with K = 1 (std = u) or rewards that do not cancel, D = std + eps_batch as in
# the paper.
CANCEL_FLOOR = 0.5


def _stat_dtype(rewards: torch.Tensor) -> torch.dtype:
    """GDPO statistics run in float64 (O(n K) work) wherever the device has it, so that the
    op's decisions and values do not depend on the rewards' dtype; float32 elsewhere."""
    return torch.float32 if rewards.device.type == "mps" else torch.float64


class _Units(NamedTuple):
    """GDPO's parts in the unit the token advantages are computed in: per_reward = a * unit,
    S = s * unit, mean = mu * unit, std = sd * unit, and the redistribution's divisor is
    D = (scale + eps) * unit, eps = eps_batch / unit. The unit is 1 (and eps the Python
    float eps_batch) except for scale_rewards="none", whose A_k keep the rewards' own
    units: there it is a power of two near the batch's largest |r| (a tensor, as is eps,
    so that no value is read back to the host), and no sum of the A_k overflows whatever
    the rewards' magnitude."""

    a: torch.Tensor
    s: torch.Tensor
    mu: torch.Tensor
    sd: torch.Tensor
    scale: torch.Tensor
    eps: float | torch.Tensor


def _gdpo(
    rewards,
    group_ids,
    weights,
    eps,
    eps_batch,
    batch_norm,
    lengths,
    scale_rewards=ADVANTAGE_DEFAULTS.scale_rewards,
):
    """Returns ((per_reward, sequence, mean, std) in the rewards' accumulation dtype, lam,
    units): ``_Units`` (see there) in that dtype; the redistribution's divisor D of
    METHOD.md section 5 is (scale + eps) in units of the unit, scale = max(sd,
    CANCEL_FLOOR * u) (sd itself where the floor is inactive)."""
    out = acc_dtype(rewards)
    r = rewards.to(_stat_dtype(rewards))
    n, k = r.shape
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = n  # upper bound on the number of groups: no data-dependent shape below
    cnt = torch.zeros(g, dtype=r.dtype, device=r.device).index_add_(
        0, inv, torch.ones(n, dtype=r.dtype, device=r.device)
    )
    idx = inv[:, None].expand(n, k)
    hi = torch.full((g, k), -math.inf, dtype=r.dtype, device=r.device)
    hi = hi.scatter_reduce(0, idx, r, reduce="amax")
    lo = torch.full((g, k), math.inf, dtype=r.dtype, device=r.device)
    lo = lo.scatter_reduce(0, idx, r, reduce="amin")
    moves = (cnt[:, None] >= 2) & (hi > lo)  # zero variance tested exactly
    # (x - mean) / (std + eps) on x = r / c, c a power of two near max |r| of the group:
    # exact scaling, and no sum or square overflows for rewards up to the float maximum
    c = _pow2_scale(torch.where(moves, torch.maximum(hi.abs(), lo.abs()), 0.0))
    x = r / c[inv]
    total = torch.zeros((g, k), dtype=r.dtype, device=r.device).index_add_(0, inv, x)
    mean = total / cnt.clamp(min=1.0)[:, None]
    dev = x - mean[inv]
    unit = None
    if scale_rewards == "group":
        ss = torch.zeros((g, k), dtype=r.dtype, device=r.device).index_add_(0, inv, dev * dev)
        std = torch.sqrt(ss / (cnt - 1.0).clamp(min=1.0)[:, None])
        denom = (std + eps / c)[inv]
    elif scale_rewards == "batch":
        # reward k's unbiased std over the whole batch (every response once; the rewards
        # themselves, not group-centred), on r / cb, cb a power of two near max_i |r_k|:
        # (x - mean) c / (sb cb + eps) = (x - mean) / ((sb + eps / cb) cb / c), c <= cb
        cb = _pow2_scale(r.abs().amax(0))
        xb = r / cb
        sb = torch.sqrt(((xb - xb.mean(0)) ** 2).sum(0) / max(n - 1, 1))
        denom = ((sb + eps / cb) * cb / c)[inv]
    else:  # "none": A_k = r_k - mean_g, in units of the largest c (a power of two)
        unit = _pow2_scale(torch.where(moves, c, 0.0).amax())
        denom = (unit / c)[inv]
    a = torch.where(moves[inv] & (denom > 0), dev / denom, torch.zeros_like(r))
    if unit is not None:  # an A_k that is 0 in the rewards' units (underflow) moves nothing
        a = torch.where((a * unit).to(out) == 0, torch.zeros_like(a), a)
    lam = torch.ones(k, dtype=r.dtype, device=r.device) if weights is None else weights.to(r.dtype)
    s = a @ lam
    mag = (a.abs() @ lam.abs()).amax()  # the largest |terms| summed into one S
    w = torch.ones_like(s) if batch_norm == "sequence" else lengths.to(r.dtype)
    # eps_batch / unit, at most the float maximum (a subnormal unit would make it inf)
    eps_u = eps_batch if unit is None else (eps_batch / unit).clamp(max=_FLOAT64_MAX)
    seq, mu, sd = _batch_stats(s, w, eps_u, mag)
    scale = torch.maximum(sd, CANCEL_FLOOR * _uncorrelated_std(a * lam, w))
    parts = (a, seq, mu, sd) if unit is None else (a * unit, seq, mu * unit, sd * unit)
    units = _Units(
        *(t.to(out) for t in (a, s, mu, sd, scale)), eps_u if unit is None else eps_u.to(out)
    )
    return tuple(t.to(out) for t in parts), lam.to(out), units


_FLOAT64_MAX = torch.finfo(torch.float64).max


def _weighted_stats(x, w):
    """Weighted mean and unbiased variance of x over dimension 0 (w: (n,) weights, as many
    entries as a response counts): the batch statistics of S and of each lambda_k A_k."""
    wx = w.reshape(-1, *([1] * (x.dim() - 1)))
    tot = w.sum()
    mu = (wx * x).sum(0) / tot
    var = (wx * (x - mu) ** 2).sum(0) / (tot - 1.0).clamp(min=1.0)
    return mu, var


def _uncorrelated_std(x, w):
    """sqrt(sum_k var_w(x[:, k])): the batch std that S = sum_k x[:, k] would have if its K
    terms were uncorrelated (the statistics of ``_batch_stats``)."""
    c = _pow2_scale(x.abs().amax()) if x.numel() else torch.ones((), dtype=x.dtype)
    _, var = _weighted_stats(x / c, w)
    return torch.where(w.sum() > 1, var.sum().sqrt(), torch.zeros((), dtype=x.dtype)) * c


def _batch_stats(s, w, eps_batch, mag):
    """Weighted batch normalization of S: (sequence, mean, std). Every S equal (spread at
    most FLAT_REL * mag, see there): std 0, mean S[0], sequence 0; std + eps_batch = 0
    gives 0."""
    cs = _pow2_scale(s.abs().amax())
    x = s / cs
    tot = w.sum()
    mu, var = _weighted_stats(x, w)
    flat = (x.amax() - x.amin()) <= FLAT_REL * (mag / cs)
    mu = torch.where(flat, x[0], mu)
    sd = torch.where(flat | (tot <= 1), torch.zeros_like(var), var.sqrt())
    denom = sd + eps_batch / cs
    # flat: every S counts as equal, so each sequence advantage is 0, not its last bits over
    # eps_batch (S equal in exact arithmetic but apart by rounding gave ~1e-10 at eps 1e-6)
    seq = torch.where((denom > 0) & ~flat, (x - mu) / denom, torch.zeros_like(x))
    return seq, mu * cs, sd * cs


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

    Zero variance gives advantage 0 whatever eps: a group's reward all equal (tested
    exactly), or the batch's S all equal (spread <= FLAT_REL times the largest
    sum_k |lambda_k A_k|). The statistics run in float64 whatever the rewards' dtype.

    Returns:
        GDPOAdvantages(per_reward (n, K), sequence (n,), mean (), std ()) in float32 (float64
        for float64 rewards).
    """
    rewards = _check_rewards(rewards, group_ids, weights, nan)
    check.choice("batch_norm", batch_norm, BATCH_NORMS)
    check.choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    eps = check.non_negative("eps", eps)
    eps_batch = eps if eps_batch is None else check.non_negative("eps_batch", eps_batch)
    if batch_norm == "token":
        if lengths is None:
            raise ValueError("lengths: batch_norm='token' needs each response's token count")
        check.counts("lengths", lengths, rewards.shape[0])
        check.same_device(rewards=rewards, lengths=lengths)
    return GDPOAdvantages(
        *_gdpo(rewards, group_ids, weights, eps, eps_batch, batch_norm, lengths, scale_rewards)[0]
    )


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

    Returns:
        TokenAdvantages(token, allocation, per_reward, sequence, mean, std): token has the
        layout of the input, (n, T) with 0 at padding or (N,); allocation is (K, ...).
    """
    rewards = _check_rewards(rewards, group_ids, weights, nan)
    n, k = rewards.shape
    check.float_tensor("relevance", relevance, ndim=(2, 3))
    check.choice("batch_norm", batch_norm, BATCH_NORMS)
    check.choice("scale_rewards", scale_rewards, SCALE_REWARDS)
    eps = check.non_negative("eps", eps)
    eps_batch = eps if eps_batch is None else check.non_negative("eps_batch", eps_batch)
    alpha = check.unit_interval("alpha", alpha)
    gamma = check.positive_finite("gamma", gamma)
    delta = check.non_negative("delta", delta)
    clip_min, clip_max = 0.0, math.inf
    if clip is not None:
        clip_min, clip_max = check.pair("clip", clip)
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
    parts, lam, u = _gdpo(
        rewards, group_ids, weights, eps, eps_batch, batch_norm, lengths, scale_rewards
    )
    g = GDPOAdvantages(*parts)
    acc = acc_dtype(rel_packed)
    be = _dispatch.resolve("mrtpo_token_advantages", rel_packed.device, acc, backend)
    # the kernels divide by std + eps_batch, D; in units of u's unit (1 but for "none",
    # where D = scale + eps is handed over whole, with eps_batch 0)
    floating_unit = isinstance(u.eps, torch.Tensor)
    token, alloc = mrtpo_token_advantages_op(
        per_reward=u.a.to(acc).contiguous(),
        lam=lam.to(acc).contiguous(),
        has_info=has_info.bool().contiguous(),
        relevance=rel_packed.to(acc).contiguous(),
        cu_seqlens=cu,
        mean=u.mu.to(acc),
        std=(u.scale + u.eps).to(acc) if floating_unit else u.scale.to(acc),
        alpha=alpha,
        gamma=gamma,
        eps_batch=0.0 if floating_unit else eps_batch,
        delta=max(delta, MEAN_FLOOR),
        clip_min=clip_min,
        clip_max=clip_max,
        backend=be,
    )
    # A token whose allocation is exactly 1 for every reward that moves (alpha = 0, no spans,
    # relevance below delta; a reward with lam_k A_k = 0 moves nothing whatever its weight)
    # takes GDPO's sequence value itself: the kernels' sum_k lam_k A_k w_k and GDPO's
    # S = A lam agree in exact arithmetic but may round differently (a BLAS product with or
    # without FMA), and METHOD.md's invariants "alpha = 0 is GDPO" and "a reward with
    # A_k = 0 moves nothing" are exact (so a replay that skips such pairs, leaving their
    # relevance 0, gives the same token advantages bit for bit: mrtpo.replay.replay_mask).
    seg = torch.repeat_interleave(
        torch.arange(n, device=token.device), lengths, output_size=token.shape[0]
    )
    # Where the floor acts (D > std + eps_batch) the kernels' (N - mean) / D holds
    # (S - mean) / D of GDPO's part; it is swapped for GDPO's (S - mean) / (std + eps_batch),
    # so that the mass invariant stays exact: sum_t A = T_i * sequence.
    divisor = u.scale + u.eps
    floored = divisor > u.sd + u.eps
    fix = torch.where(floored, g.sequence - (u.s - u.mu) / divisor, torch.zeros_like(u.s))
    token = torch.where(floored, token + fix.to(token.dtype)[seg], token)
    still = (u.a == 0) | (lam == 0)[None, :]  # (n, K): moves nothing
    untouched = ((alloc == 1) | still.t().to(alloc.device)[:, seg]).all(0)  # K = 0: every token
    token = torch.where(untouched, g.sequence.to(token.dtype)[seg], token)
    # D = 0 (every lambda_k A_k equal across the batch, eps_batch = 0): nothing to move
    token = torch.where(divisor > 0, token, torch.zeros_like(token))
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
    fn = _dispatch.get(backend, "mrtpo_token_advantages")
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


@mrtpo_token_advantages_op.register_fake
def _(
    per_reward,
    lam,
    has_info,
    relevance,
    cu_seqlens,
    mean,
    std,
    alpha,
    gamma,
    eps_batch,
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
