"""Teacher forcing: prompt + response rows laid out for one forward, and the hidden states
that predict each response token, for the trainer's policy forwards and the contrastive
replay (mrtpo/replay/engine.py).

Layout of a teacher-forced batch: prompts left-padded to a common width P, responses
right-padded to R, position ids counted over the attention mask, so the hidden state that
predicts response token t of every row sits at column P - 1 + t whatever the prompt length.
``forward_shared_prompts`` runs each distinct prompt once and lets its key/value cache serve
every response that follows it; ``forward_after_prefix`` starts a prompt from another
prompt's cache of their common first tokens (up to ``PACKED_ROW_TOKENS``, the rest of the
prompt and the responses as one packed row with a 4-D mask). Responses go through a cache in
pieces of at most ``TAIL_PIECE`` tokens, with an attention mask only where prompts are
left-padded.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mrtpo.model.access import decoder, decoder_output, last_hidden, lm_head


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


def response_hidden(
    model,
    batch: TeacherBatch,
    prompts: Sequence[Sequence[int]] | None = None,
    prefixes: dict | None = None,
) -> torch.Tensor:
    """(N, d) packed last hidden states that predict each response token (with whatever
    grad mode is active).

    ``prefixes``: a dict to fill, as ``prompt_caches`` fills it, with the key/value cache of
    each distinct prompt of the batch (``prompts``, the batch's rows' prompt ids) taken from
    this same forward, detached: the caches a replay starts from, without a forward of the
    prompts alone (``mrtpo train`` on-policy). Causal attention makes a prompt's keys and
    values those of the prompt alone (the same positions, counted over the attention mask).
    Left empty where the model's cache is not a plain per-layer key/value cache."""
    r_width = batch.response_mask.shape[1]
    if prefixes is None:
        h = last_hidden(model, batch.input_ids, batch.attention_mask)
    else:
        if prompts is None or len(prompts) != batch.input_ids.shape[0]:
            raise ValueError("prompts: expected the batch's rows' prompt ids with prefixes")
        h = _hidden_keeping_prompt_caches(model, batch, prompts, prefixes)
    h = h[:, batch.prompt_width - 1 : batch.prompt_width - 1 + r_width]
    return h[batch.response_mask]


def _hidden_keeping_prompt_caches(model, batch: TeacherBatch, prompts, prefixes: dict):
    """``last_hidden`` of the batch, its forward run with a key/value cache whose prompt
    positions fill ``prefixes`` (detached views: the forward's own tensors, no copy)."""
    out = decoder_output(model, batch.input_ids, batch.attention_mask, use_cache=True)
    kv = _plain_layers(_output_cache(out))
    if kv is not None:
        p_width = batch.prompt_width
        for i, p in enumerate(prompts):
            key = tuple(int(t) for t in p)
            if not key or key in prefixes:
                continue
            a = p_width - len(key)
            prefixes[key] = [
                (k[i : i + 1, :, a:p_width].detach(), v[i : i + 1, :, a:p_width].detach())
                for k, v in kv
            ]
    return out.last_hidden_state


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


# a teacher-forced response goes through the key/value cache in pieces of at most this many
# tokens: the attention mask of one piece is (rows, 1, piece, prompt + response) at most, not
# (rows, 1, R, P + R) (2.5 GiB at 16k tokens, 4 rows, fp32)
TAIL_PIECE = 1024


@torch.no_grad()
def forward_shared_prompts(
    model,
    prompts,
    responses,
    pad_id,
    *,
    micro_batch: int,
    device,
    prefixes: dict | None = None,
    max_piece: int = TAIL_PIECE,
):
    """What ``forward_responses`` computes, with each distinct prompt run once: its key/value
    cache is shared by every response that follows it (the G responses of a group, and the
    G replays of one prompt without a reward's spans). At most ``micro_batch`` response rows
    per forward (more only when one prompt has more); the responses go through the cache
    in pieces of at most ``max_piece`` tokens. Returns the (N, d) packed hidden states in
    the order of the rows.

    ``prefixes``: a dict to fill with each distinct prompt's key/value cache (its own
    tokens, no padding; per layer a (1, heads, len, head_dim) key and value), for
    ``forward_after_prefix``; left empty when the model's cache is not a plain per-layer
    key/value cache (sliding windows, quantized or linear-attention layers)."""
    if len(prompts) != len(responses):
        raise ValueError(
            f"responses: expected one per prompt ({len(prompts)}), got {len(responses)}"
        )
    _check_piece(max_piece)
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
        cache = _output_cache(head)
        if prefixes is not None:
            kv = _plain_layers(cache)
            for i, key in enumerate(chunk):
                if kv is not None:
                    a = p_width - len(key)
                    prefixes[key] = [(k[i : i + 1, :, a:], v[i : i + 1, :, a:]) for k, v in kv]
        rows = [r for key in chunk for r in rows_of[key]]
        owner = torch.tensor(
            [i for i, key in enumerate(chunk) for _ in rows_of[key]], dtype=torch.long
        ).to(device)
        cache.batch_select_indices(owner)
        # left padding (prompts of several lengths) needs the 2-D mask; without it the
        # responses' right padding is harmless (causal: a real token never sees a later pad)
        p_mask = None if len({len(k) for k in chunk}) == 1 else mask[owner]
        tail = _tail_hidden(
            base,
            cache_kw,
            cache,
            p_mask,
            mask.sum(-1)[owner],
            [responses[r] for r in rows],
            pad_id,
            device,
            max_piece,
        )
        last = head.last_hidden_state[:, -1][owner]  # predicts each response's first token
        for j, r in enumerate(rows):
            t = len(responses[r])
            per_row[r] = torch.cat([last[j : j + 1], tail[j, : t - 1]])
    weight = lm_head(model)[0]
    empty = weight.new_empty((0, weight.shape[1]))
    return torch.cat([empty if h is None else h for h in per_row])


