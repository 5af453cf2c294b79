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

Arguments are validated with ``jsonschema`` when it is installed (imported on first use,
so importing this module never needs it) and otherwise with `validate_subset`, a small
validator of the JSON Schema keywords the built-in tool definitions use (type, enum,
properties, required, additionalProperties, items, minimum/maximum and their exclusive
forms, minLength/maxLength, pattern); a schema with any other keyword is refused there.
Both read ``pattern`` as JSON Schema (ECMA-262) does, not as Python does: ``$`` is the end
of the string only (Python's also matches before a final newline, so ``"EUR\\n"`` would
match ``^[A-Z]{3}$``) and ``\\d`` is an ASCII digit (`json_schema_regex`).

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
"""

from __future__ import annotations

import json
import logging
import math
import re
from functools import lru_cache
from typing import Any

from .base import Example, Span, Verdict, find_fence, json_nesting_depth

logger = logging.getLogger(__name__)

MAX_CALL_CHARS = 64 * 1024
MAX_DEPTH = 32


class CallParseError(ValueError):
    """The response is not one well-formed function call."""


def _no_constant(name: str) -> Any:
    raise CallParseError(f"not valid JSON: {name} is not a JSON number")


def _out_of_range(text: str) -> CallParseError:
    return CallParseError(f"number {text[:40]} is out of range (beyond a double's)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: JSON syntax, but no number a consumer can hold
        raise _out_of_range(text)
    return value


# Digits of the largest finite double (1.797...e308); JSON integers have no leading zeros.
_MAX_INT_DIGITS = 309


def _finite_int(text: str) -> int:
    """A JSON integer, refused (as `_finite_float` refuses ``1e400``) when its value rounds
    past the largest double: ``1`` and 400 zeros is the same number as ``1e400``, so it gets
    the same verdict. Checked on the digit count first, so that a 5000-digit literal is
    refused for its range and not for Python's int-to-string limit."""
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _out_of_range(text)
    value = int(text)
    try:
        float(value)  # rounds to nearest, as float(text) does for 1.8e308
    except OverflowError:
        raise _out_of_range(text) from None
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise CallParseError(f"not valid JSON for a call: the key {dup[:80]!r} appears twice")
    return obj


def _loads_bounded(text: str) -> Any:
    """Strict JSON: no NaN/Infinity, no key twice in one object, bounded size and depth."""
    if len(text) > MAX_CALL_CHARS:
        raise CallParseError(f"call is {len(text)} characters, more than {MAX_CALL_CHARS}")
    if json_nesting_depth(text, MAX_DEPTH) > MAX_DEPTH:
        raise CallParseError(f"call is nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_finite_int,
            object_pairs_hook=_unique_keys,
        )
    except CallParseError:
        raise
    except (ValueError, RecursionError) as e:
        raise CallParseError(f"not valid JSON: {e}") from None


# The keys a call may have: its name, its arguments (or "parameters"), and the "id" and
# "type" that chat APIs add.
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})


def parse_call(response: str) -> tuple[str, dict]:
    """Parse a response into ``(name, arguments)`` or raise `CallParseError` saying why."""
    if not isinstance(response, str):
        raise CallParseError(f"response is {type(response).__name__}, not str")
    if len(response) > 4 * MAX_CALL_CHARS:
        raise CallParseError(f"response is {len(response)} characters, too long for a call")
    fence = find_fence(response)
    if fence is not None:
        outside = response[: fence.start] + response[fence.end :]
        if "{" in outside or "```" in outside:
            raise CallParseError("more than one call: text outside the fenced call holds another")
    text = (fence.body if fence is not None else response).strip()
    if not text:
        raise CallParseError("empty response")
    obj = _loads_bounded(text)
    if not isinstance(obj, dict):
        raise CallParseError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallParseError('missing "name" (a non-empty string)')
    if "arguments" in obj and "parameters" in obj:
        raise CallParseError('both "arguments" and "parameters": which one is the call?')
    extra = sorted(set(obj) - _CALL_KEYS)
    if extra:  # anything else may hold another call
        raise CallParseError(f"unexpected keys {', '.join(map(repr, extra))[:120]} in the call")
    for key in ("id", "type"):
        if key in obj and not isinstance(obj[key], str):
            raise CallParseError(f'"{key}" must be a string, got {type(obj[key]).__name__}')
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        args = _loads_bounded(args)
    if not isinstance(args, dict):
        raise CallParseError('missing "arguments" (a JSON object)')
    return name, args


# The JSON Schema keywords `validate_subset` understands; annotations are ignored.
SUBSET_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
    }
)
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$schema", "$id"})
_TYPES = {
    "object": lambda x: isinstance(x, dict),
    "array": lambda x: isinstance(x, list),
    "string": lambda x: isinstance(x, str),
    "boolean": lambda x: isinstance(x, bool),
    "null": lambda x: x is None,
    "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    # As in JSON Schema draft 4 and later: 7.0 is an integer.
    "integer": lambda x: (
        (isinstance(x, int) and not isinstance(x, bool))
        or (isinstance(x, float) and math.isfinite(x) and x.is_integer())
    ),
}


