"""The tool-calling rewards' parser (mrtpo/verifiers/tools.py): a response as one JSON
function call (`parse_call`).

A call is a JSON object ``{"name": str, "arguments": {...}}`` (``"arguments"`` may also be
a JSON string holding the object, as some chat APIs send it), either the whole response or
inside its first fenced code block (`base.find_fence`: a ``` inside a JSON string does not
close the block). Input longer than `MAX_CALL_CHARS` or nested deeper than `MAX_DEPTH` is
rejected before it is parsed (no recursion).

The call must be JSON and exactly one call: ``NaN``/``Infinity`` (which Python's parser
accepts and JSON does not), an object with a key twice (a parser keeps either one), both
``"arguments"`` and ``"parameters"``, a key besides those, ``"name"``, ``"id"`` and
``"type"`` (both strings), a number beyond double range, however it is spelled
(``1e400``, ``-1E+400``, ``1`` and 400 zeros, ``1`` and 400 zeros ``.0``), and text outside the
fenced block that holds a brace or another fence (a second call) all raise `CallParseError`
with the reason.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .base import find_fence, json_nesting_depth

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
