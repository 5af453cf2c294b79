"""GDPO's statistics (METHOD.md sections 1 and 5), the part of the advantage ops computed in
PyTorch ops before the reallocation kernels: the per-reward advantages A_k, the sequence
advantages and the batch statistics of S, and the redistribution's divisor D. Every
function takes the call's checked ``AdvantageSettings`` as one value.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _validation as check
from ._types import AdvantageSettings, acc_dtype


def check_rewards(rewards, group_ids, weights, nan: str):
    """rewards as (n, K) (non-finite values 0 under nan="zero", a ValueError naming them
    under "error"), group_ids and weights checked against it."""
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


class GDPOStats(NamedTuple):
    """GDPO's parts (per_reward, sequence, mean, std: ``GDPOAdvantages``), lam (K,), and
    what the reallocation kernels take: ``a``, the A_k in the unit the token advantages are
    computed in (per_reward = a * unit), and ``divisor``, the redistribution's
    D = max(std, CANCEL_FLOOR * u) + eps_batch of METHOD.md section 5 in that unit. The
    unit is 1 except for scale_rewards="none", whose A_k keep the rewards' own units:
    there it is a power of two near the batch's largest |r| (a tensor, so that no value is
    read back to the host), and no sum of the A_k overflows whatever their magnitude. All
    in the rewards' accumulation dtype."""

    per_reward: torch.Tensor
    sequence: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    lam: torch.Tensor
    a: torch.Tensor
    divisor: torch.Tensor


def gdpo_stats(rewards, group_ids, weights, lengths, settings: AdvantageSettings) -> GDPOStats:
    """GDPO on checked inputs (``check_rewards``) and settings (``advantage_settings``):
    ``lengths`` (n,) weighs each response under batch_norm="token"."""
    eps, eps_batch = settings.eps, settings.batch_eps
    batch_norm, scale_rewards = settings.batch_norm, settings.scale_rewards
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
    return GDPOStats(*(t.to(out) for t in (*parts, lam, a, scale + eps_u)))


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
