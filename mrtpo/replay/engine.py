"""The contrastive replay's engine (METHOD.md section 2), shared by ``replay_relevance`` and
``contrastive_replay`` (mrtpo/replay/api.py): ``_replay_core`` teacher-forces the response tokens
after the full prompt and after every prompt without a reward's spans, and gives the JS
distances of the response tokens' next-token distributions.

The response tokens y_i are teacher-forced after x (once, shared by all K and by the old
log-probs) and after every x^{-k}, in batched forwards without gradient; a prompt's forward
runs once and its key/value cache serves every response that follows it, and a prompt
without spans starts from the full prompt's cache at their longest common token prefix (only
the rest of it is run). The last hidden states at the response positions and the LM head go
to ``linear_js_distance`` one-vs-many: hidden_p (n, d) against hidden_q (K', n, d), per group
of rows with the same kept rewards, chunk by chunk of rows. A model that is not a Hugging
Face module comes as a ``CallableLM`` (its hidden states and LM head).

The teacher-forced batches and the prefix-shared forwards are mrtpo/replay/teacher_forcing.py's.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mrtpo.model.access import lm_head, logit_transform
from mrtpo_kernels import linear_js_distance, linear_logprobs

from .spans import normalize_spans, prompt_without_spans
from .teacher_forcing import (
    forward_after_prefix,
    forward_shared_prompts,
    prompt_caches,
    teacher_batch,
)


@dataclass
class CallableLM:
    """A causal LM given as a function, for models that are not Hugging Face modules.

    ``hidden(input_ids, attention_mask, position_ids)`` returns the (B, L, d) hidden states
    after the final norm (what the LM head reads) for left-padded (B, L) input;
    ``weight`` (V, d) and ``bias`` (V,) or None are the LM head; ``logit_scale`` and
    ``softcap`` its logit transform (``mrtpo_kernels.linear_logprobs``; defaults: none).
    Such a model is run on whole prompt + response rows (no key/value cache to share a
    prompt between rows).
    """

    hidden: Callable
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None


def _head(model):
    if isinstance(model, CallableLM):
        return model.weight, model.bias
    if not hasattr(model, "get_output_embeddings"):
        raise ValueError(
            f"model: expected a Hugging Face causal LM or a mrtpo.replay.api.CallableLM, got "
            f"{type(model).__name__}"
        )
    return lm_head(model)


def _head_transform(model) -> dict:
    """The head's logit transform as the fused ops' keywords (mrtpo.model.loading.logit_transform
    reads a Hugging Face model's config); ``{}`` for none."""
    if isinstance(model, CallableLM):
        kw = {} if model.logit_scale == 1.0 else {"logit_scale": model.logit_scale}
        return kw | ({} if model.softcap is None else {"softcap": model.softcap})
    return logit_transform(model)


def _rows_hidden(
    model, prompts, responses, pad_id, micro_batch, device, *, prefixes=None, prefix=None
) -> torch.Tensor:
    """(N, d) packed hidden states predicting each response token, without gradient.

    ``prefixes``: a dict that the with-information forward fills with each distinct
    prompt's key/value cache (``forward_shared_prompts``). ``prefix``: per layer the cached
    keys and values of the first tokens of the one prompt all rows share; only the rest of
    the prompt and the responses are then run (``forward_after_prefix``). Both are for Hugging
    Face models only (a ``CallableLM`` always runs whole rows)."""
    if not isinstance(model, CallableLM):
        if prefix is not None:
            h = forward_after_prefix(model, prefix, prompts[0], responses, pad_id, device=device)
        else:
            h = forward_shared_prompts(
                model,
                prompts,
                responses,
                pad_id,
                micro_batch=micro_batch,
                device=device,
                prefixes=prefixes,
            )
        return h.to(lm_head(model)[0].dtype)  # under autocast the decoder may give bf16
    out = [model.weight.new_empty((0, model.weight.shape[1]))]
    for s in range(0, len(prompts), micro_batch):
        tb = teacher_batch(
            prompts[s : s + micro_batch], responses[s : s + micro_batch], pad_id, device
        )
        pos = (tb.attention_mask.cumsum(-1) - 1).clamp(min=0)
        h = model.hidden(tb.input_ids, tb.attention_mask, pos)
        r_width = tb.response_mask.shape[1]
        out.append(h[:, tb.prompt_width - 1 : tb.prompt_width - 1 + r_width][tb.response_mask])
    return torch.cat(out).to(model.weight.dtype)


def _shared_prefix(prefixes, full, ids):
    """The cached keys and values of the longest common token prefix of the full prompt
    ``full`` and the prompt without spans ``ids`` (at most len(ids) - 1 tokens, so that a
    prompt token is still run and predicts the first response token), or None when there
    is none or ``full``'s cache was not kept."""
    kv = None if prefixes is None else prefixes.get(tuple(full))
    if kv is None:
        return None
    n = 0
    for a, b in zip(full, ids[: len(ids) - 1]):
        if a != b:
            break
        n += 1
    if n == 0:
        return None
    return [(k[:, :, :n], v[:, :, :n]) for k, v in kv]


# a GEMM of fewer than 4 rows takes another BLAS kernel whose rows differ in the last bits
# from the same rows in a larger GEMM (measured with MKL, AVX-512): the JS and log-prob
# GEMMs of a group of kept pairs get at least this many token rows (copies, dropped), so
# that a token's distance never depends on which other pairs were kept
_MIN_JS_TOKENS = 4


def _stream_ids(prompts, streams, encode, start=None):
    """Per row, per stream, the token ids of the prompt without that stream's spans (None
    where the stream names no span: nothing to replay).

    A prompt without spans that renders to no token at all (a plain prompt whose spans
    cover all of it, on a tokenizer that adds no BOS) is the one-token context ``[start]``
    (``_start_token``: the response after no prompt at all); with no such token it is a
    ValueError naming the sample and the reward. A chat prompt never renders empty: a span
    covering a whole message leaves the template's frame."""
    out = []
    for i, (prompt, row) in enumerate(zip(prompts, streams)):
        ids = []
        for j, spans in enumerate(row):
            norm = normalize_spans(prompt, spans, where=f"spans[{i}][{j}]")
            if not norm:
                ids.append(None)
                continue
            cut = list(encode(prompt_without_spans(prompt, norm)))
            if not cut:
                if start is None:
                    raise ValueError(
                        f"spans[{i}][{j}]: the prompt without these spans renders to no token "
                        "(they cover the whole plain prompt), and neither the model's config "
                        "nor the tokenizer names a BOS or EOS token to stand for the empty "
                        "context; name a part of the prompt, or give the model a bos_token_id"
                    )
                cut = [int(start)]
            ids.append(cut)
        out.append(ids)
    return out


def _start_token(model, tokenizer=None) -> int | None:
    """The token an empty prompt is replayed after (METHOD.md section 2): the BOS token of the
    model's config, else the tokenizer's, else the EOS token (config, then tokenizer), which
    a model without BOS saw before each text; None when none is known."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for source, attr in (
        (config, "bos_token_id"),
        (tokenizer, "bos_token_id"),
        (config, "eos_token_id"),
        (tokenizer, "eos_token_id"),
    ):
        value = getattr(source, attr, None) if source is not None else None
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
            return int(value)
    return None


@dataclass
class _Core:
    distance: torch.Tensor  # (J, N) float32
    old_logprobs: torch.Tensor | None  # (N,) float32, None where not asked for
    logratio: torch.Tensor | None  # (J, N)
    hidden_p: torch.Tensor | None  # (N, d)
    replayed: int


def _replay_core(
    model,
    full_ids,
    stream_ids,
    responses,
    *,
    num_streams,
    pad_id,
    temperature,
    micro_batch,
    max_tokens=None,
    pointwise=False,
    keep_hidden=False,
    keep=None,
    reuse=True,
    logprobs=True,
    given_hidden=None,
    given_prefixes=None,
) -> _Core:
    """The replay: rows in prompt order, in chunks of at most ``micro_batch`` rows (and
    ``max_tokens`` padded tokens); per chunk, the with-information forward (one prompt
    forward per distinct prompt, its key/value cache shared by the responses after it), the
    forwards without each stream's spans, then the fused JS of the chunk's tokens. Only the
    chunk's hidden states are held.

    A replay forward holds one unit: the chunk's rows of one stream whose prompt without the
    spans is the same (a group's rows, for one reward), its prompt run once. ``keep`` (n, J)
    bools, optional: a (row, stream) that is False is not replayed and its distance is 0; a
    unit runs when one of its rows is kept, all of its rows, so that what a kept pair gets
    never depends on which others were left out (the same forward, bit for bit).

    Cheaper forwards and JS (``reuse``, the default): the with-information forward keeps each
    full prompt's key/value cache, and a unit starts from it at the longest common token
    prefix of its prompt without spans and the full prompt (at most all but one of its
    tokens), so it runs only the rest of that prompt and its responses; the JS runs per group
    of rows with the same kept streams, on the kept pairs only. A unit's forward and a
    kept pair's JS read only the with-information forward of the chunk and the unit's own
    rows, never which other pairs are kept. ``reuse=False``: whole prompts without spans and
    one JS over every row and stream with a kept pair (for side-by-side benchmarks).
    ``logprobs=False``: no log-prob op on the with-information hidden states (unless
    ``pointwise`` needs them), so their logits are computed once, by the JS; the old
    log-probs are then None. ``given_hidden`` (N, d): the with-information hidden states,
    from the caller's forward; each chunk then runs its distinct prompts alone (their
    caches, with ``reuse``) instead of the with-information forward. ``given_prefixes``:
    with ``given_hidden``, a dict of prompt caches from that same forward (as
    ``prompt_caches`` fills it; ``response_hidden(prefixes=)``): a prompt found there is not
    run again."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch: expected a positive int, got {micro_batch!r}")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens: expected a positive int or None, got {max_tokens!r}")
    weight, bias = _head(model)
    head_kw = _head_transform(model)  # logit scale / softcap: the model's own distribution
    device = weight.device
    js_head = None  # (weight, bias, hidden dtype) for the JS, made at its first use
    pad_id = 0 if pad_id is None else int(pad_id)
    n = len(responses)
    j_n = num_streams
    lengths = [len(r) for r in responses]
    starts = [0]
    for t in lengths:
        starts.append(starts[-1] + t)
    n_tok = starts[-1]
    dist = torch.zeros((j_n, n_tok), dtype=torch.float32, device=device)
    want_lp = logprobs or pointwise
    old = torch.zeros((n_tok,), dtype=torch.float32, device=device) if logprobs else None
    ratio = torch.zeros((j_n, n_tok), dtype=torch.float32, device=device) if pointwise else None
    hidden_p = weight.new_empty((n_tok, weight.shape[1])) if keep_hidden else None
    if given_hidden is not None and (
        not isinstance(given_hidden, torch.Tensor) or given_hidden.shape != (n_tok, weight.shape[1])
    ):
        got = getattr(given_hidden, "shape", None)
        got = tuple(got) if got is not None else type(given_hidden).__name__
        raise ValueError(
            f"hidden_p: expected a ({n_tok}, {weight.shape[1]}) tensor (one row per response "
            f"token, the LM head's width), got {got}"
        )
    groups: dict[tuple, list[int]] = {}
    for r in range(n):
        if lengths[r]:  # an empty response has no token: nothing to forward
            groups.setdefault(tuple(full_ids[r]), []).append(r)
    # rows in prompt order, chunks of at most micro_batch rows and (with max_tokens) at most
    # max_tokens padded prompt + response tokens; a row over the budget alone is its chunk
    chunks, cur, p_max, r_max = [], [], 0, 0
    for r in (r for rows in groups.values() for r in rows):
        p2, r2 = max(p_max, len(full_ids[r])), max(r_max, lengths[r])
        full = len(cur) >= micro_batch
        over = max_tokens is not None and (len(cur) + 1) * (p2 + r2) > max_tokens
        if cur and (full or over):
            chunks.append(cur)
            cur, p2, r2 = [], len(full_ids[r]), lengths[r]
        cur.append(r)
        p_max, r_max = p2, r2
    if cur:
        chunks.append(cur)
    replayed = 0
    for rows in chunks:
        per_fwd = len(rows)  # one forward per chunk (and per chunk of its replays)
        prefixes = {} if reuse and j_n else None  # the chunk's prompts' key/value caches
        idx = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]).to(device)
        if given_hidden is None:
            hp = _rows_hidden(
                model,
                [full_ids[r] for r in rows],
                [responses[r] for r in rows],
                pad_id,
                per_fwd,
                device,
                prefixes=prefixes,
            )
        else:  # the caller's forward: only the prompts run here, for their caches
            hp = given_hidden[idx.to(given_hidden.device)].to(device, weight.dtype)
            need = [full_ids[r] for r in rows]
            if prefixes is not None and given_prefixes:
                for p in need:
                    kv = given_prefixes.get(tuple(p))
                    if kv is not None:
                        prefixes[tuple(p)] = kv
                need = [p for p in need if tuple(p) not in prefixes]
            if prefixes is not None and need and not isinstance(model, CallableLM):
                prompt_caches(
                    model,
                    need,
                    pad_id,
                    micro_batch=per_fwd,
                    device=device,
                    prefixes=prefixes,
                )
        labels = torch.as_tensor([t for r in rows for t in responses[r]], dtype=torch.long)
        labels = labels.to(device)
        lp = None
        if want_lp:
            lp = linear_logprobs(hp, weight, labels, bias=bias, temperature=temperature, **head_kw)
        if old is not None:
            old[idx] = lp.float()
        if hidden_p is not None:
            hidden_p[idx] = hp
        if j_n == 0:
            continue
        units: dict[tuple, list] = {}  # (stream, prompt ids) -> its jobs (row in chunk, kept)
        for a, r in enumerate(rows):
            for j, ids in enumerate(stream_ids[r]):
                if ids is not None:
                    units.setdefault((j, tuple(ids)), []).append((a, keep is None or keep[r][j]))
        units = {u: js for u, js in units.items() if any(kp for _, kp in js)}
        if not units:  # nothing to replay in this chunk: distance 0, no JS
            continue
        # the JS runs per group of rows with the same kept streams, on those pairs only
        # (legacy: one group of every row and stream with a kept pair, the pairs not kept
        # inside it holding hidden_p itself, their distance then zeroed)
        kept_of: dict[int, list[int]] = {}
        for (j, _), js in units.items():
            for a, kp in js:
                if kp:
                    kept_of.setdefault(a, []).append(j)
        if reuse:
            by_set: dict[tuple, list[int]] = {}
            for a in sorted(kept_of):
                by_set.setdefault(tuple(sorted(set(kept_of[a]))), []).append(a)
        else:
            by_set = {tuple(sorted({j for js in kept_of.values() for j in js})): sorted(kept_of)}
        groups = [
            _JSGroup(streams, g_rows, rows, lengths, starts, hp, device)
            for streams, g_rows in by_set.items()
        ]
        where = {}  # (row in chunk, stream) -> (group, slot, token offset in the group)
        for grp in groups:
            for a, off in zip(grp.rows, grp.offsets):
                for s_, j in enumerate(grp.streams):
                    where[(a, j)] = (grp, s_, off)
        for (j, ids), js in units.items():
            unit_rows = [rows[a] for a, _ in js]
            pre = _shared_prefix(prefixes, full_ids[unit_rows[0]], ids) if reuse else None
            h = _rows_hidden(
                model,
                [list(ids)] * len(js),
                [responses[r] for r in unit_rows],
                pad_id,
                len(js),
                device,
                prefix=pre,
            )
            pos = 0
            for (a, kp), r in zip(js, unit_rows):
                t = lengths[r]
                if kp:
                    grp, s_, off = where[(a, j)]
                    grp.hq[s_, off : off + t] = h[pos : pos + t]
                    grp.cover[s_, off : off + t] = True
                pos += t
            replayed += len(js)
        for grp in groups:
            n_g = grp.n_tokens
            used_t = torch.tensor(grp.streams, dtype=torch.long, device=device)
            cover = grp.cover[:, :n_g].to(device)
            if js_head is None:  # no bf16 copy of the head where no JS runs (GDPO, all skipped)
                js_head = _js_head(weight, bias)
            js_w, js_b, js_dt = js_head
            d = linear_js_distance(
                grp.hp.to(js_dt),
                grp.hq.to(js_dt),
                js_w,
                bias=js_b,
                temperature=temperature,
                **head_kw,
            )
            # exactly 0 where nothing was replayed (not the JS of hidden_p against itself)
            dist[used_t[:, None], grp.sel[None, :]] = torch.where(cover, d[:, :n_g].float(), 0.0)
            if ratio is not None:
                lab_g, lp_g = labels[grp.local], lp[grp.local]
                for s_, j in enumerate(grp.streams):
                    lq = linear_logprobs(
                        grp.hq[s_], weight, lab_g, bias=bias, temperature=temperature, **head_kw
                    )[:n_g]
                    delta = (lq - lp_g[:n_g]).abs().float()
                    ratio[j, grp.sel] = torch.where(cover[s_], delta, 0.0)
    return _Core(dist, old, ratio, hidden_p, replayed)


