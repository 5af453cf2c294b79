"""Contrastive replay (METHOD.md section 2): how much each response token depends on the
prompt spans a verifier checks. One engine serves every caller: ``replay_relevance`` (any
trainer: plain or chat prompts, padded responses, (K, B, T) out; the TRL, verl and OpenRLHF
adapters call it) and ``contrastive_replay`` (``mrtpo train``'s packed rows) both run
``_replay_core`` (mrtpo/replay/engine.py).

For response i and reward k whose verdict names prompt spans, the prompt x^{-k} is the
prompt with those spans removed from its text (``mrtpo.replay.spans``), rendered through the same
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
without changing one bit of the token advantages (``replay_mask_from_rewards``, from
mrtpo/replay/mask.py, says which pairs can move). A skipped pair gets no forward and no JS
(its relevance is 0); a row whose every pair is skipped gets only the with-information
forward (the old log-probs).

This module holds the two entry points; ``CallableLM``, ``replay_mask_from_rewards`` and
``control_span`` (mrtpo/replay/spans.py) are importable from here too. The engine is
mrtpo/replay/engine.py; the teacher-forced batches and the prefix-shared forwards are
mrtpo/replay/teacher_forcing.py's.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .engine import CallableLM, _head, _replay_core, _start_token, _stream_ids
from .mask import _bool_matrix, replay_mask_from_rewards
from .prompting import ChatPrompter, Span
from .spans import control_span, is_chat_prompt

__all__ = [
    "CallableLM",
    "Replay",
    "ReplayResult",
    "contrastive_replay",
    "control_span",
    "replay_mask_from_rewards",
    "replay_relevance",
]


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
    prompt_caches: dict | None = None,
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
        prompt_caches: optional, with ``hidden_p``: the key/value caches of the prompts
            from that same forward (``response_hidden(prompts=, prefixes=)``, keyed by the
            prompt's token ids): a prompt found there is not run again (``mrtpo train``
            on-policy: the replay then runs no forward of the full prompts at all).
    """
    n = len(responses)
    if not (len(prompt_texts) == len(prompt_ids) == len(spans) == n):
        raise ValueError("prompt_texts, prompt_ids, spans: expected one entry per response")
    if prompt_caches is not None and (not isinstance(prompt_caches, dict) or hidden_p is None):
        raise ValueError(
            "prompt_caches: expected a dict of prompt key/value caches from the forward that "
            f"gave hidden_p, got {type(prompt_caches).__name__}"
            + (" without hidden_p" if hidden_p is None else "")
        )
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
        given_prefixes=prompt_caches,
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
            (``mrtpo.replay.spans``: (start, end) on a plain prompt, (message, start, end) on a
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
