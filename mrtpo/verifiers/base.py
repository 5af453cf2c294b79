"""What a verifier is: a callable from (example, response) to a Verdict.

A task is a list of verifiers, one reward each. A verdict carries the score, the character
spans of the prompt that the verifier checked (empty when it reads no specific part, e.g.
overall correctness) and, for a score of 0, the reason. Contrastive replay removes a
reward's spans from the prompt to measure which response tokens depend on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Span = tuple[int, int]  # [start, end) character offsets into Example.prompt

# A closing fence: three backticks followed by nothing but spaces up to the end of the line.
# Inside a JSON (or SQL) string, ``` is followed by more of the string, so it never closes.
_FENCE_CLOSE = re.compile(r"```[ \t]*(?:\r?\n|\Z)")
_ONE_LINE_LANG = re.compile(r'([A-Za-z][\w.+#-]*)(?=[\s{\["])')


@dataclass(frozen=True)
class Fence:
    """A fenced code block found by `find_fence`.

    ``lang`` is the info string after the opening backticks, stripped (``""`` if none);
    ``body`` the text between the fences; ``start``/``end`` the offsets of the opening
    backticks and just past the closing ones (``len(text)`` when ``closed`` is False).
    """

    lang: str
    body: str
    start: int
    end: int
    closed: bool


def find_fence(text: str) -> Fence | None:
    """The first fenced code block of ``text``, or None when it has no ```.

    The block opens at the first ```. If that line ends with ``` after some content, the
    block is that one line. Otherwise the block closes at the first ``` after the opening
    line that is followed only by spaces up to a line end (or the end of the text), so a
    ``` inside a string of the body does not close it. A leading word on the opening line
    followed by a space, a bracket or the line end is the block's language (````json````,
    ````json {"a": 1}````); the rest of that line belongs to the body. Unclosed blocks run
    to the end of the text. Linear time whatever the input.
    """
    start = text.find("```")
    if start < 0:
        return None
    nl = text.find("\n", start + 3)
    line_end = len(text) if nl < 0 else nl
    line = text[start + 3 : line_end].rstrip()
    if len(line) >= 3 and line.endswith("```"):  # a one-line block
        inner = line[:-3]
        m = _ONE_LINE_LANG.match(inner.lstrip(" \t"))
        lang = m.group(1) if m else ""
        body = inner.lstrip(" \t")[m.end() :] if m else inner
        return Fence(lang, body, start, start + 3 + len(line), True)
    # The info string is a language word; anything else on the opening line (``` {"a": 1})
    # already belongs to the body.
    indent = len(line) - len(line.lstrip(" \t"))
    m = _ONE_LINE_LANG.match(line[indent:] + " ")
    lang = m.group(1) if m else ""
    body_start = start + 3 + (indent + m.end() if m else 0)
    if not text[body_start:line_end].strip():  # nothing else on the opening line
        body_start = min(line_end + 1, len(text))
    m = _FENCE_CLOSE.search(text, line_end)
    if m is None:
        return Fence(lang, text[body_start:], start, len(text), False)
    return Fence(lang, text[body_start : m.start()], start, m.start() + 3, True)


def json_nesting_depth(text: str, limit: int) -> int:
    """Deepest bracket nesting of a JSON text, ignoring brackets inside strings. Iterative,
    and it stops as soon as the depth exceeds ``limit`` (so a hostile input costs O(n))."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


@dataclass(frozen=True)
class Example:
    """One prompt of a task: its text and the fields its verifiers read."""

    id: str
    prompt: str
    fields: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None  # a gold response, used by the supervised warm start


@dataclass(frozen=True)
class Verdict:
    score: float
    spans: tuple[Span, ...] = ()
    reason: str | None = None

    def __post_init__(self):
        for s, e in self.spans:
            if not (0 <= s <= e):
                raise ValueError(f"spans: expected 0 <= start <= end, got ({s}, {e})")


@runtime_checkable
class Verifier(Protocol):
    name: str

    def __call__(self, example: Example, response: str) -> Verdict: ...


# What a verifier's optional ``fields_needed`` ({key: kind}) may say of an Example field.
FIELD_KINDS = {
    "text": ("a string", lambda v: isinstance(v, str)),
    "mapping": ("a dict (a JSON object)", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, (list, tuple))),
    "records": (
        "a list of dicts (JSON objects)",
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, dict) for x in v),
    ),
    "span": (
        "a span [start, end] of two ints",
        lambda v: (
            isinstance(v, (list, tuple))
            and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        ),
    ),
}


def check_fields(verifier, fields, *, where: str = "fields") -> None:
    """Raise a ValueError (naming ``where``, the key and the verifier) when ``fields`` lacks
    a key that ``verifier.fields_needed`` declares, or holds it in another form. A verifier
    that reads a missing field judges nothing real: the slot constraint verifiers pay 1 to
    any response (nothing was asked), the others 0 to the gold answer. A verifier without
    ``fields_needed`` is not checked."""
    needed = getattr(verifier, "fields_needed", None) or {}
    name = getattr(verifier, "name", type(verifier).__name__)
    if needed and not isinstance(fields, dict):
        raise ValueError(f"{where}: expected a dict, got {type(fields).__name__}")
    for key, kind in needed.items():
        what, ok = FIELD_KINDS[kind]
        if key not in fields or fields[key] is None:
            raise ValueError(f"{where}: no {key!r}, which verifier {name!r} reads")
        if not ok(fields[key]):
            raise ValueError(
                f"{where}: {key!r} is {type(fields[key]).__name__} {fields[key]!r:.60}, "
                f"expected {what} (verifier {name!r})"
            )


@dataclass
class Task:
    """A named list of verifiers and the examples they judge."""

    name: str
    verifiers: list[Verifier]
    train: list[Example]
    eval: list[Example]

    @property
    def reward_names(self) -> list[str]:
        return [v.name for v in self.verifiers]

    def score(self, example: Example, response: str) -> list[Verdict]:
        return [v(example, response) for v in self.verifiers]
