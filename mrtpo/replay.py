"""Contrastive replay (METHOD.md section 2): how much each response token depends on the
prompt spans a verifier checks.

For response i and reward k whose verdict names prompt spans, the prompt x^{-k} is the
prompt text with those spans removed, rendered through the same chat template and
re-tokenized. The response tokens y_i are teacher-forced after x (once, shared by all K and
by the old log-probs) and after every x^{-k}, in batched forwards without gradient. The
last hidden states at the response positions and the LM head go to ``linear_js_distance``
one-vs-many: hidden_p (N, d) against hidden_q (K, N, d). Rewards without spans need no
replay: their hidden_q rows are hidden_p itself (distance 0) and has_info is False.

Layout of a teacher-forced batch: prompts left-padded to a common width P, responses
right-padded to R, position ids counted over the attention mask, so the hidden state that
predicts response token t of every row sits at column P - 1 + t whatever the prompt length.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mrtpo_kernels import linear_js_distance, linear_logprobs

from .model import decoder, last_hidden, lm_head
from .prompting import ChatPrompter, Span, merge_spans


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
    G replays of one prompt without a reward's spans). About ``micro_batch`` response rows
    per forward. Returns the (N, d) packed hidden states in the order of the rows."""
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
    for key in keys:
        cur.append(key)
        n_rows += len(rows_of[key])
        if n_rows >= micro_batch:
            chunks.append(cur)
            cur, n_rows = [], 0
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


@dataclass
class ReplayResult:
    hidden_p: torch.Tensor  # (N, d) with-information hidden states
    old_logprobs: torch.Tensor  # (N,) log-probs of the response tokens at the temperature
    relevance: torch.Tensor | None  # (K, N) JS distances, or None when replay was skipped
    replayed: int  # number of (response, reward) replays run, control replays included
    control: torch.Tensor | None = None  # (N,) d_ctrl (0 where no control span), if asked
    # (K, N) |log p(y_t | prompt) - log p(y_t | prompt without reward k's spans)| of the
    # sampled tokens, if asked (0 where reward k has no spans)
    logratio: torch.Tensor | None = None


def control_span(prompt: str, spans_by_reward: Sequence[Sequence[Span]]) -> list[Span]:
    """A prompt span that no verifier checks, of about the length the rewards remove
    (METHOD.md 3b, "control"): the unchecked stretch of the prompt (whitespace trimmed) whose
    length is closest to the mean removed length, cut to about that length at a space when
    it is much longer. [] when every reward's spans are empty or the whole prompt is checked.
    """
    removed = [sum(e - s for s, e in merge_spans(row)) for row in spans_by_reward if row]
    if not removed:
        return []
    want = sum(removed) / len(removed)
    covered = merge_spans(s for row in spans_by_reward for s in row)
    gaps, pos = [], 0
    for s, e in [*covered, (len(prompt), len(prompt))]:
        a, b = pos, min(s, len(prompt))
        while a < b and prompt[a].isspace():
            a += 1
        while b > a and prompt[b - 1].isspace():
            b -= 1
        if b > a:
            gaps.append((a, b))
        pos = max(pos, e)
    if not gaps:
        return []
    a, b = min(gaps, key=lambda g: (abs((g[1] - g[0]) - want), g[0]))
    if b - a > 1.5 * want:
        cut = prompt.find(" ", a + max(1, round(want)), b)
        b = b if cut < 0 else cut
    return [(a, b)]


def prompt_without(prompter: ChatPrompter, prompt: str, spans, cache: dict) -> list[int]:
    """Token ids of the templated prompt with ``spans`` removed (memoized per batch)."""
    key = (prompt, tuple(sorted(tuple(s) for s in spans)))
    if key not in cache:
        cache[key] = prompter.encode(prompt, remove=spans).ids
    return cache[key]