@torch.no_grad()
def prompt_caches(model, prompts, pad_id, *, micro_batch: int, device, prefixes: dict) -> None:
    """Fill ``prefixes`` with each distinct prompt's key/value cache, as
    ``forward_shared_prompts(prefixes=)`` does, running the prompts alone (no response): for
    a caller that has the responses' hidden states from another forward (``mrtpo train``'s
    update) and needs only the caches that ``forward_after_prefix`` starts from. At most
    ``micro_batch`` prompts a forward; left empty where the model's cache is not a plain
    per-layer key/value cache."""
    keys = list(dict.fromkeys(tuple(p) for p in prompts if len(p)))
    base = decoder(model)
    for s in range(0, len(keys), micro_batch):
        chunk = keys[s : s + micro_batch]
        p_width = max(len(k) for k in chunk)
        ids = torch.full((len(chunk), p_width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), p_width), dtype=torch.long)
        for i, key in enumerate(chunk):
            ids[i, p_width - len(key) :] = torch.as_tensor(key, dtype=torch.long)
            mask[i, p_width - len(key) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        head = base(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        kv = _plain_layers(_output_cache(head))
        if kv is None:
            return
        for i, key in enumerate(chunk):
            a = p_width - len(key)
            prefixes[key] = [(k[i : i + 1, :, a:], v[i : i + 1, :, a:]) for k, v in kv]


@torch.no_grad()
def forward_after_prefix(
    model, prefix, prompt, responses, pad_id, *, device, max_piece: int = TAIL_PIECE
):
    """The (N, d) packed hidden states predicting each response token after ``prompt``
    (one prompt shared by all rows), its first tokens' key/value cache given: ``prefix``,
    per layer a (1, heads, L, head_dim) key and value of ``prompt[:L]`` (from
    ``forward_shared_prompts(prefixes=)`` of a prompt that starts with those L tokens).
    Only ``prompt[L:]`` (at least one token) and the responses are fed to the model: up to
    ``PACKED_ROW_TOKENS`` in one packed row (``_packs_rows``, ``_packed_after_prefix``),
    else the prompt suffix once, then the responses through its cache in pieces of at most
    ``max_piece`` tokens, with no attention mask (one prompt, no left padding)."""
    _check_piece(max_piece)
    n_pre = int(prefix[0][0].shape[2]) if prefix else 0
    if not 0 <= n_pre < len(prompt):
        raise ValueError(
            f"prefix: expected fewer tokens than the prompt ({len(prompt)}), got {n_pre}"
        )
    from transformers import DynamicCache

    base = decoder(model)
    cache_kw = _cache_keyword(base)
    rows = [r for r in range(len(responses)) if len(responses[r])]
    weight = lm_head(model)[0]
    if not rows:
        return weight.new_empty((0, weight.shape[1]))
    cache = DynamicCache(ddp_cache_data=[(k, v) for k, v in prefix]) if n_pre else None
    n_packed = len(prompt) - n_pre + sum(len(responses[r]) - 1 for r in rows)
    if n_pre and _packs_rows(base, n_packed, max_piece):
        return _packed_after_prefix(base, cache_kw, cache, n_pre, prompt, rows, responses, device)
    suffix = torch.as_tensor(list(prompt[n_pre:]), dtype=torch.long, device=device)[None]
    pos = torch.arange(n_pre, len(prompt), device=device)[None]
    kw = {} if cache is None else {cache_kw: cache}
    head = base(input_ids=suffix, position_ids=pos, use_cache=True, **kw)
    cache = _output_cache(head)
    cache.batch_repeat_interleave(len(rows))
    p_len = torch.full((len(rows),), len(prompt), dtype=torch.long, device=device)
    tail = _tail_hidden(
        base, cache_kw, cache, None, p_len, [responses[r] for r in rows], pad_id, device, max_piece
    )
    last = head.last_hidden_state[0, -1:]
    return torch.cat(
        [torch.cat([last, tail[j, : len(responses[r]) - 1]]) for j, r in enumerate(rows)]
    )


# a replay unit runs as one packed row (``_packed_after_prefix``) up to this many tokens: the
# forward it saves has a fixed cost (on a CPU about 50 ms for a 135M model, the weights' pass
# through the GEMMs, as much as ~100 tokens), while the row's attention also computes the
# masked scores between its responses, which grow with the square of the row (at 2 x 256
# response tokens the packed row was 6 % slower than the suffix-then-responses path)
PACKED_ROW_TOKENS = 256


def _packs_rows(base, n_tokens: int, max_piece: int) -> bool:
    """Whether a unit's prompt suffix and responses run as one packed row
    (``_packed_after_prefix``): at most ``PACKED_ROW_TOKENS`` and ``max_piece`` tokens, and
    a decoder that takes a 4-D boolean mask as given: SDPA attention with every layer
    full-attention (no sliding window, which a custom mask would override)."""
    cfg = getattr(base, "config", None)
    if n_tokens > min(max_piece, PACKED_ROW_TOKENS):
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(cfg, "sliding_window", None) is not None and getattr(
        cfg, "use_sliding_window", True
    ):
        return False
    types = getattr(cfg, "layer_types", None)
    return types is None or all(t == "full_attention" for t in types)


def _packed_after_prefix(base, cache_kw, cache, n_pre, prompt, rows, responses, device):
    """``forward_after_prefix`` in one forward of one packed row: the prompt suffix
    ``prompt[n_pre:]``, then each response but its last token, side by side; a 4-D mask lets
    the suffix see the cached prefix and itself causally, and each response the prefix, the
    whole suffix and itself causally (never another response); position ids continue the
    prompt in each response. The suffix's keys and values are computed once for all rows,
    and the unit pays one forward's fixed cost (on a CPU, the weights' pass through the
    GEMMs) instead of two."""
    p_len, n_suf = len(prompt), len(prompt) - n_pre
    cut = [list(responses[r][:-1]) for r in rows]  # a response's last token predicts nothing
    length = n_suf + sum(len(c) for c in cut)
    ids = torch.as_tensor(list(prompt[n_pre:]) + [t for c in cut for t in c], dtype=torch.long)
    pos = list(range(n_pre, p_len))
    mask = torch.zeros((length, n_pre + length), dtype=torch.bool)
    mask[:, :n_pre] = True
    mask[:n_suf, n_pre : n_pre + n_suf] = torch.ones(n_suf, n_suf, dtype=torch.bool).tril()
    at = n_suf
    for c in cut:
        m = len(c)
        pos.extend(range(p_len, p_len + m))
        mask[at : at + m, n_pre : n_pre + n_suf] = True
        mask[at : at + m, n_pre + at : n_pre + at + m] = torch.ones(m, m, dtype=torch.bool).tril()
        at += m
    h = base(
        input_ids=ids[None].to(device),
        position_ids=torch.as_tensor(pos, dtype=torch.long, device=device)[None],
        attention_mask=mask[None, None].to(device),
        use_cache=True,
        **{cache_kw: cache},
    ).last_hidden_state[0]
    last, out, at = h[n_suf - 1 : n_suf], [], n_suf
    for c in cut:
        out += [last, h[at : at + len(c)]]
        at += len(c)
    return torch.cat(out)


def _tail_hidden(base, cache_kw, cache, p_mask, p_len, responses, pad_id, device, max_piece):
    """(rows, R, d) last hidden states of the right-padded ``responses`` fed after their
    prompts' cache, in pieces of at most ``max_piece`` tokens. ``p_mask``: the prompts'
    (rows, P) 0/1 mask when they are left-padded, else None (no mask is built)."""
    r_width = max(len(r) for r in responses)
    rid = torch.full((len(responses), r_width), pad_id, dtype=torch.long)
    rmask = torch.zeros((len(responses), r_width), dtype=torch.long)
    for j, resp in enumerate(responses):
        rid[j, : len(resp)] = torch.as_tensor(list(resp), dtype=torch.long)
        rmask[j, : len(resp)] = 1
    rid, rmask = rid.to(device), rmask.to(device)
    rpos = p_len[:, None] + torch.arange(r_width, device=device)[None, :]
    out = []
    for s in range(0, r_width, max_piece):
        e = min(s + max_piece, r_width)
        kw = {} if p_mask is None else {"attention_mask": torch.cat([p_mask, rmask[:, :e]], 1)}
        h = base(
            input_ids=rid[:, s:e],
            position_ids=rpos[:, s:e],
            use_cache=True,
            **kw,
            **{cache_kw: cache},
        )
        out.append(h.last_hidden_state)
        cache = _output_cache(h)
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def _check_piece(max_piece) -> None:
    if isinstance(max_piece, bool) or not isinstance(max_piece, int) or max_piece < 1:
        raise ValueError(f"max_piece: expected a positive int, got {max_piece!r}")


def _plain_layers(cache):
    """Per layer (keys, values) of a cache made of plain growing key/value layers (the
    default of full-attention decoders), else None (nothing to reuse safely)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # an older cache API: no prefix reuse
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    if any(getattr(layer, "keys", None) is None for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


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
