"""The ``tools-bfcl`` task: the Berkeley Function Calling Leaderboard's simple Python cases
scored by the four tool rewards. The schema conversion, the answer expansion, the
``arguments_any`` gold form and the missing-package error run everywhere; the tests on the
real cases need the ``bfcl-eval`` package (the [real] extra)."""

from __future__ import annotations

import json

import pytest

from mrtpo.data import bfcl, tool_defs
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


# --------------------------------------------------------------------------------------------
# Converting BFCL cases, on hand-made ones


def test_to_schema_maps_the_bfcl_types():
    spec = {
        "type": "dict",
        "properties": {
            "n": {"type": "integer", "description": "a count", "default": 3},
            "x": {"type": "float"},
            "pt": {"type": "tuple", "items": {"type": "float"}},
            "data": {"type": "any"},
            "unit": {"type": "string", "enum": ["a", "b"], "optional": True},
            "rows": {
                "type": "array",
                "items": {"type": "dict", "properties": {"k": {"type": "string"}}},
            },
            "ok": {"type": "boolean"},
        },
        "required": ["n", "x"],
        "optional": [],
    }
    assert bfcl.to_schema(spec, top=True) == {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "pt": {"type": "array", "items": {"type": "number"}},
            "data": {},
            "unit": {"type": "string", "enum": ["a", "b"]},
            "rows": {
                "type": "array",
                "items": {"type": "object", "properties": {"k": {"type": "string"}}},
            },
            "ok": {"type": "boolean"},
        },
        "required": ["n", "x"],
        "additionalProperties": False,
    }
    with pytest.raises(bfcl.UnsupportedCase, match=r"p/q: type 'complex'"):
        bfcl.to_schema({"type": "dict", "properties": {"q": {"type": "complex"}}}, "p")
    with pytest.raises(bfcl.UnsupportedCase, match="a dict of parameters"):
        bfcl.to_schema({"type": "string"}, top=True)


def _line(answers, properties, required=()):
    question = {
        "id": "c1",
        "question": [[{"role": "user", "content": "Do it."}]],
        "function": [
            {
                "name": "f",
                "description": "does  it\n well",
                "parameters": {
                    "type": "dict",
                    "properties": properties,
                    "required": list(required),
                },
            }
        ],
    }
    return question, {"id": "c1", "ground_truth": [{"f": answers}]}


def test_to_case_expands_nested_answers_and_keeps_the_schema_consistent():
    props = {
        "where": {
            "type": "dict",
            "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
        },
        "unit": {"type": "string"},
        "flag": {"type": "boolean"},
        "limit": {"type": "integer"},
    }
    answers = {
        "where": [{"a": ["x", "X"], "b": ["", 2]}],
        "unit": ["km", "", True],  # True breaks the string schema: dropped
        "flag": [True, ""],  # "" for a required parameter: ignored
        "limit": [""],  # may only be left out
    }
    case = bfcl.to_case(*_line(answers, props, required=["where", "flag"]))
    assert case.description == "does it well"
    assert case.arguments_any == {
        "where": [{"a": "x", "b": 2}, {"a": "x"}, {"a": "X", "b": 2}, {"a": "X"}],
        "unit": ["km"],
        "flag": [True],
        "limit": [],
    }
    assert case.optional == ("unit", "limit")
    assert case.reference() == {
        "name": "f",
        "arguments": {"where": {"a": "x", "b": 2}, "flag": True},
    }
    assert case.gold() == {
        "name": "f",
        "arguments_any": case.arguments_any,
        "optional": ["unit", "limit"],
    }


@pytest.mark.parametrize(
    "answers, required, why",
    [
        ({"n": ["one"]}, ["n"], "no acceptable value fits"),
        ({"n": [1], "m": [2]}, ["n"], "does not have"),
        ({}, ["n"], "no answers for required"),
        ({"n": [{"k": 1}]}, ["n"], "expected a list of acceptable values"),
        ({"n": [[{"k": list(range(9))}, {"k": list(range(9))}]]}, ["n"], "more than 64"),
    ],
)
def test_to_case_refuses_what_it_cannot_express(answers, required, why):
    props = {"n": {"type": "integer"}}
    with pytest.raises(bfcl.UnsupportedCase, match=why):
        bfcl.to_case(*_line(answers, props, required))
