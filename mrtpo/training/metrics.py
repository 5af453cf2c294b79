"""Step metrics: pass rates, relevance, the response tokens each reward concerns, credit
precision (how much of a reward's allocation lands on them), and the one-line step summary."""

from __future__ import annotations

import re

import torch

from mrtpo.replay.prompting import spans_to_token_mask

from .config import TrainConfig
from .rollouts import Rollouts

PASS_THRESHOLD = 1.0 - 1e-6


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LITERAL = re.compile(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")
_TOOL_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS_OPEN = re.compile(r'"arguments"\s*:\s*\{')
_ARG_PAIR = re.compile(
    r'("(?:[^"\\]|\\.)*")\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?'
    r"|true|false|null)"
)


def _sql_chars(name: str, ex, text: str):
    """The query's characters a SQL verifier checks: ``sql_schema`` the identifiers that name
    a table or column of the schema; ``sql_runs`` those of the gold tables (its prompt spans
    are their schema lines); ``sql_match`` those plus the literals (strings, numbers: where
    the question's content lands)."""
    schema = ex.fields.get("schema") or {}
    gold = set(ex.fields.get("gold_tables") or ())
    if name == "sql_schema":
        names = {t.lower() for t in schema} | {c.lower() for cs in schema.values() for c in cs}
    else:
        names = {t.lower() for t in gold}
        names |= {c.lower() for t in gold for c in schema.get(t, ())}
    out = [m.span() for m in _IDENT.finditer(text) if m.group().lower() in names]
    if name == "sql_match":
        out += [m.span() for m in _LITERAL.finditer(text)]
    return out


def _tool_chars(name: str, text: str):
    """The call's characters a tool verifier checks: ``tool_name`` the called name's string,
    ``tool_schema`` the argument keys, ``tool_args`` the argument values."""
    if name == "tool_name":
        return [m.span(1) for m in _TOOL_NAME.finditer(text)]
    start = _ARGS_OPEN.search(text)
    if start is None:
        return []
    pairs = list(_ARG_PAIR.finditer(text, start.end()))
    if name == "tool_schema":
        return [m.span(1) for m in pairs]
    if name == "tool_args":
        return [m.span(2) for m in pairs]
    return None


def analogue_chars(verifier, ex, text: str):
    """Response character spans for the SQL and tool verifiers, which name none themselves
    (the clause or argument each checks, by the rules above); None for other verifiers."""
    name = getattr(verifier, "name", "")
    if name in ("sql_match", "sql_runs", "sql_schema"):
        return _sql_chars(name, ex, text)
    if name in ("tool_name", "tool_schema", "tool_args"):
        return _tool_chars(name, text)
    return None


# Constraint kinds checked at the end of the answer: in a response cut at the token cap the
# characters such a check looked at are not where the answer failed (it never reached its
# end), so credit metrics leave those (response, reward) pairs out.
END_ANCHORED = frozenset({"end_phrase"})


def _checked_kind(verifier, ex) -> str | None:
    kind = getattr(verifier, "kind", None)
    if kind is None and getattr(verifier, "slot", None) is not None:
        entries = ex.fields.get("constraints") or []
        slot = verifier.slot
        kind = entries[slot].get("kind") if slot < len(entries) else None
    return kind


def relevant_token_masks(task, rollouts: Rollouts) -> list[list[torch.Tensor | None]]:
    """(n, K): response tokens each reward concerns (the verifier's ``relevant_chars``, or
    `analogue_chars` for SQL and tool calls), or None where neither says, and for an
    end-anchored check (`END_ANCHORED`) of a response cut at the token cap."""
    out = []
    truncated = rollouts.truncated or [False] * len(rollouts.texts)
    for ex, text, off, cut in zip(rollouts.examples, rollouts.texts, rollouts.offsets, truncated):
        row = []
        for v in task.verifiers:
            if cut and _checked_kind(v, ex) in END_ANCHORED:
                row.append(None)
                continue
            fn = getattr(v, "relevant_chars", None)
            try:
                chars = fn(ex, text) if fn is not None else analogue_chars(v, ex, text)
            except Exception:
                chars = None
            row.append(None if chars is None else spans_to_token_mask(off, chars))
        out.append(row)
    return out


def _judged(values, masks, has_info, lengths):
    """(reward j, that reward's values on one response in float64, the response's named-token
    mask) over the responses where reward j has spans and the tokens its verifier names are a
    proper, non-empty subset of the response."""
    starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(lengths, 0)
    for i in range(len(lengths)):
        a, b = int(starts[i]), int(starts[i + 1])
        for j in range(values.shape[0]):
            m = masks[i][j]
            if m is None or not bool(has_info[i, j]):
                continue
            m = m[: b - a]
            cnt = int(m.sum())
            if cnt == 0 or cnt == b - a or m.numel() != b - a:
                continue
            yield j, values[j, a:b].double(), m


def _means(lists):
    return [(sum(xs) / len(xs)) if xs else None for xs in lists]


def credit_precision(alloc, masks, has_info, lengths):
    """Per reward: mean share of the allocation mass on the relevant tokens, and the share a
    uniform allocation would give (|relevant| / T), over responses where the reward has
    spans and the relevant tokens are a proper, non-empty subset of the response."""
    k = alloc.shape[0]
    prec = [[] for _ in range(k)]
    unif = [[] for _ in range(k)]
    for j, w, m in _judged(alloc, masks, has_info, lengths):
        tot = float(w.sum())
        if tot <= 0:
            continue
        prec[j].append(float(w[m].sum()) / tot)
        unif[j].append(float(m.sum()) / m.numel())
    return _means(prec), _means(unif), [len(p) for p in prec]


def relevance_diagnostics(relevance, masks, has_info, lengths):
    """Per reward, how well the relevance ranks the tokens the verifier names, over the
    responses where the reward has spans and those tokens are a proper, non-empty subset:

    - ``hit``: share of responses whose highest-relevance token is a named one (ties shared
      out, so a constant relevance scores its chance), against ``hit_chance`` = mean
      |named| / T;
    - ``auc``: mean over responses of the rank AUC (Mann-Whitney, ties 1/2) of named vs
      other tokens; chance 0.5.
    Returns (hit, hit_chance, auc), lists of K floats or None."""
    k = relevance.shape[0]
    hit, chance, auc = ([[] for _ in range(k)] for _ in range(3))
    for j, r, m in _judged(relevance, masks, has_info, lengths):
        if not bool(torch.isfinite(r).all()):
            continue
        top = r == r.max()
        hit[j].append(float(top[m].sum()) / float(top.sum()))
        chance[j].append(float(m.sum()) / m.numel())
        pos, neg = r[m], r[~m]
        greater = (pos[:, None] > neg[None, :]).double().sum()
        ties = (pos[:, None] == neg[None, :]).double().sum()
        auc[j].append(float(greater + 0.5 * ties) / (pos.numel() * neg.numel()))
    return _means(hit), _means(chance), _means(auc)


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
    hit = hit_chance = auc = [None] * len(task.verifiers)
    if relevance is not None:
        rel_prec, _, _ = credit_precision(relevance, masks, has_info, lengths)
        hit, hit_chance, auc = relevance_diagnostics(relevance, masks, has_info, lengths)
    for j, name in enumerate(v.name for v in task.verifiers):
        row[f"pass/{name}"] = float(passed[:, j].float().mean())
        row[f"score/{name}"] = float(r[:, j].mean())
        info = has_info[seg, j]
        has = relevance is not None and bool(info.any())
        row[f"relevance/{name}"] = float(relevance[j][info].mean()) if has else None
        row[f"precision/{name}"] = prec[j]
        row[f"relevance_precision/{name}"] = rel_prec[j]
        row[f"uniform/{name}"] = unif[j]
        row[f"top_hit/{name}"] = hit[j]
        row[f"top_hit_chance/{name}"] = hit_chance[j]
        row[f"rank_auc/{name}"] = auc[j]
    pairs = [(p, u, c) for p, u, c in zip(prec, unif, counts) if p is not None]
    rel_pairs = [(p, c) for p, c in zip(rel_prec, counts) if p is not None]
    rel_tot = sum(c for _, c in rel_pairs)
    row["relevance_precision"] = sum(p * c for p, c in rel_pairs) / rel_tot if rel_tot else None
    tot = sum(c for _, _, c in pairs)
    row["credit_precision"] = sum(p * c for p, _, c in pairs) / tot if tot else None
    row["uniform_share"] = sum(u * c for _, u, c in pairs) / tot if tot else None
    row["truncated"] = sum(ro.truncated) / len(ro.truncated) if ro.truncated else None
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
    t = row.get("time") or {}
    seconds = [t.get(k) for k in ("rollout", "replay", "update")]
    if all(isinstance(s, (int, float)) for s in seconds):
        parts.append(f"{sum(seconds):.1f} s/step")
    return " | ".join(parts)


def format_eval(ev: dict, names) -> str:
    """One held-out evaluation (`mrtpo.training.heldout`) as a progress line."""
    short = lambda s: s if len(s) <= 14 else s[:13] + "."
    per = " ".join(f"{short(n)}={ev['pass'][n]:.2f}" for n in names)
    return (
        f"held-out after step {ev['step']}: all {ev['all_pass']:.2f} | {per} | "
        f"{ev['answers']} answers, {ev['seconds']:.1f} s"
    )
