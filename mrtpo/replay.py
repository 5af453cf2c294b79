"""Contrastive replay (METHOD.md section 2): how much each response token depends on the
prompt spans a verifier checks. One engine serves every caller: ``replay_relevance`` (any
trainer: plain or chat prompts, padded responses, (K, B, T) out; the TRL, verl and OpenRLHF
adapters call it) and ``contrastive_replay`` (``mrtpo train``'s packed rows) both run
``_replay_core``.

For response i and reward k whose verdict names prompt spans, the prompt x^{-k} is the
prompt with those spans removed from its text (``mrtpo.spans``), rendered through the same
chat template and tokenized afresh. The response tokens y_i are teacher-forced after x (once,
shared by all K and by the old log-probs) and after every x^{-k}, in batched forwards without
gradient; a prompt's forward runs once and its key/value cache serves every response that
follows it, and a prompt without spans starts from the full prompt's cache at their longest
common token prefix (only the rest of it is run). The last hidden states at the response
positions and the LM head go to ``linear_js_distance`` one-vs-many: hidden_p (n, d) against
hidden_q (K', n, d), per group of rows with the same kept rewards, chunk by chunk of rows.
Rewards without spans need no replay: their distance is 0 and has_info is False.

Replay only what can move (``replay_mask``): a reward whose GDPO advantage A_k is exactly 0
for a response moves none of its tokens (METHOD.md section 5), so its replay can be skipped
without changing one bit of the token advantages (``replay_mask_from_rewards`` says which
pairs can move). A skipped pair gets no forward and no JS (its relevance is 0); a row whose
every pair is skipped gets only the with-information forward (the old log-probs).

The teacher-forced batches and the prefix-shared forwards are mrtpo/teacher_forcing.py's.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mrtpo_kernels import ADVANTAGE_DEFAULTS, gdpo_advantages, linear_js_distance, linear_logprobs

from .model import lm_head, logit_transform
from .prompting import ChatPrompter, Span, merge_spans
from .spans import is_chat_prompt, normalize_spans, prompt_without_spans
from .teacher_forcing import (
    forward_after_prefix,
    forward_shared_prompts,
    prompt_caches,
    teacher_batch,
)


@dataclass
class ReplayResult:
    hidden_p: torch.Tensor  # (N, d) with-information hidden states
    # (N,) log-probs of the response tokens at the temperature; None where not asked for
    # (``contrastive_replay(old_logprobs=False)``)
    old_logprobs: torch.Tensor | None
    relevance: torch.Tensor | None  # (K, N) JS distances, or None when replay was skipped
    replayed: int  # number of (response, reward) replays run, control replays included
    control: torch.Tensor | None = None  # (N,) d_ctrl (0 where no control span), if asked
    # (K, N) |log p(y_t | prompt) - log p(y_t | prompt without reward k's spans)| of the
    # sampled tokens, if asked (0 where reward k has no spans)
    logratio: torch.Tensor | None = None
    pairs: int = 0  # (response, reward) pairs replayed (control replays not counted)
    skipped: int = 0  # pairs with spans left out by replay_mask (relevance 0 there)


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


def replay_mask_from_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    has_info=None,
    weights: torch.Tensor | None = None,
    eps: float = ADVANTAGE_DEFAULTS.eps,
    nan: str = ADVANTAGE_DEFAULTS.nan,
    whole_rows: bool = False,
    scale_rewards: str = ADVANTAGE_DEFAULTS.scale_rewards,
) -> torch.Tensor:
    """(n, K) bool on the CPU: the (response, reward) pairs whose replay can move a token
    advantage, the ``replay_mask`` of ``replay_relevance`` and ``contrastive_replay``.

    A pair can move only where lambda_k A_k[i] is not exactly 0, A_k the GDPO per-reward
    advantage (``gdpo_advantages(rewards, group_ids, weights=, eps=, nan=, scale_rewards=)``:
    a group of one, a reward with zero variance in its group and a response at its group's
    mean give exactly 0) and, with ``has_info`` (n, K), where the reward names spans. Where it is 0,
    ``mrtpo_token_advantages`` multiplies the pair's (finite) allocation weight by 0 and
    gives a token GDPO's value wherever every reward that moves has weight 1, whatever the
    weights of those that do not; the divisor D (batch std and cancellation floor) reads
    only the A_k. So whatever relevance such a pair has (0 when skipped) and whatever its
    has_info, the token advantages are the same bit for bit. Give the ``rewards``,
    ``group_ids``, ``weights``, ``eps``, ``nan`` and ``scale_rewards`` the advantages are
    computed with (the whole batch's: with several processes, every process's rewards).

    ``whole_rows``: a row replays every pair with spans as soon as one of its pairs can move
    (needs ``has_info``). For a relevance that mixes a response's rewards (``specific``: r_k
    subtracts the other rewards' d), whose pairs cannot be skipped one by one.
    """
    g = gdpo_advantages(
        rewards, group_ids, weights=weights, eps=eps, nan=nan, scale_rewards=scale_rewards
    )
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
    replay_mask=None,
    old_logprobs: bool = True,
    hidden_p: torch.Tensor | None = None,
) -> ReplayResult:
    """Old log-probs and, with ``replay``, the (K, N) relevance of every reward's spans:
    ``replay_relevance``'s engine on packed rows, for ``mrtpo train`` (prompts rendered by
    ``prompter``, the prompt without spans by ``ChatPrompter.encode(prompt, remove=spans)``).

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
        replay_mask: optional (n, K) bool (``replay_mask_from_rewards``): a pair that is
            False is not replayed and its relevance is 0; a response none of whose pairs
            is replayed gets no control replay either.
        old_logprobs: False where the caller takes the old log-probs elsewhere (``mrtpo
            train`` on-policy: the update's own): the with-information hidden states then
            go to the JS alone, no log-prob op computes their logits a second time, and the
            result's ``old_logprobs`` is None.
        hidden_p: optional (N, d) with-information hidden states of the response tokens
            (packed in the order of ``responses``) from a forward the caller ran anyway
            (``mrtpo train`` on-policy: its update's, detached): the replay then runs no
            with-information forward of its own, only each distinct prompt (for the
            key/value caches its replays start from).
    """
    n = len(responses)
    if not (len(prompt_texts) == len(prompt_ids) == len(spans) == n):
        raise ValueError("prompt_texts, prompt_ids, spans: expected one entry per response")
    k = len(spans[0]) if n else 0
    streams = [list(row) for row in spans] if replay else [[] for _ in range(n)]
    keep = None
    if replay and replay_mask is not None:
        keep = _bool_matrix(replay_mask, "replay_mask", n, k).tolist()
    named = [[bool(s) for s in row] for row in streams]
    kept = named if keep is None else [[a and b for a, b in zip(x, y)] for x, y in zip(named, keep)]
    pairs = sum(map(sum, kept))
    skipped = sum(map(sum, named)) - pairs
    if replay and control is not None:
        if len(control) != n:
            raise ValueError(f"control: expected one entry per response ({n}), got {len(control)}")
        streams = [row + [c] for row, c in zip(streams, control)]
        if keep is not None:  # the control replay of a row that replays some reward
            keep = [row + [any(row)] for row in keep]
    cache: dict = {}

    def encode(text):
        if text not in cache:
            cache[text] = prompter.encode(text).ids
        return cache[text]

    core = _replay_core(
        model,
        [list(p) for p in prompt_ids],
        _stream_ids(list(prompt_texts), streams, encode, _start_token(model, prompter.tokenizer)),
        [list(r) for r in responses],
        num_streams=len(streams[0]) if n else 0,
        pad_id=prompter.tokenizer.pad_token_id,
        temperature=temperature,
        micro_batch=micro_batch,
        pointwise=pointwise and replay,
        keep_hidden=True,
        keep=keep,
        logprobs=old_logprobs,
        given_hidden=hidden_p,
    )
    if not replay or k == 0:
        return ReplayResult(core.hidden_p, core.old_logprobs, None, 0)
    ctrl = core.distance[k] if control is not None else None
    ratio = None if core.logratio is None else core.logratio[:k]
    return ReplayResult(
        core.hidden_p,
        core.old_logprobs,
        core.distance[:k],
        core.replayed,
        ctrl,
        ratio,
        pairs,
        skipped,
    )


# --------------------------------------------------------------------------- the engine


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
            f"model: expected a Hugging Face causal LM or a mrtpo.replay.CallableLM, got "
            f"{type(model).__name__}"
        )
    return lm_head(model)


def _head_transform(model) -> dict:
    """The head's logit transform as the fused ops' keywords (mrtpo.model.logit_transform
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
    caches, with ``reuse``) instead of the with-information forward."""
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
            if prefixes is not None and not isinstance(model, CallableLM):
                prompt_caches(
                    model,
                    [full_ids[r] for r in rows],
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


# --------------------------------------------------------------------------- neutral API


@dataclass
class Replay:
    """What ``replay_relevance`` returns; every (.., B, T) tensor is in the layout of the
    responses given (0 at padding)."""

    relevance: torch.Tensor  # (K, B, T) float32 JS distances, 0 where has_info is False
    has_info: torch.Tensor  # (B, K) bool: reward k names a span of sample i's prompt
    response_mask: torch.Tensor  # (B, T) bool: the response tokens
    old_logprobs: torch.Tensor  # (B, T) float32 log-probs of the response tokens
    replayed: int  # prompt-without-spans replays run (one per response and reward)
    seconds: float  # wall time of the replay
    # (B, K) bool: the pairs replayed (has_info and replay_mask); relevance diagnostics
    # belong to these. has_info & ~replayed_pairs: skipped by replay_mask, relevance 0.
    replayed_pairs: torch.Tensor | None = None
    skipped: int = 0  # pairs with spans that replay_mask left out


def _prompt_encoder(tokenizer, *, chat_template, add_special_tokens, chat_template_kwargs):
    kwargs = dict(chat_template_kwargs or {})

    def encode(prompt):
        if isinstance(prompt, str) and not chat_template:
            return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return list(out)

    return encode


def _rows_of(values, mask, name: str) -> list[list[int]]:
    """Token lists of a (B, T) tensor under a 0/1 mask, or of a list of sequences."""
    if isinstance(values, torch.Tensor):
        check_int = values.dtype.is_floating_point or values.dtype == torch.bool
        if values.dim() != 2 or check_int:
            raise ValueError(
                f"{name}: expected a (B, T) integer tensor, got {values.dtype} "
                f"{tuple(values.shape)}"
            )
        if mask is None:
            return [row.tolist() for row in values]
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(values.shape):
            raise ValueError(f"{name} mask: expected a tensor of shape {tuple(values.shape)}")
        keep = mask.to(values.device).bool()
        return [row[m].tolist() for row, m in zip(values, keep)]
    if mask is not None:
        raise ValueError(f"{name} mask: given for a list of sequences; give a (B, T) tensor")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a (B, T) tensor or a list of token-id sequences")
    return [list(r.tolist() if hasattr(r, "tolist") else r) for r in values]


@torch.no_grad()
def replay_relevance(
    model,
    prompts: Sequence,
    responses,
    spans: Sequence,
    *,
    temperature: float,
    tokenizer=None,
    encode: Callable | None = None,
    response_mask: torch.Tensor | None = None,
    prompt_ids=None,
    prompt_mask: torch.Tensor | None = None,
    chat_template: bool = False,
    add_special_tokens: bool = True,
    chat_template_kwargs: dict | None = None,
    num_rewards: int | None = None,
    micro_batch: int = 16,
    max_tokens: int | None = None,
    pad_token_id: int | None = None,
    replay_mask=None,
) -> Replay:
    """Contrastive replay for any trainer: per response token, how much each reward's prompt
    spans move the policy (METHOD.md section 2), the (K, B, T) relevance and (B, K) has_info.

    Args:
        model: a Hugging Face causal LM (any wrapper unwrapped), or a ``CallableLM``. Run as
            it is (eval mode is the caller's: dropout would add noise to the distances).
        prompts: (B,) plain strings, or chat prompts (lists of role/content messages).
        responses: (B, T) token ids with ``response_mask`` (any padding: left, right, or
            holes; a row of zeros is an empty response, e.g. a masked truncation), or a list
            of B token-id sequences (empty allowed; the result is right-padded to the
            longest). Truncated responses need nothing special.
        spans: (B, K) ``spans[i][k]``: the spans reward k's verifier names in prompt i
            (``mrtpo.spans``: (start, end) on a plain prompt, (message, start, end) on a
            chat prompt; None or [] for none: that reward is spread uniformly, as in GDPO).
            Spans covering a whole plain prompt leave no token: that replay runs after the
            one-token context of the model's BOS token (else its EOS), the response after
            no prompt at all (a ValueError naming the sample and reward if neither exists).
        temperature: the sampling temperature.
        tokenizer: renders and tokenizes prompts: a chat prompt with its chat template
            (``add_generation_prompt=True``, ``chat_template_kwargs``); a plain prompt as it
            is (``add_special_tokens``, default True like ``tokenizer(text)``), or as one
            user message through the template with ``chat_template=True``.
        encode: instead of ``tokenizer``, ``encode(prompt) -> token ids`` for a prompt of the
            same form (plain or messages): the trainer's own prompt pipeline.
        prompt_ids: optional, the token ids the responses were sampled after ((B, P) tensor
            with ``prompt_mask``, or a list): each must equal the rendering of its prompt,
            else a ValueError says which row differs (the replay must render prompts as
            generation did, or the distances would measure the rendering).
        num_rewards: K, needed when B = 0.
        micro_batch, max_tokens: a chunk holds at most ``micro_batch`` responses and, when
            ``max_tokens`` is given, at most ``max_tokens`` padded prompt + response tokens
            (rows x (longest prompt + longest response); a single longer row is a chunk of
            its own). Each chunk is one forward with its prompts, then forwards of its
            replays (as many rows at most). Memory: one such forward (activations without gradient,
            one key/value cache per distinct prompt) plus (K + 1) hidden states of d per
            response token of the chunk, in the model's dtype; the JS op runs in fp32 over
            chunks of tokens and keeps no (tokens, V) logits.
        replay_mask: optional (B, K) bool, a tensor or nested lists
            (``replay_mask_from_rewards``: the pairs whose GDPO advantage is not 0). A pair
            that is False is not replayed: no forward, no JS, relevance 0 (has_info still
            says whether it names spans; the token advantages are the same bit for bit as
            long as the mask leaves out only pairs with lambda_k A_k = 0). A row with no
            pair left gets only the with-information forward (its old log-probs).

    Returns:
        ``Replay``: relevance (K, B, T) float32 in [0, 1] (0 at padding and wherever
        has_info is False or the pair was skipped), has_info (B, K), the response mask, the
        old log-probs (B, T) of the response tokens (the with-information forward gives them
        at no extra cost), the number of replays, the seconds taken, the (B, K) pairs
        replayed and the number skipped.
    """
    t0 = time.perf_counter()
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
    if (tokenizer is None) == (encode is None):
        raise ValueError("tokenizer, encode: give exactly one (how prompts become token ids)")
    if encode is None:
        encode = _prompt_encoder(
            tokenizer,
            chat_template=chat_template,
            add_special_tokens=add_special_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts: expected a list (one prompt per response)")
    rows = _rows_of(responses, response_mask, "responses")
    b = len(rows)
    if len(prompts) != b:
        raise ValueError(f"prompts: expected {b} (one per response), got {len(prompts)}")
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence) or len(spans) != b:
        raise ValueError(f"spans: expected a list of {b} per-sample lists (one per response)")
    if num_rewards is not None and (
        isinstance(num_rewards, bool) or not isinstance(num_rewards, int) or num_rewards < 0
    ):
        raise ValueError(f"num_rewards: expected an int >= 0 (K), got {num_rewards!r}")
    k = num_rewards if num_rewards is not None else (len(spans[0]) if b else None)
    if k is None:
        raise ValueError("num_rewards: needed when there are no responses (K is unknown)")
    for i, row in enumerate(spans):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != k:
            raise ValueError(f"spans: sample {i} needs one entry per reward (K = {k})")
    memo: dict = {}

    def encode_memo(prompt):
        key = prompt if isinstance(prompt, str) else repr(prompt)
        if key not in memo:
            memo[key] = [int(t) for t in encode(prompt)]
        return memo[key]

    for p in prompts:
        is_chat_prompt(p)  # a clear error for anything else
    full = [encode_memo(p) for p in prompts]
    for i, f in enumerate(full):
        if not f and rows[i]:
            raise ValueError(
                f"prompts: sample {i} renders to no token (an empty plain prompt): "
                "the responses need a prompt token to follow"
            )
    if prompt_ids is not None:
        given = _rows_of(prompt_ids, prompt_mask, "prompt_ids")
        if len(given) != b:
            raise ValueError(f"prompt_ids: expected {b} rows, got {len(given)}")
        for i, (g, f) in enumerate(zip(given, full)):
            if g != f:
                at = next((t for t, (x, y) in enumerate(zip(g, f)) if x != y), min(len(g), len(f)))
                raise ValueError(
                    f"prompt_ids: row {i} ({len(g)} tokens) differs from its prompt rendered "
                    f"and tokenized here ({len(f)} tokens) from token {at}; render prompts "
                    "as generation did (encode=, chat_template_kwargs, add_special_tokens), "
                    "and do not truncate prompts that spans refer to"
                )
    weight, _ = _head(model)
    vocab = int(weight.shape[0])
    for i, r in enumerate(rows):
        for t in r:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
                raise ValueError(
                    f"responses: sample {i} has token id {t!r}, outside the "
                    f"model's vocabulary [0, {vocab})"
                )
        rows[i] = [int(t) for t in r]
    keep = None if replay_mask is None else _bool_matrix(replay_mask, "replay_mask", b, k)
    stream_ids = _stream_ids(
        list(prompts), [list(r) for r in spans], encode_memo, _start_token(model, tokenizer)
    )
    has_info = torch.tensor(
        [[s is not None for s in row] for row in stream_ids], dtype=torch.bool
    ).reshape(b, k)
    replayed_pairs = has_info if keep is None else has_info & keep
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    core = _replay_core(
        model,
        full,
        stream_ids,
        rows,
        num_streams=k,
        pad_id=pad_token_id,
        temperature=float(temperature),
        micro_batch=micro_batch,
        max_tokens=max_tokens,
        keep=None if keep is None else keep.tolist(),
    )
    device = weight.device
    if isinstance(responses, torch.Tensor):
        mask = (
            torch.ones_like(responses, dtype=torch.bool)
            if response_mask is None
            else response_mask.bool()
        ).to(device)
    else:
        width = max((len(r) for r in rows), default=0)
        mask = torch.zeros((b, width), dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            mask[i, : len(r)] = True
    relevance = torch.zeros((k,) + tuple(mask.shape), dtype=torch.float32, device=device)
    relevance[:, mask] = core.distance
    relevance *= replayed_pairs.t().to(device=device, dtype=relevance.dtype)[:, :, None]
    old = torch.zeros(tuple(mask.shape), dtype=torch.float32, device=device)
    old[mask] = core.old_logprobs
    return Replay(
        relevance,
        has_info.to(device),
        mask,
        old,
        core.replayed,
        time.perf_counter() - t0,
        replayed_pairs.to(device),
        int(has_info.sum()) - int(replayed_pairs.sum()),
    )
