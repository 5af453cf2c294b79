"""The ``tools-bfcl`` task: the Berkeley Function Calling Leaderboard's simple Python cases
scored by the four tool rewards. The schema conversion, the answer expansion, the
``arguments_any`` gold form and the missing-package error run everywhere; the tests on the
real cases need the ``bfcl-eval`` package (the [real] extra)."""

from __future__ import annotations

import json

from mrtpo.data import tool_defs
from mrtpo.verifiers import Example
from mrtpo.verifiers.tools import ArgumentsMatch


def _call(name, args):
    return json.dumps({"name": name, "arguments": args})


# --------------------------------------------------------------------------------------------
# The gold form with acceptable values, and the signature line


def test_signature_line_renders_arrays_objects_and_any():
    schema = {
        "type": "object",
        "properties": {
            "xs": {"type": "array", "items": {"type": "number"}},
            "where": {"type": "object", "properties": {"k": {"type": "string"}}},
            "blob": {"type": "object"},
            "data": {},
            "op": {"type": "string", "enum": ["<", ">"]},
        },
        "required": ["xs", "op"],
    }
    assert tool_defs.signature_line("g", "about g", schema) == (
        'g(xs: array[number], where?: {k?: string}, blob?: object, data?: any, op: "<" | ">")'
        " - about g"
    )
    # the built-in tools' lines are unchanged by the shared renderer
    assert tool_defs.signature("get_weather") == (
        'get_weather(city: string, unit: "celsius" | "fahrenheit") - current weather in a city'
    )
    assert tool_defs.signature("play_music").startswith("play_music(artist: string, volume?: ")


def _example(gold, tools):
    return Example(
        id="t",
        prompt="f(n: integer, u?: string)\nRequest: go",
        fields={
            "tools": tools,
            "signature_spans": {"f": [0, 25]},
            "request_span": [35, 37],
            "gold": gold,
        },
    )


def test_arguments_any_accepts_each_listed_value_and_optional_omission():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "u": {"type": "string"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    gold = {
        "name": "f",
        "arguments_any": {"n": [5, 6], "u": ["km", "kilometers"]},
        "optional": ["u"],
    }
    ex = _example(gold, {"f": schema})
    v = ArgumentsMatch()
    for args in ({"n": 5}, {"n": 6.0}, {"n": 6, "u": "km"}, {"n": 5, "u": "kilometers"}):
        assert v(ex, _call("f", args)).score == 1.0, args
    for args, why in (
        ({"n": 7}, "wrong n"),
        ({"n": 5, "u": "miles"}, "wrong u"),
        ({"u": "km"}, "missing n"),
        ({"n": 5, "z": 1}, "unexpected z"),
        ({"n": True}, "wrong n"),
    ):
        out = v(ex, _call("f", args))
        assert out.score == 0.0 and why in out.reason, (args, out)
    assert v(ex, _call("g", {"n": 5})).score == 0.0
    assert v(ex, _call("f", {"n": 5})).spans == ((0, 25), (35, 37))
    # a parameter that may only be left out: any value fails
    only_omit = dict(gold, arguments_any={"n": [5], "u": []})
    assert v(_example(only_omit, {"f": schema}), _call("f", {"n": 5})).score == 1.0
    assert v(_example(only_omit, {"f": schema}), _call("f", {"n": 5, "u": "km"})).score == 0.0
    # without "optional" nothing may be left out
    strict = {"name": "f", "arguments_any": {"n": [5], "u": ["km"]}}
    assert v(_example(strict, {"f": schema}), _call("f", {"n": 5})).score == 0.0
    assert v(_example(strict, {"f": schema}), _call("f", {"n": 5, "u": "km"})).score == 1.0
