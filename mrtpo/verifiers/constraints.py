"""Multi-constraint instruction following: IFEval-style constraint types and their verifiers.

An example's ``fields["constraints"]`` is a list of ``{"kind", "params", "span"}``: the
constraint type, its parameters and the ``[start, end)`` span of its sentence in the
prompt. A `ConstraintVerifier` judges one of them (chosen by kind or by position) and
returns that sentence as its span: one reward per constraint.

Each verifier also has ``relevant_chars(example, response)``: the spans of the RESPONSE
that its constraint concerns, used to measure credit precision. The constraint types
(`CONSTRAINTS`, `KINDS`; what each checks and what its ``relevant_chars`` returns, in a
table) are mrtpo/verifiers/constraint_kinds.py's and importable from here.

An empty or whitespace-only response satisfies no constraint, and responses longer than
`MAX_RESPONSE_CHARS` score 0. `ConstraintVerifier` sets aside each copy of one of the
prompt's sentences (`visible.drop_copies`): an answer that only repeats the prompt satisfies
nothing, and the example markup of a copied constraint sentence counts for nothing.
docs/verifiers.md lists every rule and its intended differences from the IFEval checkers.
"""

from __future__ import annotations

import logging
from typing import Any

from .base import Example, Span, Verdict
from .constraint_kinds import (  # the types, importable from here as before the split
    CONSTRAINTS,
    KINDS,
    MAX_JSON_DEPTH,
    BulletCount,
    Constraint,
    EndPhrase,
    JsonFormat,
    KeywordExclude,
    KeywordInclude,
    LetterFrequency,
    Lowercase,
    NoCommas,
    ParagraphCount,
    Placeholders,
    Quotation,
    Sections,
    StartPhrase,
    Title,
    Uppercase,
    WordCount,
)
from .visible import prompt_pieces

__all__ = [
    "CONSTRAINTS",
    "KINDS",
    "MAX_JSON_DEPTH",
    "MAX_RESPONSE_CHARS",
    "BulletCount",
    "Constraint",
    "ConstraintVerifier",
    "EndPhrase",
    "JsonFormat",
    "KeywordExclude",
    "KeywordInclude",
    "LetterFrequency",
    "Lowercase",
    "NoCommas",
    "ParagraphCount",
    "Placeholders",
    "Quotation",
    "Sections",
    "StartPhrase",
    "Title",
    "Uppercase",
    "WordCount",
    "check",
    "describe",
]

logger = logging.getLogger(__name__)

MAX_RESPONSE_CHARS = 100_000


class ConstraintVerifier:
    """The reward of one constraint of an example (``fields_needed``: the fields it reads,
    checked by `base.check_fields` where examples come from outside, e.g. TRL's rows).

    Args:
        kind: judge the example's constraint of this kind (the fixed-K tasks).
        slot: judge the example's ``slot``-th constraint, whatever its kind (tasks whose
            examples mix kinds). An example with no constraint there scores 1 with no spans:
            nothing was asked, so nothing can fail.
        name: the reward's name; defaults to ``kind`` or ``constraint_{slot + 1}``.
    """

    fields_needed = {"constraints": "records"}

    def __init__(
        self, kind: str | None = None, *, slot: int | None = None, name: str | None = None
    ):
        if (kind is None) == (slot is None):
            raise ValueError("ConstraintVerifier: give exactly one of kind and slot")
        if kind is not None and kind not in CONSTRAINTS:
            raise ValueError(f"kind: unknown constraint type {kind!r}; known: {', '.join(KINDS)}")
        if slot is not None and (not isinstance(slot, int) or slot < 0):
            raise ValueError(f"slot: expected an int >= 0, got {slot!r}")
        self.kind = kind
        self.slot = slot
        self.name = name or (kind if kind is not None else f"constraint_{slot + 1}")

    def _entry(self, example: Example) -> dict | None:
        entries = example.fields.get("constraints") or []
        if self.slot is not None:
            return entries[self.slot] if self.slot < len(entries) else None
        for c in entries:
            if c.get("kind") == self.kind:
                return c
        return None

    def __call__(self, example: Example, response: str) -> Verdict:
        try:
            entry = self._entry(example)
        except Exception as e:
            return Verdict(0.0, (), f"bad example fields: {type(e).__name__}: {e}")
        if entry is None:
            if self.slot is not None:
                return Verdict(1.0)
            return Verdict(0.0, (), f"the example has no {self.kind} constraint")
        try:
            s, e = entry["span"]
            spans = ((int(s), int(e)),)
        except Exception:
            spans = ()
        try:
            if not isinstance(response, str):
                return Verdict(0.0, spans, f"response is {type(response).__name__}, not str")
            if len(response) > MAX_RESPONSE_CHARS:
                return Verdict(0.0, spans, f"response longer than {MAX_RESPONSE_CHARS} chars")
            prompt = _prompt_sentences(example)
            reason = CONSTRAINTS[entry["kind"]].check(response, entry.get("params") or {}, prompt)
        except Exception as e:  # never raise into the trainer
            logger.warning("%s: verifier error on %s: %r", self.name, example.id, e)
            return Verdict(0.0, spans, f"verifier error: {type(e).__name__}: {e}")
        if reason is None:
            return Verdict(1.0, spans)
        return Verdict(0.0, spans, f"{entry['kind']}: {reason}")

    def relevant_chars(self, example: Example, response: str) -> list[Span]:
        """The spans of ``response`` this constraint concerns (see constraint_kinds.py's table)."""
        try:
            entry = self._entry(example)
            if entry is None or not isinstance(response, str):
                return []
            if len(response) > MAX_RESPONSE_CHARS:
                return []
            return CONSTRAINTS[entry["kind"]].relevant(response, entry.get("params") or {})
        except Exception:
            return []


def _prompt_sentences(example: Example) -> tuple[str, ...]:
    """The prompt's sentences (each constraint's and the instruction around them), whose
    copies in a response count for nothing."""
    spans = []
    for c in example.fields.get("constraints") or []:
        try:
            s, e = c["span"]
            spans.append((int(s), int(e)))
        except Exception:
            continue
    return prompt_pieces(example.prompt if isinstance(example.prompt, str) else "", spans)


def describe(kind: str, params: dict[str, Any]) -> str:
    """The prompt sentence of a constraint."""
    return CONSTRAINTS[kind].sentence(params)


def check(
    kind: str, response: str, params: dict[str, Any], prompt: tuple[str, ...] = ()
) -> str | None:
    """None if ``response`` satisfies the constraint, else the reason; copies of the
    sentences ``prompt`` in the response count for nothing (see `Constraint.check`)."""
    return CONSTRAINTS[kind].check(response, params, prompt)
