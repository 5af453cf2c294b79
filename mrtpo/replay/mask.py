"""Replay only what can move (METHOD.md section 5): which (response, reward) pairs of a batch
the contrastive replay needs to run, the ``replay_mask`` of ``replay_relevance`` and
``contrastive_replay`` (mrtpo/replay/api.py).

A reward whose GDPO advantage A_k is exactly 0 for a response moves none of its tokens, so
its replay can be skipped without changing one bit of the token advantages
(``replay_mask_from_rewards`` says which pairs can move). ``_bool_matrix`` reads a (B, K)
mask given as a tensor or as nested lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mrtpo_kernels import AdvantageSettings, gdpo_advantages


def replay_mask_from_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    has_info=None,
    weights: torch.Tensor | None = None,
    whole_rows: bool = False,
    settings: AdvantageSettings | None = None,
    **advantage_options,
) -> torch.Tensor:
    """(n, K) bool on the CPU: the (response, reward) pairs whose replay can move a token
    advantage, the ``replay_mask`` of ``replay_relevance`` and ``contrastive_replay``.

    A pair can move only where lambda_k A_k[i] is not exactly 0, A_k the GDPO per-reward
    advantage (``gdpo_advantages(rewards, group_ids, weights=, settings=, **options)``:
    a group of one, a reward with zero variance in its group and a response at its group's
    mean give exactly 0) and, with ``has_info`` (n, K), where the reward names spans. Where it is 0,
    ``mrtpo_token_advantages`` multiplies the pair's (finite) allocation weight by 0 and
    gives a token GDPO's value wherever every reward that moves has weight 1, whatever the
    weights of those that do not; the divisor D (batch std and cancellation floor) reads
    only the A_k. So whatever relevance such a pair has (0 when skipped) and whatever its
    has_info, the token advantages are the same bit for bit. Give the ``rewards``,
    ``group_ids``, ``weights`` and advantage settings the advantages are computed with (the
    whole batch's: with several processes, every process's rewards): the same
    ``AdvantageSettings`` as ``settings=``, or its fields (``eps``, ``nan``,
    ``scale_rewards``, ...) as keywords, checked by ``gdpo_advantages`` as there.

    ``whole_rows``: a row replays every pair with spans as soon as one of its pairs can move
    (needs ``has_info``). For a relevance that mixes a response's rewards (``specific``: r_k
    subtracts the other rewards' d), whose pairs cannot be skipped one by one.
    """
    g = gdpo_advantages(rewards, group_ids, weights=weights, settings=settings, **advantage_options)
    moves = g.per_reward != 0
    if weights is not None:
        lam = torch.as_tensor(weights, device=moves.device).reshape(1, -1)
        moves = moves & (lam != 0)
    moves = moves.cpu()
    if has_info is not None:
        info = _bool_matrix(has_info, "has_info", *moves.shape)
        moves = moves & info
        if whole_rows:
            moves = info & moves.any(dim=1, keepdim=True)
    elif whole_rows:
        raise ValueError("whole_rows: needs has_info (which pairs of a row have spans)")
    return moves


def _bool_matrix(value, name: str, b: int, k: int) -> torch.Tensor:
    """A (b, k) bool tensor on the CPU from a tensor or nested lists of bools (or 0 / 1)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"{name}: expected a bool (B, K) tensor, got {value.dtype}")
        if tuple(value.shape) != (b, k):
            raise ValueError(f"{name}: expected shape ({b}, {k}) (B, K), got {tuple(value.shape)}")
        t = value.detach().cpu()
        if t.dtype != torch.bool and bool(((t != 0) & (t != 1)).any()):
            raise ValueError(f"{name}: expected True / False (or 0 / 1) entries")
        return t.bool()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != b:
        raise ValueError(f"{name}: expected a (B, K) bool tensor or {b} lists of {k} bools")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != k:
            raise ValueError(f"{name}: sample {i} needs one entry per reward (K = {k})")
        for j, x in enumerate(row):
            if isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)):
                continue
            if hasattr(x, "dtype") and getattr(x, "ndim", 1) == 0 and x in (0, 1):
                continue
            raise ValueError(f"{name}: sample {i}, reward {j}: expected a bool, got {x!r}")
        rows.append([bool(x) for x in row])
    return torch.tensor(rows, dtype=torch.bool).reshape(b, k)