@torch.no_grad()
def contrastive_replay(
    model,
    prompter: ChatPrompter,
    prompt_texts: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    spans: Sequence[Sequence[Sequence[tuple[int, int]]]],
    *,
    temperature: float,
    micro_batch: int = 32,
    replay: bool = True,
    control: Sequence[Sequence[Span]] | None = None,
    pointwise: bool = False,
) -> ReplayResult:
    """Old log-probs and, with ``replay``, the (K, N) relevance of every reward's spans.

    Args:
        prompt_texts: (n,) raw prompt contents (the coordinates of ``spans``).
        prompt_ids: (n,) templated prompt token ids (with all information).
        responses: (n,) response token ids (T_i >= 0 each; an empty response, such as a
            truncated completion that TRL masks, gets no rows in the (K, N) results and
            no replay).
        spans: (n, K) per response and reward, the prompt spans its verdict names.
        control: optional (n,) per response a prompt span no verifier checks
            (``control_span``); its removal is replayed too and ``control`` holds the (N,)
            JS distance d_ctrl (0 for a response whose control span is empty).
        pointwise: also return ``logratio`` (K, N), the absolute change of each sampled
            token's log-prob when reward k's spans are removed (from the same replays).
    """
    n = len(responses)
    if not (len(prompt_texts) == len(prompt_ids) == len(spans) == n):
        raise ValueError("prompt_texts, prompt_ids, spans: expected one entry per response")
    k = len(spans[0]) if n else 0
    device = next(model.parameters()).device
    pad_id = prompter.tokenizer.pad_token_id
    weight, bias = lm_head(model)
    hidden_p = forward_shared_prompts(
        model, prompt_ids, responses, pad_id, micro_batch=micro_batch, device=device
    )
    labels = torch.as_tensor([t for r in responses for t in r], dtype=torch.long).to(device)
    if labels.numel() == 0:  # every response empty: no token rows, nothing to replay
        empty = hidden_p.new_zeros((0,), dtype=torch.float32)
        rel = hidden_p.new_zeros((k, 0), dtype=torch.float32) if replay and k else None
        ctrl = empty if replay and k and control is not None else None
        return ReplayResult(hidden_p, empty, rel, 0, ctrl)
    old = linear_logprobs(hidden_p, weight, labels, bias=bias, temperature=temperature)
    if not replay or k == 0:
        return ReplayResult(hidden_p, old, None, 0)

    lengths = [len(r) for r in responses]
    starts = [0]
    for t in lengths:
        starts.append(starts[-1] + t)
    rows = k + (control is not None)
    hidden_q = hidden_p.unsqueeze(0).repeat(rows, 1, 1)
    jobs, cache = [], {}
    for i in range(n):
        for j in range(k):
            if spans[i][j] and lengths[i]:  # nothing to replay for an empty response
                jobs.append((i, j, prompt_without(prompter, prompt_texts[i], spans[i][j], cache)))
        if control is not None and control[i] and lengths[i]:
            jobs.append((i, k, prompt_without(prompter, prompt_texts[i], control[i], cache)))
    if jobs:
        # replays of one prompt without the same spans share its key/value cache
        h = forward_shared_prompts(
            model,
            [c[2] for c in jobs],
            [responses[c[0]] for c in jobs],
            pad_id,
            micro_batch=micro_batch,
            device=device,
        )
        pos = 0
        for i, j, _ in jobs:
            hidden_q[j, starts[i] : starts[i + 1]] = h[pos : pos + lengths[i]]
            pos += lengths[i]
    dist = linear_js_distance(hidden_p, hidden_q, weight, bias=bias, temperature=temperature)
    ctrl = dist[k] if control is not None else None
    ratio = None
    if pointwise:  # rows without a replay hold hidden_p itself: |0| there
        ratio = torch.stack([
            (linear_logprobs(hidden_q[j], weight, labels, bias=bias, temperature=temperature)
             - old).abs()
            for j in range(k)
        ])  # fmt: skip
    return ReplayResult(hidden_p, old, dist[:k], len(jobs), ctrl, ratio)


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