def json_schema_regex(pattern: str) -> re.Pattern:
    """A JSON Schema ``pattern`` compiled for Python's ``re.search`` with ECMA-262's meaning
    of the two constructs where they differ for plain patterns: ``$`` outside a character
    class becomes ``\\Z`` (the end of the string only; Python's ``$`` also matches before a
    final newline) and ``\\d`` / ``\\D`` become ``[0-9]`` / ``[^0-9]`` (Python's ``\\d``
    also matches other scripts' digits). Raises ``re.error`` for a bad pattern."""
    return _json_schema_regex(pattern)


@lru_cache(maxsize=256)
def _json_schema_regex(pattern: str) -> re.Pattern:
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            if ch == "]":
                in_class = False
        elif ch == "[":
            in_class = True
            out.append(ch)
            i += 1
            # A ] (after an optional ^) right after [ is a literal in Python's classes.
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("\\]")
                i += 1
            continue
        elif ch == "$":
            ch = "\\Z"
        out.append(ch)
        i += 1
    return re.compile("".join(out))


def _check_subset_schema(schema: Any, where: str = "schema") -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: expected an object, got {type(schema).__name__}")
    unknown = set(schema) - SUBSET_KEYWORDS - _ANNOTATIONS
    if unknown:
        raise ValueError(f"{where}: keywords {sorted(unknown)} are outside the supported subset")
    types = schema.get("type")
    for t in [types] if isinstance(types, str) else types or []:
        if t not in _TYPES:
            raise ValueError(f"{where}: unknown type {t!r}")
    for name, sub in (schema.get("properties") or {}).items():
        _check_subset_schema(sub, f"{where}/properties/{name}")
    for key in ("additionalProperties", "items"):
        if key in schema:
            _check_subset_schema(schema[key], f"{where}/{key}")
    if "pattern" in schema:
        json_schema_regex(schema["pattern"])


def _subset_error(schema: Any, x: Any, path: tuple) -> tuple[tuple, str] | None:
    """The first (path, message) where ``x`` breaks ``schema``, else None."""
    if schema is True:
        return None
    if schema is False:
        return path, "not allowed here"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES[t](x) for t in names):
            return path, f"{json.dumps(x)[:60]} is not of type {' or '.join(names)}"
    if "enum" in schema and not any(_same(x, v) for v in schema["enum"]):
        return path, f"{json.dumps(x)[:60]} is not one of {schema['enum']}"
    if _TYPES["number"](x):
        for key, bad in (
            ("minimum", lambda v, b: v < b),
            ("maximum", lambda v, b: v > b),
            ("exclusiveMinimum", lambda v, b: v <= b),
            ("exclusiveMaximum", lambda v, b: v >= b),
        ):
            if key in schema and bad(x, schema[key]):
                return path, f"{x} breaks {key} {schema[key]}"
    if isinstance(x, str):
        if "minLength" in schema and len(x) < schema["minLength"]:
            return path, f"shorter than {schema['minLength']} characters"
        if "maxLength" in schema and len(x) > schema["maxLength"]:
            return path, f"longer than {schema['maxLength']} characters"
        if "pattern" in schema and json_schema_regex(schema["pattern"]).search(x) is None:
            return path, f"does not match {schema['pattern']!r}"
    if isinstance(x, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name in x:
                err = _subset_error(sub, x[name], (*path, name))
                if err is not None:
                    return err
        missing = [k for k in schema.get("required", ()) if k not in x]
        if missing:
            return path, f"{missing[0]!r} is a required property"
        extra_schema = schema.get("additionalProperties", True)
        for name in x:
            if name not in props:
                if extra_schema is False:
                    return path, f"additional property {name!r} is not allowed"
                err = _subset_error(extra_schema, x[name], (*path, name))
                if err is not None:
                    return err
    if isinstance(x, list) and "items" in schema:
        for i, item in enumerate(x):
            err = _subset_error(schema["items"], item, (*path, i))
            if err is not None:
                return err
    return None


def validate_subset(schema: dict, arguments: Any) -> str | None:
    """Validate ``arguments`` against ``schema`` using only `SUBSET_KEYWORDS` (no
    ``jsonschema`` needed). Same verdicts as ``jsonschema`` on that subset; messages differ.
    Raises ValueError naming the keyword when ``schema`` uses anything else."""
    _check_subset_schema(schema)
    err = _subset_error(schema, arguments, ())
    if err is None:
        return None
    path, message = err
    where = "/".join(str(p) for p in path) or "arguments"
    return f"{where}: {message[:200]}"


@lru_cache(maxsize=256)
def _validator(schema_json: str):
    """A ``jsonschema`` validator for the schema, or None when jsonschema is not installed."""
    try:
        import jsonschema
    except ImportError:
        return None
    schema = json.loads(schema_json)
    base = jsonschema.validators.validator_for(schema)
    base.check_schema(schema)

    def pattern(validator, patrn, instance, schema):  # JSON Schema's regex, not Python's
        if validator.is_type(instance, "string") and not json_schema_regex(patrn).search(instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    cls = jsonschema.validators.extend(base, {"pattern": pattern})
    return cls(schema)


def validate_arguments(schema: dict, arguments: dict) -> str | None:
    """None if ``arguments`` is valid against the JSON ``schema``, else the first error."""
    v = _validator(json.dumps(schema, sort_keys=True))
    if v is None:
        return validate_subset(schema, arguments)
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
