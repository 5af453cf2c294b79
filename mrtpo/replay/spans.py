"""Prompt spans as verifiers name them, and the prompt without them (the replay's input).

A verifier names the parts of the prompt it checks as character spans (METHOD.md section 2).
Two prompt forms are accepted, as trainers keep them:

- a plain prompt (``str``): spans are ``(start, end)`` character offsets of that string;
- a chat prompt (a list of ``{"role": ..., "content": str}`` messages): spans are
  ``(message_index, start, end)``, offsets inside that message's content (a negative index
  counts from the end, as in Python); a bare ``(start, end)`` means the last user message.

Spans may overlap (their union is removed), be empty (ignored) or cover a whole message
(its content becomes ""; the message itself stays, so the chat template renders the same
turns and roles). A span past the end of its text is an error naming the sample and the
reward. Offsets refer to the caller's prompt: a system message that a chat template inserts
by itself is not in ``messages`` and shifts nothing.

Removal is done on the text, and the prompt is then rendered and tokenized afresh, never by
deleting tokens: a tokenizer that merges characters across the cut (byte-level BPE merging a
space with the next word, or a word split by the span's edge) gives the tokens the shorter
prompt really has, not a sequence the model never sees.

How a reward names its spans (``score_and_spans``): a reward function may return, per
sample, a bare score (no spans), a ``(score, spans)`` pair, or any object with ``score`` and
``spans`` attributes (the project's ``mrtpo.verifiers.Verdict`` works as is). Spans may be
a list or tuple of spans, or an integer numpy array or tensor with one span per row
(``span_list``).

The control replay's span (METHOD.md 3b, ``control_span``): a stretch of the prompt that no
verifier checks, of about the length the rewards remove.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

from .prompting import Span, merge_spans, remove_spans

__all__ = [
    "control_span",
    "is_chat_prompt",
    "normalize_spans",
    "prompt_without_spans",
    "score_and_spans",
    "span_list",
]


def is_chat_prompt(prompt) -> bool:
    """True for a list of role/content messages, False for a plain string; else an error."""
    if isinstance(prompt, str):
        return False
    if isinstance(prompt, Sequence) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
    ):
        return True
    raise ValueError(
        f"prompts: expected a string or a list of {{'role', 'content'}} messages, got "
        f"{type(prompt).__name__}"
    )


def _last_user(messages) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    raise ValueError(
        "spans: a (start, end) span on a chat prompt means its last user message, but the "
        "prompt has no user message; give (message_index, start, end)"
    )


def normalize_spans(prompt, spans, *, where: str = "spans") -> dict[int | None, list]:
    """Check ``spans`` against ``prompt`` and return ``{message: merged [(start, end)]}``.

    The key is None for a plain prompt, the (non-negative) message index for a chat prompt.
    Empty spans are dropped; an empty result means the reward names nothing. ``where`` names
    the sample and reward in errors.
    """
    chat = is_chat_prompt(prompt)
    if spans is None:
        return {}
    if isinstance(spans, (str, bytes)) or not (isinstance(spans, Sequence) or _is_array(spans)):
        raise ValueError(f"{where}: expected a list of spans, got {type(spans).__name__}")
    spans = span_list(spans, where=where)
    by_msg: dict[int | None, list] = {}
    for span in spans:
        if isinstance(span, (str, bytes)) or not isinstance(span, Sequence):
            raise ValueError(f"{where}: expected spans as tuples, got {span!r}")
        try:
            if any(isinstance(x, bool) for x in span):
                raise TypeError
            span = tuple(operator.index(x) for x in span)
        except TypeError:
            raise ValueError(f"{where}: span {tuple(span)!r} has a non-integer entry") from None
        if chat:
            if len(span) == 2:
                m, (s, e) = _last_user(prompt), span
            elif len(span) == 3:
                m, s, e = span
                if not -len(prompt) <= m < len(prompt):
                    raise ValueError(
                        f"{where}: span {tuple(span)} names message {m}, but the prompt has "
                        f"{len(prompt)} messages"
                    )
                m %= len(prompt)
            else:
                raise ValueError(
                    f"{where}: expected (message_index, start, end) or (start, end) on a chat "
                    f"prompt, got {tuple(span)!r}"
                )
            text = prompt[m]["content"]
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: message {m}'s content is {type(text).__name__}, not a string "
                    "(multimodal content parts have no character spans)"
                )
        else:
            if len(span) != 2:
                raise ValueError(
                    f"{where}: expected (start, end) on a plain prompt, got {tuple(span)!r}"
                )
            m, (s, e), text = None, span, prompt
        if not 0 <= s <= e:
            raise ValueError(f"{where}: expected 0 <= start <= end, got {tuple(span)!r}")
        if e > len(text):
            what = "the prompt" if m is None else f"message {m}'s content"
            raise ValueError(f"{where}: span {tuple(span)!r} ends past {what} (length {len(text)})")
        by_msg.setdefault(m, []).append((s, e))
    merged = {m: merge_spans(v) for m, v in by_msg.items()}
    return {m: v for m, v in merged.items() if v}


def prompt_without_spans(prompt, normalized: Mapping):
    """``prompt`` (string or messages) without the spans of ``normalize_spans``; messages
    are copied (the caller's are never modified), their other keys kept."""
    if not normalized:
        return prompt
    if None in normalized:
        return remove_spans(prompt, normalized[None])
    out = [dict(m) for m in prompt]
    for m, spans in normalized.items():
        out[m]["content"] = remove_spans(out[m]["content"], spans)
    return out


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


def score_and_spans(value, *, where: str = "reward"):
    """``(score, spans or None)`` of one reward-function output: a bare score (spans None),
    a ``(score, spans)`` pair, or an object with ``score`` and ``spans`` (a ``Verdict``).

    The score is a real number or None (a missing reward); spans are None (no spans, as [])
    or a list or tuple of spans (each checked where the replay reads it). Anything else is a
    ValueError that names ``where`` (the reward function and the sample)."""
    if hasattr(value, "score") and hasattr(value, "spans"):
        score, spans = value.score, value.spans
    elif isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(
                f"{where}: a tuple output must be (score, spans), got {len(value)} entries"
            )
        score, spans = value
    else:
        score, spans = value, None
    if score is not None and not _is_real_score(score):
        raise ValueError(
            f"{where}: expected a score (a real number or None), a (score, spans) pair or an "
            f"object with score and spans, got a score of type {type(score).__name__}"
        )
    return score, span_list(spans, where=where)


def span_list(spans, *, where: str = "spans"):
    """None, or ``spans`` as a list: a list or tuple of spans, or an integer numpy array or
    tensor of shape (n, 2) or (n, 3) (one span per row; (0,) and (0, 2) are no spans), whose
    rows may also be such 1-D arrays; array rows become tuples of ints. Anything else (a
    string, a float array, a bare number) is a ValueError naming ``where``."""
    if spans is None:
        return None
    if _is_array(spans):
        if _array_size(spans) == 0:
            return []
        if len(spans.shape) != 2 or spans.shape[1] not in (2, 3) or not _int_array(spans):
            raise ValueError(
                f"{where}: spans given as an array must be integers of shape (n, 2) or (n, 3), "
                f"got {type(spans).__name__} of shape {tuple(spans.shape)} and dtype "
                f"{spans.dtype}"
            )
        return [tuple(int(x) for x in row) for row in spans.tolist()]
    if not isinstance(spans, (list, tuple)):
        raise ValueError(
            f"{where}: spans must be a list of (start, end) or (message, start, end) spans, "
            f"or None for none; got {type(spans).__name__} {spans!r:.60}"
        )
    out = []
    for span in spans:
        if _is_array(span):
            if len(span.shape) != 1 or not _int_array(span):
                raise ValueError(
                    f"{where}: a span given as an array must be 1-D integers, got shape "
                    f"{tuple(span.shape)} and dtype {span.dtype}"
                )
            span = tuple(int(x) for x in span.tolist())
        out.append(span)
    return out


def _is_array(x) -> bool:
    """A numpy array or a torch tensor (imported only if the caller's value could be one)."""
    mod = type(x).__module__
    if mod.startswith("numpy"):
        import numpy as np

        return isinstance(x, np.ndarray)
    if mod.startswith("torch"):
        import torch

        return isinstance(x, torch.Tensor)
    return False


def _array_size(x) -> int:
    return int(x.numel()) if hasattr(x, "numel") else int(x.size)


def _int_array(x) -> bool:
    dtype = x.dtype
    if hasattr(dtype, "is_floating_point"):  # torch
        import torch

        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    import numpy as np

    return bool(np.issubdtype(dtype, np.integer))


def _is_real_score(x) -> bool:
    import numbers

    if isinstance(x, numbers.Real):
        return True
    mod = type(x).__module__
    if mod.startswith("numpy"):  # np.bool_, or a 0-d array of a real dtype
        import numpy as np

        if isinstance(x, np.bool_):
            return True
        return (
            isinstance(x, np.ndarray)
            and x.ndim == 0
            and (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_)
            and not np.issubdtype(x.dtype, np.complexfloating)
        )
    import torch

    return isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_complex
