"""The advantages of a training step (`mrtpo.training.trainer.Trainer`): ``grpo`` (the summed reward
through ``gdpo_advantages`` with K = 1, uniform over tokens), ``gdpo`` (``gdpo_advantages``,
uniform), ``mrtpo`` (``mrtpo_token_advantages``, packed with cu_seqlens, allocated as the
run's allocation decisions make it); and the oracle relevance, a diagnostic upper bound."""

from __future__ import annotations

import torch

from mrtpo.allocation import Allocation
from mrtpo.allocation.tensors import allocation_inputs
from mrtpo_kernels import gdpo_advantages, mrtpo_token_advantages

from .metrics import relevant_token_masks


def oracle_relevance(task, ro, lengths) -> torch.Tensor:
    """(K, N) 1 on the response tokens each reward's verifier names (`relevant_token_masks`:
    ``relevant_chars`` or the SQL / tools analogue), 0 elsewhere: a diagnostic upper bound on
    credit precision (1), not the method. A response whose verifier names no token, or all
    of them, gets 0 everywhere, so its allocation stays uniform (below delta)."""
    masks = relevant_token_masks(task, ro)
    rel = torch.zeros((len(task.verifiers), int(lengths.sum())), dtype=torch.float32)
    a = 0
    for i, n in enumerate(lengths.tolist()):
        for k, m in enumerate(masks[i]):
            if m is not None and 0 < int(m[:n].sum()) < n:
                rel[k, a : a + min(n, m.shape[0])] = m[:n].float()
        a += n
    return rel


def compute_advantages(
    algo, rewards, group_ids, relevance, has_info, lengths, cfg, control=None, finished=None
):
    """Token advantages (N,) packed, and the allocation weights (K, N) actually applied.
    Under mrtpo, ``relevance`` (K, N) allocates as ``cfg``'s allocation decisions make it
    (``mrtpo.allocation.tensors.allocation_inputs``: ``cfg.truncated_credit`` on the
    responses not ``finished`` (n,) bool, the relevance form ``cfg.relevance``, with
    ``control`` the d_ctrl (N,) of the control form, and ``cfg.stop_credit`` on the stop
    token of each finished response; ``finished`` None: neither credit rule applies)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    k, n_tok = rewards.shape[1], int(cu[-1])
    uniform = torch.ones((k, n_tok), dtype=torch.float32)
    if algo == "mrtpo":
        allocation = Allocation(cfg.relevance, cfg.stop_credit, cfg.truncated_credit)
        relevance, has_info, gamma = allocation_inputs(
            allocation,
            relevance,
            has_info,
            cfg.gamma,
            lengths=lengths,
            finished=finished,
            control=control,
        )
        ta = mrtpo_token_advantages(
            rewards,
            group_ids,
            relevance,
            has_info=has_info,
            cu_seqlens=cu,
            alpha=cfg.alpha,
            gamma=gamma,
            batch_norm=cfg.batch_norm,
        )
        return ta.token.float(), ta.allocation.float()
    summed = rewards.sum(1, keepdim=True) if algo == "grpo" else rewards
    g = gdpo_advantages(summed, group_ids, batch_norm=cfg.batch_norm, lengths=lengths)
    return g.sequence.float().repeat_interleave(lengths), uniform
