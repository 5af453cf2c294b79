"""Tool-calling verifiers: the response must be one JSON function call.

A call is a JSON object ``{"name": str, "arguments": {...}}`` (``"arguments"`` may also be
a JSON string holding the object, as some chat APIs send it), either the whole response or
inside its first fenced code block. Input longer than `MAX_CALL_CHARS` or nested deeper
than `MAX_DEPTH` is rejected before it is parsed (score 0 with the reason; no recursion).

Rewards (`tool_verifiers()`), reading these `Example.fields`:

- ``tools``: ``{name: JSON schema of its arguments}`` for the tools shown in the prompt;
- ``signature_spans``: ``{name: [start, end]}``, each tool's signature line in the prompt;
- ``gold``: the gold call ``{"name": ..., "arguments": {...}}``;
- ``request_span``: ``[start, end]``, the user's request in the prompt.

- ``tool_format``: 1 when the response parses as a call; no spans.
- ``tool_name``: 1 when the called name is the gold call's; spans: the gold tool's
  signature.
- ``tool_schema``: 1 when the arguments validate against the called tool's schema; spans:
  the called tool's signature (the gold tool's if it called one not in the prompt).
- ``tool_args``: 1 when the arguments equal the gold call's (numbers compared by value);
  spans: the gold tool's signature and the request.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from typing import Any

import jsonschema

from .base import Example, Span, Verdict, json_nesting_depth

logger = logging.getLogger(__name__)

MAX_CALL_CHARS = 64 * 1024
MAX_DEPTH = 32

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.S)


class CallParseError(ValueError):
    """The response is not one well-formed function call."""


def _loads_bounded(text: str) -> Any:
    if len(text) > MAX_CALL_CHARS:
        raise CallParseError(f"call is {len(text)} characters, more than {MAX_CALL_CHARS}")
    if json_nesting_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise CallParseError(f"call is nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CallParseError(f"not valid JSON: {e}") from None


def parse_call(response: str) -> tuple[str, dict]:
    """Parse a response into ``(name, arguments)`` or raise `CallParseError` saying why."""
    if not isinstance(response, str):
        raise CallParseError(f"response is {type(response).__name__}, not str")
    if len(response) > 4 * MAX_CALL_CHARS:
        raise CallParseError(f"response is {len(response)} characters, too long for a call")
    m = _FENCE.search(response)
    text = (m.group(1) if m else response).strip()
    if not text:
        raise CallParseError("empty response")
    obj = _loads_bounded(text)
    if not isinstance(obj, dict):
        raise CallParseError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallParseError('missing "name" (a non-empty string)')
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        args = _loads_bounded(args)
    if not isinstance(args, dict):
        raise CallParseError('missing "arguments" (a JSON object)')
    return name, args


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate_arguments(schema: dict, arguments: dict) -> str | None:
    """None if ``arguments`` is valid against the JSON ``schema``, else the first error."""
    v = _validator(json.dumps(schema, sort_keys=True))
    err = next(iter(v.iter_errors(arguments)), None)
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path) or "arguments"
    return f"{where}: {err.message[:200]}"


def _same(a: Any, b: Any) -> bool:
    """JSON equality with numbers compared by value (1 == 1.0) but booleans kept apart."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


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

    def _spans(self, example, called):
        return ()

    def _score(self, example, name, args):
        return 1.0, None


class CallName(_ToolVerifier):
    """Score 1 when the called function is the gold one."""

    name = "tool_name"

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
    """Score 1 when the call's arguments equal the gold call's."""

    name = "tool_args"

    def _spans(self, example, called):
        f = example.fields
        return tuple(
            sorted(_span(f, "signature_spans", f["gold"]["name"]) + _span(f, "request_span"))
        )

    def _score(self, example, name, args):
        gold = example.fields["gold"]["arguments"]
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
