"""Tool-calling verifiers: the response must be one JSON function call.

A call is a JSON object ``{"name": str, "arguments": {...}}`` (``"arguments"`` may also be
a JSON string holding the object, as some chat APIs send it), either the whole response or
inside its first fenced code block (`base.find_fence`: a ``` inside a JSON string does not
close the block). Input longer than `MAX_CALL_CHARS` or nested deeper than `MAX_DEPTH` is
rejected before it is parsed (score 0 with the reason; no recursion).

The call must be JSON and exactly one call: ``NaN``/``Infinity`` (which Python's parser
accepts and JSON does not), an object with a key twice (a parser keeps either one), both
``"arguments"`` and ``"parameters"``, a key besides those, ``"name"``, ``"id"`` and
``"type"`` (both strings), a number beyond double range, however it is spelled
(``1e400``, ``-1E+400``, ``1`` and 400 zeros, ``1`` and 400 zeros ``.0``), and text outside the
fenced block that holds a brace or another fence (a second call) all fail the format, and
so every reward.

How arguments are validated against a tool's schema (``jsonschema`` where installed, else
a small validator of the keywords the built-in tools use): mrtpo/verifiers/tool_schema.py.

Rewards (`tool_verifiers()`), reading these `Example.fields`:

- ``tools``: ``{name: JSON schema of its arguments}`` for the tools shown in the prompt;
- ``signature_spans``: ``{name: [start, end]}``, each tool's signature line in the prompt;
- ``gold``: the gold call ``{"name": ..., "arguments": {...}}``, or, where more than one
  call is right, ``{"name": ..., "arguments_any": {arg: [value, ...]}, "optional": [arg,
  ...]}``: each argument may take any of its listed values, and those in ``"optional"``
  may also be left out (the ``tools-bfcl`` task's cases list their acceptable answers so);
- ``request_span``: ``[start, end]``, the user's request in the prompt.

- ``tool_format``: 1 when the response parses as a call; no spans.
- ``tool_name``: 1 when the called name is the gold call's; spans: the gold tool's
  signature.
- ``tool_schema``: 1 when the arguments validate against the called tool's schema; spans:
  the called tool's signature (the gold tool's if it called one not in the prompt).
- ``tool_args``: 1 when the call names the gold tool and its arguments equal the gold
  call's (numbers compared by value; with ``arguments_any``: every argument one of its
  listed values, none besides those listed, none left out unless optional); spans: the
  gold tool's signature and the request.

The call's parser is mrtpo/verifiers/tool_call.py's and the argument checks
mrtpo/verifiers/tool_schema.py's; their public names are importable from here.
"""

from __future__ import annotations

import logging

from .base import Example, Span, Verdict
from .tool_call import MAX_CALL_CHARS, MAX_DEPTH, CallParseError, parse_call
from .tool_schema import (
    SUBSET_KEYWORDS,
    _same,
    json_schema_regex,
    validate_arguments,
    validate_subset,
)

__all__ = [
    "MAX_CALL_CHARS",
    "MAX_DEPTH",
    "SUBSET_KEYWORDS",
    "ArgumentsMatch",
    "ArgumentsValid",
    "CallFormat",
    "CallName",
    "CallParseError",
    "json_schema_regex",
    "parse_call",
    "tool_verifiers",
    "validate_arguments",
    "validate_subset",
]

logger = logging.getLogger(__name__)


def _span(fields: dict, key: str, name: str | None = None) -> list[Span]:
    table = fields.get(key)
    if name is not None:
        table = (table or {}).get(name)
    if not table:
        return []
    s, e = table
    return [(int(s), int(e))]


