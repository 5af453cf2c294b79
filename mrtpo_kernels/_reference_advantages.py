"""Plain PyTorch references of the advantage ops (METHOD.md sections 1, 3b, 4, 5), written as
loops over groups, rewards and responses for readability; run them in float64 for the
ground truth. Public through ``mrtpo_kernels.reference``.

Their settings are the ops' (``AdvantageSettings``: ``settings=`` one value, or its fields as
keywords), checked by the same ``advantage_settings``; ``nan`` is taken and not used (the
references read the rewards as given).
"""

from __future__ import annotations

import torch

from ._advantage_settings import advantage_settings
from ._types import AdvantageSettings, GDPOAdvantages


def _centred(x: torch.Tensor) -> torch.Tensor:
    """x - mean(x), computed on x / max|x| (the same value) so that no sum overflows for
    values up to the float maximum."""
    c = x.abs().max()
    xs = x / c
    return (xs - xs.mean()) * c


def _std(x: torch.Tensor) -> torch.Tensor:
    """The unbiased std of x, computed on x / max|x| (0 for all-zero x or a single value)."""
    c = x.abs().max()
    return (x / c).std() * c if c > 0 and x.numel() > 1 else torch.zeros((), dtype=x.dtype)


def _standardize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps), computed on x / max|x| (the same value) so that no sum or
    square overflows for values up to the float maximum."""
    c = x.abs().max()
    xs = x / c
    return (xs - xs.mean()) / (xs.std() + eps / c)


FLAT_REL = 2.0**-40  # the batch's S count as all equal within FLAT_REL * max sum |lambda A|
MEAN_FLOOR = 2.0**-126  # a mean d^gamma below it counts as zero (uniform), whatever delta


def _per_reward_ref(r, group_ids, eps, scale_rewards):
    """A_k (METHOD.md section 1): per group and reward, r - mean divided by the group's
    std + eps ("group"), reward k's std over the whole batch + eps ("batch"), or nothing
    ("none"); 0 for a group of one or a reward with zero variance in the group."""
    n, k = r.shape
    a = torch.zeros_like(r)
    batch_std = [_std(r[:, j]) for j in range(k)]
    for g in torch.unique(group_ids).tolist():
        idx = (group_ids == g).nonzero().squeeze(-1)
        if idx.numel() < 2:
            continue
        for j in range(k):
            x = r[idx, j]
            if x.max() == x.min():  # zero variance, tested exactly (no rounding residue)
                continue
            if scale_rewards == "group":
                a[idx, j] = _standardize(x, eps)
            elif scale_rewards == "batch":
                a[idx, j] = _centred(x) / (batch_std[j] + eps)
            else:  # "none" (the settings are checked: advantage_settings)
                a[idx, j] = _centred(x)
    return a


def _gdpo_ref(rewards, group_ids, weights, lengths, s: AdvantageSettings):
    """(A (n, K), lam, S / m, sequence, mu / m, sigma / m, m): the batch statistics of S in
    units of m = max |lambda_k A_k| (1 where every A_k is 0), so that no sum of the A_k
    overflows ("none" keeps the rewards' units)."""
    eps, eps_batch, batch_norm, scale_rewards = s.eps, s.batch_eps, s.batch_norm, s.scale_rewards
    n, k = rewards.shape
    a = _per_reward_ref(rewards, group_ids, eps, scale_rewards)
    lam = torch.ones(k, dtype=rewards.dtype) if weights is None else weights.to(rewards.dtype)
    m = (a * lam).abs().max()
    m = m if m > 0 else torch.ones((), dtype=rewards.dtype)
    s = (a / m * lam).sum(-1)
    # batch_norm "sequence" or "token" (the settings are checked: advantage_settings)
    w = torch.ones_like(s) if batch_norm == "sequence" else lengths.to(rewards.dtype)
    mag = (a.abs() / m * lam.abs()).sum(-1).max()  # the largest |terms| summed into one S
    zero = torch.zeros((), dtype=rewards.dtype)
    if s.max() - s.min() <= FLAT_REL * mag:  # every S equal (or n = 1): no spread
        return a, lam, s, torch.zeros_like(s), s[0], zero, m
    c = s.abs().max()  # scaled as in _standardize
    xs = s / c
    tot = w.sum()
    mu = (w * xs).sum() / tot
    sd = ((w * (xs - mu) ** 2).sum() / (tot - 1)).sqrt()
    return a, lam, s, (xs - mu) / (sd + eps_batch / (c * m)), mu * c, sd * c, m


def gdpo_advantages_ref(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    **keywords,
) -> GDPOAdvantages:
    """GDPO (METHOD.md section 1), written as loops over groups for readability.

    rewards (n, K); group_ids (n,); weights (K,) = lambda; lengths (n,) = T_i, needed for
    batch_norm="token" (each response counted T_i times). A group's reward with zero
    variance (tested exactly on the rewards) gets advantage 0, whatever eps; so does every
    response when the batch's S are all equal: their spread is at most FLAT_REL (2^-40) times
    the largest sum_k |lambda_k A_k| (S equal up to rounding count as equal, as in the op).
    scale_rewards: "group" (GDPO: r_k - mean over the group's std + eps), "batch" (over
    reward k's unbiased std across the whole batch + eps) or "none" (r_k - mean itself).
    ``settings`` / ``keywords``: eps, eps_batch, batch_norm, scale_rewards (the other fields
    of ``AdvantageSettings`` are checked and not used).
    """
    s = advantage_settings(settings, keywords, where="gdpo_advantages_ref")
    a, _, _, seq, mu, sd, m = _gdpo_ref(rewards, group_ids, weights, lengths, s)
    return GDPOAdvantages(a, seq, mu * m, sd * m)


def mrtpo_token_advantages_ref(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    relevance: list[torch.Tensor],
    *,
    has_info: torch.Tensor,
    weights: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    **keywords,
):
    """MRTPO token advantages (METHOD.md sections 4-5), one response at a time.

    relevance: a list of n tensors, response i's of shape (K, T_i) (d_k over its tokens;
    a negative value, possible only with the value checks off, counts as 0).
    has_info: (n, K) bool, whether reward k's verifier has spans for response i.
    ``settings`` / ``keywords``: as ``mrtpo_token_advantages`` (nan is not used).
    Returns (token advantages as a list of (T_i,) tensors, GDPOAdvantages).
    """
    s = advantage_settings(settings, keywords, where="mrtpo_token_advantages_ref")
    alpha, gamma, delta, clip, batch_norm = s.alpha, s.gamma, s.delta, s.clip, s.batch_norm
    lengths = torch.tensor([rel.shape[-1] for rel in relevance])
    a, lam, _, seq, mu, sd, m = _gdpo_ref(rewards, group_ids, weights, lengths, s)
    g = GDPOAdvantages(a, seq, mu * m, sd * m)
    eps_batch = s.batch_eps
    k = rewards.shape[1]
    # everything below in units of m = max |lambda_k A_k|: x_k = lambda_k A_k / m
    # the redistribution's divisor D = max(std, 1/2 * u) + eps_batch, u the std S would have
    # if its K terms were uncorrelated (same weighting as the batch std)
    v = torch.ones(len(relevance), dtype=rewards.dtype)
    if batch_norm == "token":
        v = lengths.to(rewards.dtype)
    u2 = torch.zeros((), dtype=rewards.dtype)
    if v.sum() > 1:
        for j in range(k):
            x = lam[j] * a[:, j] / m
            mean = (v * x).sum() / v.sum()
            u2 = u2 + (v * (x - mean) ** 2).sum() / (v.sum() - 1)
    divisor = torch.maximum(sd, 0.5 * u2.sqrt()) + eps_batch / m
    out = []
    for i, rel in enumerate(relevance):
        t = rel.shape[-1]
        total = torch.zeros(t, dtype=rewards.dtype)
        for j in range(k):
            w = torch.ones(t, dtype=rewards.dtype)
            if bool(has_info[i, j]):
                dg = rel[j].to(rewards.dtype).clamp(min=0.0) ** gamma
                mean = dg.mean()
                if mean >= delta and mean >= MEAN_FLOOR:  # all-zero d: uniform at delta 0
                    w_hat = dg / mean
                    if clip is not None:
                        w_hat = w_hat.clamp(clip[0], clip[1])
                        w_hat = w_hat / w_hat.mean()
                    w = (1 - alpha) + alpha * w_hat
            total = total + lam[j] * a[i, j] / m * w
        s_i = (lam * a[i] / m).sum()
        # GDPO's value (0 where every S is equal) plus the zero-mean redistribution / D
        moved = (total - s_i) / divisor if divisor > 0 else torch.zeros_like(total)
        out.append(g.sequence[i] + moved)
    return out, g


def specific_relevance_ref(
    relevance: list[torch.Tensor],
    has_info: torch.Tensor,
    *,
    control: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Sharper relevance (METHOD.md section 3b), one response and one reward at a time.

    relevance: a list of n tensors, response i's of shape (K, T_i) (d_k over its tokens);
    has_info: (n, K) bool. Without ``control`` ("specific"): for reward k with spans,
    r_k = max(0, d_k - mean of d_j over the other rewards j with spans), r_k = d_k when no
    other reward has spans. With ``control`` (a list of n (T_i,) tensors, d_ctrl):
    r_k = max(0, d_k - d_ctrl). A reward without spans keeps d_k (its weights are uniform).
    """
    out = []
    for i, rel in enumerate(relevance):
        r = rel.clone()
        k = rel.shape[0]
        for j in range(k):
            if not bool(has_info[i, j]):
                continue
            if control is not None:
                r[j] = torch.clamp(rel[j] - control[i].to(rel.dtype), min=0.0)
                continue
            others = [m for m in range(k) if m != j and bool(has_info[i, m])]
            if others:
                base = torch.stack([rel[m] for m in others]).mean(0)
                r[j] = torch.clamp(rel[j] - base, min=0.0)
        out.append(r)
    return out
