"""What a verifier is: a callable from (example, response) to a Verdict.

A task is a list of verifiers, one reward each. A verdict carries the score, the character
spans of the prompt that the verifier checked (empty when it reads no specific part, e.g.
overall correctness) and, for a score of 0, the reason. Contrastive replay removes a
reward's spans from the prompt to measure which response tokens depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Span = tuple[int, int]  # [start, end) character offsets into Example.prompt


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