class _ToolVerifier:
    name = "tool"

    def _spans(self, example: Example, called: str | None) -> tuple[Span, ...]:
        raise NotImplementedError

    def _score(self, example: Example, name: str, args: dict) -> tuple[float, str | None]:
        raise NotImplementedError

    def __call__(self, example: Example, response: str) -> Verdict:
        called = None
        try:
            try:
                called, args = parse_call(response)
            except CallParseError as e:
                return Verdict(0.0, self._spans(example, None), f"format: {e}")
            spans = self._spans(example, called)
            score, reason = self._score(example, called, args)
            return Verdict(score, spans, reason if score == 0.0 else None)
        except Exception as e:  # never raise into the trainer
            logger.warning("%s: verifier error on %s: %r", self.name, example.id, e)
            try:
                spans = self._spans(example, called)
            except Exception:
                spans = ()
            return Verdict(0.0, spans, f"verifier error: {type(e).__name__}: {e}")


class CallFormat(_ToolVerifier):
    """Score 1 when the response parses as a function call."""

    name = "tool_format"
    fields_needed: dict = {}

    def _spans(self, example, called):
        return ()

    def _score(self, example, name, args):
        return 1.0, None


class CallName(_ToolVerifier):
    """Score 1 when the called function is the gold one."""

    name = "tool_name"
    fields_needed = {"gold": "mapping", "signature_spans": "mapping"}

    def _spans(self, example, called):
        return tuple(_span(example.fields, "signature_spans", example.fields["gold"]["name"]))

    def _score(self, example, name, args):
        gold = example.fields["gold"]["name"]
        if name == gold:
            return 1.0, None
        return 0.0, f"called {name[:80]!r}, expected {gold!r}"


class ArgumentsValid(_ToolVerifier):
    """Score 1 when the arguments validate against the called tool's JSON schema."""

    name = "tool_schema"
    fields_needed = {"tools": "mapping", "gold": "mapping", "signature_spans": "mapping"}

    def _spans(self, example, called):
        sig = example.fields.get("signature_spans") or {}
        name = called if called in sig else example.fields["gold"]["name"]
        return tuple(_span(example.fields, "signature_spans", name))

    def _score(self, example, name, args):
        tools = example.fields.get("tools") or {}
        if name not in tools:
            return 0.0, f"no tool named {name[:80]!r} in the prompt"
        err = validate_arguments(tools[name], args)
        if err is None:
            return 1.0, None
        return 0.0, f"invalid arguments for {name}: {err}"


class ArgumentsMatch(_ToolVerifier):
    """Score 1 when the call's arguments equal the gold call's (or, with ``arguments_any``,
    are each one of the listed values, the optional ones possibly left out)."""

    name = "tool_args"
    fields_needed = {"gold": "mapping", "signature_spans": "mapping", "request_span": "span"}

    def _spans(self, example, called):
        f = example.fields
        return tuple(
            sorted(_span(f, "signature_spans", f["gold"]["name"]) + _span(f, "request_span"))
        )

    def _score(self, example, name, args):
        if name != example.fields["gold"]["name"]:
            # The same arguments to another tool do another thing: nothing to pay for.
            return 0.0, f"called {name[:80]!r}, not {example.fields['gold']['name']!r}"
        gold = example.fields["gold"]
        if "arguments_any" in gold:
            allowed = gold["arguments_any"]
            missing = sorted(set(allowed) - set(args) - set(gold.get("optional", ())))
            extra = sorted(set(args) - set(allowed))
            wrong = sorted(
                k
                for k in set(allowed) & set(args)
                if not any(_same(args[k], v) for v in allowed[k])
            )
            if not (missing or extra or wrong):
                return 1.0, None
        else:
            gold = gold["arguments"]
            if _same(args, gold):
                return 1.0, None
            missing = sorted(set(gold) - set(args))
            extra = sorted(set(args) - set(gold))
            wrong = sorted(k for k in set(gold) & set(args) if not _same(args[k], gold[k]))
        parts = [
            f"{label} {', '.join(map(str, ks))[:120]}"
            for label, ks in (("missing", missing), ("unexpected", extra), ("wrong", wrong))
            if ks
        ]
        return 0.0, "arguments differ from the gold call: " + "; ".join(parts)


def tool_verifiers() -> list[_ToolVerifier]:
    """The four tool-calling rewards, in order: format, name, schema, arguments."""
    return [CallFormat(), CallName(), ArgumentsValid(), ArgumentsMatch()]
