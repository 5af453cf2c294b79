"""Step metrics: pass rates, relevance, the response tokens each reward concerns, credit
precision (how much of a reward's allocation lands on them), and the one-line step summary."""

from __future__ import annotations

import torch

from .config import TrainConfig
from .prompting import spans_to_token_mask
from .rollouts import Rollouts

PASS_THRESHOLD = 1.0 - 1e-6


def relevant_token_masks(task, rollouts: Rollouts) -> list[list[torch.Tensor | None]]:
    """(n, K): response tokens each constraint concerns (from the verifier's
    ``relevant_chars``), or None where the verifier does not say."""
    out = []
    for ex, text, off in zip(rollouts.examples, rollouts.texts, rollouts.offsets):
        row = []
        for v in task.verifiers:
            fn = getattr(v, "relevant_chars", None)
            if fn is None:
                row.append(None)
                continue
            try:
                chars = fn(ex, text)
            except Exception:
                chars = None
            row.append(None if chars is None else spans_to_token_mask(off, chars))
        out.append(row)
    return out


def credit_precision(alloc, masks, has_info, lengths):
    """Per reward: mean share of the allocation mass on the relevant tokens, and the share a
    uniform allocation would give (|relevant| / T), over responses where the reward has
    spans and the relevant tokens are a proper, non-empty subset of the response."""
    k = alloc.shape[0]
    starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(lengths, 0)
    prec = [[] for _ in range(k)]
    unif = [[] for _ in range(k)]
    for i in range(len(lengths)):
        a, b = int(starts[i]), int(starts[i + 1])
        for j in range(k):
            m = masks[i][j]
            if m is None or not bool(has_info[i, j]):
                continue
            m = m[: b - a]
            cnt = int(m.sum())
            if cnt == 0 or cnt == b - a:
                continue
            w = alloc[j, a:b].double()
            tot = float(w.sum())
            if tot <= 0:
                continue
            prec[j].append(float(w[m].sum()) / tot)
            unif[j].append(cnt / (b - a))
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None
    return [mean(p) for p in prec], [mean(u) for u in unif], [len(p) for p in prec]


def step_metrics(
    task, cfg: TrainConfig, step: int, ro: Rollouts, relevance, has_info, alloc, lengths
) -> dict:
    """One step's metrics row: pass rates and scores per reward, mean relevance, credit
    precision (allocation and relevance) against the uniform share."""
    r = ro.rewards
    passed = r >= PASS_THRESHOLD
    row = {"step": step, "algo": cfg.algo, "seed": cfg.seed}
    row["all_pass"] = float(passed.all(1).float().mean())
    row["mean_reward"] = float(r.mean())
    row["response_len"] = float(lengths.float().mean())
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    masks = relevant_token_masks(task, ro)
    prec, unif, counts = credit_precision(alloc, masks, has_info, lengths)
    rel_prec = [None] * len(task.verifiers)
    if relevance is not None:
        rel_prec, _, _ = credit_precision(relevance, masks, has_info, lengths)
    for j, name in enumerate(v.name for v in task.verifiers):
        row[f"pass/{name}"] = float(passed[:, j].float().mean())
        row[f"score/{name}"] = float(r[:, j].mean())
        info = has_info[seg, j]
        has = relevance is not None and bool(info.any())
        row[f"relevance/{name}"] = float(relevance[j][info].mean()) if has else None
        row[f"precision/{name}"] = prec[j]
        row[f"relevance_precision/{name}"] = rel_prec[j]
        row[f"uniform/{name}"] = unif[j]
    pairs = [(p, u, c) for p, u, c in zip(prec, unif, counts) if p is not None]
    rel_pairs = [(p, c) for p, c in zip(rel_prec, counts) if p is not None]
    rel_tot = sum(c for _, c in rel_pairs)
    row["relevance_precision"] = sum(p * c for p, c in rel_pairs) / rel_tot if rel_tot else None
    tot = sum(c for _, _, c in pairs)
    row["credit_precision"] = sum(p * c for p, _, c in pairs) / tot if tot else None
    row["uniform_share"] = sum(u * c for _, u, c in pairs) / tot if tot else None
    return row


def format_step(row: dict, names, total: int) -> str:
    short = lambda s: s if len(s) <= 14 else s[:13] + "."
    parts = [f"step {row['step']:>3}/{total}", f"all {row['all_pass']:.2f}"]
    parts.append(" ".join(f"{short(n)}={row[f'pass/{n}']:.2f}" for n in names))
    rel = [(n, row.get(f"relevance/{n}")) for n in names]
    if any(v is not None for _, v in rel):
        parts.append("rel " + " ".join(f"{v:.3f}" if v is not None else "-" for _, v in rel))
    if row.get("credit_precision") is not None:
        parts.append(f"prec {row['credit_precision']:.2f}/unif {row['uniform_share']:.2f}")
    return " | ".join(parts)
