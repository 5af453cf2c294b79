"""Teacher forcing: prompt + response rows laid out for one forward, and the hidden states
that predict each response token, for the trainer's policy forwards and the contrastive
replay (mrtpo/replay.py).

Layout of a teacher-forced batch: prompts left-padded to a common width P, responses
right-padded to R, position ids counted over the attention mask, so the hidden state that
predicts response token t of every row sits at column P - 1 + t whatever the prompt length.
``forward_shared_prompts`` runs each distinct prompt once and lets its key/value cache serve
every response that follows it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .model import decoder, last_hidden, lm_head


@dataclass
class TeacherBatch:
    """Padded prompt + response rows; ``response_mask`` (B, R) marks real response tokens."""

    input_ids: torch.Tensor  # (B, P + R)
    attention_mask: torch.Tensor  # (B, P + R)
    response_mask: torch.Tensor  # (B, R) bool
    labels: torch.Tensor  # (N,) packed response tokens, row by row
    prompt_width: int


def teacher_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, device
) -> TeacherBatch:
    if len(prompts) != len(responses):
        raise ValueError(
            f"responses: expected one per prompt ({len(prompts)}), got {len(responses)}"
        )
    b = len(prompts)
    p_width = max(len(p) for p in prompts)
    r_width = max(len(r) for r in responses)
    ids = torch.full((b, p_width + r_width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, p_width + r_width), dtype=torch.long)
    rmask = torch.zeros((b, r_width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_width - len(p) : p_width] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, p_width : p_width + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, p_width - len(p) : p_width + len(r)] = 1
        rmask[i, : len(r)] = True
    labels = torch.as_tensor([t for r in responses for t in r], dtype=torch.long)
    return TeacherBatch(
        ids.to(device), mask.to(device), rmask.to(device), labels.to(device), p_width
    )


def response_hidden(model, batch: TeacherBatch) -> torch.Tensor:
    """(N, d) packed last hidden states that predict each response token (with whatever
    grad mode is active)."""
    r_width = batch.response_mask.shape[1]
    h = last_hidden(model, batch.input_ids, batch.attention_mask)
    h = h[:, batch.prompt_width - 1 : batch.prompt_width - 1 + r_width]
    return h[batch.response_mask]


@torch.no_grad()
def forward_responses(model, prompts, responses, pad_id, *, micro_batch: int, device):
    """Teacher-forced (N, d) response hidden states of many rows, ``micro_batch`` rows per
    forward, without gradient."""
    out = []
    for s in range(0, len(prompts), micro_batch):
        tb = teacher_batch(
            prompts[s : s + micro_batch], responses[s : s + micro_batch], pad_id, device
        )
        out.append(response_hidden(model, tb))
    return torch.cat(out)


@torch.no_grad()
def forward_shared_prompts(model, prompts, responses, pad_id, *, micro_batch: int, device):
    """What ``forward_responses`` computes, with each distinct prompt run once: its key/value
    cache is shared by every response that follows it (the G responses of a group, and the
    G replays of one prompt without a reward's spans). At most ``micro_batch`` response rows
    per forward (more only when one prompt has more). Returns the (N, d) packed hidden
    states in the order of the rows."""
    if len(prompts) != len(responses):
        raise ValueError(
            f"responses: expected one per prompt ({len(prompts)}), got {len(responses)}"
        )
    rows_of: dict[tuple, list[int]] = {}
    for r, p in enumerate(prompts):
        if len(responses[r]):  # an empty response (e.g. a masked truncation) has no rows
            rows_of.setdefault(tuple(p), []).append(r)
    keys = list(rows_of)
    chunks, cur, n_rows = [], [], 0
    for key in keys:  # at most micro_batch rows a forward, unless one prompt has more
        if cur and n_rows + len(rows_of[key]) > micro_batch:
            chunks.append(cur)
            cur, n_rows = [], 0
        cur.append(key)
        n_rows += len(rows_of[key])
    if cur:
        chunks.append(cur)
    base = decoder(model)
    cache_kw = _cache_keyword(base)
    per_row: list[torch.Tensor | None] = [None] * len(prompts)
    for chunk in chunks:
        p_width = max(len(k) for k in chunk)
        b = len(chunk)
        ids = torch.full((b, p_width), pad_id, dtype=torch.long)
        mask = torch.zeros((b, p_width), dtype=torch.long)
        for i, key in enumerate(chunk):
            ids[i, p_width - len(key) :] = torch.as_tensor(key, dtype=torch.long)
            mask[i, p_width - len(key) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        head = base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        rows = [r for key in chunk for r in rows_of[key]]
        owner = torch.tensor(
            [i for i, key in enumerate(chunk) for _ in rows_of[key]], dtype=torch.long
        ).to(device)
        cache = _output_cache(head)
        cache.batch_select_indices(owner)
        r_width = max(len(responses[r]) for r in rows)
        rid = torch.full((len(rows), r_width), pad_id, dtype=torch.long)
        rmask = torch.zeros((len(rows), r_width), dtype=torch.long)
        for j, r in enumerate(rows):
            rid[j, : len(responses[r])] = torch.as_tensor(list(responses[r]), dtype=torch.long)
            rmask[j, : len(responses[r])] = 1
        rid, rmask = rid.to(device), rmask.to(device)
        p_len = mask.sum(-1)[owner]
        rpos = p_len[:, None] + torch.arange(r_width, device=device)[None, :]
        tail = base(
            input_ids=rid,
            attention_mask=torch.cat([mask[owner], rmask], dim=1),
            position_ids=rpos,
            use_cache=True,
            **{cache_kw: cache},
        ).last_hidden_state
        last = head.last_hidden_state[:, -1][owner]  # predicts each response's first token
        for j, r in enumerate(rows):
            t = len(responses[r])
            per_row[r] = torch.cat([last[j : j + 1], tail[j, : t - 1]])
    weight = lm_head(model)[0]
    empty = weight.new_empty((0, weight.shape[1]))
    return torch.cat([empty if h is None else h for h in per_row])


def _cache_keyword(model) -> str:
    """The forward's key/value cache argument: ``cache`` in newer transformers (which log a
    deprecation for the older name), ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    """The key/value cache of a model output, under either name."""
    if "cache" in out.keys():
        return out["cache"]
    return out["past_key_values"]