def _js_head(weight: torch.Tensor, bias: torch.Tensor | None):
    """The LM head the JS runs on, its bias and the hidden states' dtype for it. Under
    autocast to bfloat16 on the head's device the model's own LM head runs on bf16 operands
    (and rounds its logits to bf16): the JS takes the same bf16 operands, and the kernel
    accumulates and writes the logits in fp32 (on a GPU torch.mm's out_dtype, on a CPU
    oneDNN's bf16 GEMM; bench/results/cpu-bf16-logits-2026-12-05.md). Otherwise the head as
    it is."""
    dev = weight.device.type
    if (
        weight.dtype == torch.float32
        and torch.is_autocast_enabled(dev)
        and torch.get_autocast_dtype(dev) == torch.bfloat16
    ):
        low = torch.bfloat16
        return weight.to(low), (None if bias is None else bias.to(low)), low
    return weight, bias, weight.dtype


class _JSGroup:
    """Rows of a chunk (indices into its ``rows``, ascending) whose JS runs together over
    ``streams``: their with-information hidden states ``hp`` (n, d), the replays' ``hq``
    (streams, n, d) (hidden_p until a replay fills them; ``cover`` says where one did),
    ``sel`` their positions in the batch's packed tokens, ``local`` in the chunk's. Padded
    to at least ``_MIN_JS_TOKENS`` token rows (copies of the last, dropped)."""

    def __init__(self, streams, g_rows, rows, lengths, starts, hp, device):
        self.streams, self.rows = list(streams), list(g_rows)
        chunk_at = [0]
        for r in rows:
            chunk_at.append(chunk_at[-1] + lengths[r])
        self.offsets, n = [], 0
        for a in g_rows:
            self.offsets.append(n)
            n += lengths[rows[a]]
        self.n_tokens = n
        local = torch.cat([torch.arange(chunk_at[a], chunk_at[a + 1]) for a in g_rows])
        sel = torch.cat([torch.arange(starts[rows[a]], starts[rows[a] + 1]) for a in g_rows])
        if n < _MIN_JS_TOKENS:
            local = torch.cat([local, local[-1:].repeat(_MIN_JS_TOKENS - n)])
        self.local, self.sel = local.to(device), sel.to(device)
        self.hp = hp[self.local]
        self.hq = self.hp.unsqueeze(0).repeat(len(self.streams), 1, 1)
        self.cover = torch.zeros((len(self.streams), len(local)), dtype=torch.bool)
