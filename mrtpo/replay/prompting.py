"""Prompts as the trainer sees them: chat templating with character offsets, span removal
for contrastive replay, and the mapping between character spans and tokens.

A verifier names prompt spans in coordinates of the raw prompt content; ``ChatPrompter``
renders that content through the tokenizer's chat template and tokenizes it with offsets, so
that the prompt without some spans gets exactly the same template around it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Span = tuple[int, int]


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Sorted, non-overlapping union of [start, end) spans (empty spans dropped)."""
    out: list[list[int]] = []
    for s, e in sorted((int(s), int(e)) for s, e in spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def check_spans(text: str, spans: Iterable[Span], *, name: str = "spans") -> list[Span]:
    """``spans`` as (start, end) integer pairs with 0 <= start <= end <= len(text), else a
    ValueError naming the argument ``name`` and the span. Python's slicing would take a
    negative offset from the end and ``int`` would truncate 1.5: the text "without" such a
    span could come out longer than the text."""
    out = []
    for span in spans:
        try:
            s, e = span
            if isinstance(s, bool) or isinstance(e, bool):
                raise TypeError
            s, e = operator.index(s), operator.index(e)
        except (TypeError, ValueError):
            raise ValueError(
                f"{name}: expected (start, end) pairs of integer character offsets, got {span!r}"
            ) from None
        if not 0 <= s <= e:
            raise ValueError(f"{name}: expected 0 <= start <= end, got the span ({s}, {e})")
        if e > len(text):
            raise ValueError(f"{name}: span ({s}, {e}) ends past the text (length {len(text)})")
        out.append((s, e))
    return out


def remove_spans(text: str, spans: Iterable[Span], *, name: str = "spans") -> str:
    """``text`` without the characters in ``spans`` (the prompt without a verifier's info).
    Each span is checked (`check_spans`): a ValueError naming ``name`` for a negative,
    fractional, reversed or too long one."""
    pieces, pos = [], 0
    for s, e in merge_spans(check_spans(text, spans, name=name)):
        pieces.append(text[pos:s])
        pos = e
    pieces.append(text[pos:])
    return "".join(pieces)


def spans_to_token_mask(offsets: Sequence[Span], spans: Iterable[Span]) -> torch.Tensor:
    """Bool mask over tokens: True where a token's character range [a, b) overlaps a span.

    ``offsets`` are the tokens' character offsets (as from ``return_offsets_mapping``) in the
    same coordinates as ``spans``. Zero-width tokens (special tokens) are never marked.
    """
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    merged = merge_spans(spans)
    if not merged:
        return mask
    for t, (a, b) in enumerate(offsets):
        if b <= a:
            continue
        for s, e in merged:
            if a < e and s < b:
                mask[t] = True
                break
    return mask


@dataclass(frozen=True)
class EncodedPrompt:
    """A chat-templated prompt: its token ids, each token's character offsets in ``text``
    (the rendered template), and where the user content starts in ``text``."""

    ids: list[int]
    offsets: list[Span]
    text: str
    content_start: int

    def token_mask(self, spans: Iterable[Span]) -> torch.Tensor:
        """Tokens overlapping ``spans`` given in coordinates of the raw prompt content."""
        shifted = [(s + self.content_start, e + self.content_start) for s, e in spans]
        return spans_to_token_mask(self.offsets, shifted)


class ChatPrompter:
    """Renders prompts through the tokenizer's chat template (one user turn plus the
    generation prompt) and tokenizes them with character offsets.

    The template is rendered once around a marker to learn its prefix and suffix, so that
    the prompt with some spans removed gets exactly the same template around it.
    """

    _MARK = "\u2063MRTPO\u2063"

    def __init__(self, tokenizer, *, system: str | None = None):
        self.tokenizer = tokenizer
        self.system = system
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "tokenizer: it has no chat template; set tokenizer.chat_template (a Jinja "
                "string) before training"
            )
        rendered = self._render(self._MARK)
        if rendered.count(self._MARK) != 1:
            raise ValueError("tokenizer: its chat template does not render the content once")
        self.prefix, self.suffix = rendered.split(self._MARK)

    def _render(self, content: str) -> str:
        messages = [{"role": "user", "content": content}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def render(self, prompt: str) -> str:
        return self.prefix + prompt + self.suffix

    def encode(self, prompt: str, remove: Iterable[Span] = ()) -> EncodedPrompt:
        """Template and tokenize ``prompt`` (minus the character spans ``remove``: integer
        offsets in ``prompt``, 0 <= start <= end <= len(prompt), else a ValueError naming
        ``remove``)."""
        content = remove_spans(prompt, remove, name="remove")
        text = self.render(content)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
        return EncodedPrompt(list(enc["input_ids"]), offsets, text, len(self.prefix))


def response_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[Span]]:
    """Decode generated token ids to text and each token's character range in that text.

    The offsets come from decoding growing prefixes, so they are exact for any tokenizer
    whose decoding of a prefix is a prefix of the full decoding (true for byte-level BPE on
    whole characters). Special tokens decode to nothing and get zero-width ranges.
    """
    text = ""
    offsets: list[Span] = []
    prev = 0
    for t in range(len(ids)):
        text = tokenizer.decode(list(ids[: t + 1]), skip_special_tokens=True)
        cur = len(text)
        offsets.append((min(prev, cur), cur))
        prev = max(prev, cur)
    return text, offsets
