"""The tool-calling rewards' argument checks (mrtpo/verifiers/tools.py): arguments against a
tool's JSON schema (`validate_arguments`) and JSON values compared (`_same`).

Arguments are validated with ``jsonschema`` when it is installed (imported on first use,
so importing this module never needs it) and otherwise with `validate_subset`, a small
validator of the JSON Schema keywords the built-in tool definitions use (type, enum,
properties, required, additionalProperties, items, minimum/maximum and their exclusive
forms, minLength/maxLength, pattern); a schema with any other keyword is refused there.
Both read ``pattern`` as JSON Schema (ECMA-262) does, not as Python does: ``$`` is the end
of the string only (Python's also matches before a final newline, so ``"EUR\\n"`` would
match ``^[A-Z]{3}$``) and ``\\d`` is an ASCII digit (`json_schema_regex`).
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

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
