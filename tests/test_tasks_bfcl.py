"""The ``tools-bfcl`` task: the Berkeley Function Calling Leaderboard's simple Python cases
scored by the four tool rewards. The schema conversion, the answer expansion, the
``arguments_any`` gold form and the missing-package error run everywhere; the tests on the
real cases need the ``bfcl-eval`` package (the [real] extra)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mrtpo.tasks.builtin import BFCL_DISTRACTORS, WARM_STEPS, default_warm_steps, load_task
from mrtpo.tasks.data import bfcl, tool_defs
from mrtpo.training.config import check_task
from mrtpo.verifiers import Example
from mrtpo.verifiers.tools import (
    ArgumentsMatch,
    ArgumentsValid,
    CallName,
    tool_verifiers,
    validate_subset,
)

HAVE_BFCL = importlib.util.find_spec(bfcl.PACKAGE) is not None
needs_bfcl = pytest.mark.skipif(
    not HAVE_BFCL, reason=f"the {bfcl.DIST} package (the [real] extra) is not installed"
)


def _call(name, args):
    return json.dumps({"name": name, "arguments": args})


def _scores(ex, response):
    return {v.name: v(ex, response).score for v in tool_verifiers()}


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


# --------------------------------------------------------------------------------------------
# The task


def test_missing_package_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == bfcl.PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(bfcl.importlib.util, "find_spec", fake)
    with pytest.raises(ValueError) as err:
        load_task("tools-bfcl")
    msg = str(err.value)
    assert msg.startswith("task: 'tools-bfcl' needs the package bfcl-eval; ")
    assert "pip install --no-deps bfcl-eval==2026.3.23" in msg and "\n" not in msg


def test_name_is_known_to_the_settings_and_the_warm_start():
    assert check_task("tools-bfcl") is None
    assert default_warm_steps("tools-bfcl") == WARM_STEPS["tools-bfcl"] == WARM_STEPS["tools"]
    with pytest.raises(ValueError, match="'tools-bfcl'"):
        load_task("tools-bfc")


# --------------------------------------------------------------------------------------------
# The real cases (the bfcl-eval package)


@pytest.fixture(scope="module")
def task():
    return load_task("tools-bfcl", seed=0)


def _case_of(ex):
    cases, _ = bfcl.load_cases()
    return next(c for c in cases if f"tools-bfcl-{c.id}" == ex.id)


@needs_bfcl
def test_every_case_loads():
    cases, skipped = bfcl.load_cases()
    assert len(cases) == bfcl.N_CASES == 400
    assert skipped == bfcl.SKIPPED == {}
    assert len({c.id for c in cases}) == 400
    by_id = {c.id: c for c in cases}
    # the documented corrections where the schema and the answers disagree
    assert by_id["simple_python_307"].arguments_any["venue"] == []
    assert "venue" in by_id["simple_python_307"].optional
    assert "formatted" not in by_id["simple_python_17"].optional
    assert by_id["simple_python_358"].arguments_any["diet"] == [["Gluten Free"]]
    assert by_id["simple_python_89"].arguments_any["conditions"] == [
        {"department": "Science", "school": "Bluebird High School"},
        {"department": "Science", "school": "Bluebird HS"},
    ]
    assert sum(len(c.optional) for c in cases) == 187


@needs_bfcl
def test_split_is_disjoint_complete_and_deterministic(task):
    assert (len(task.train), len(task.eval)) == (320, 80)
    ids = [e.id for e in task.train + task.eval]
    assert sorted(ids) == sorted(f"tools-bfcl-simple_python_{i}" for i in range(400))
    assert {e.prompt for e in task.train}.isdisjoint(e.prompt for e in task.eval)
    again, other = load_task("tools-bfcl", seed=0), load_task("tools-bfcl", seed=1)

    def key(t):
        return [(e.id, e.prompt, e.reference) for e in t.train + t.eval]

    assert key(again) == key(task)
    assert key(other) != key(task)
    assert {e.id for e in other.eval} != {e.id for e in task.eval}


@needs_bfcl
def test_every_reference_passes_all_four_rewards(task):
    for ex in task.train + task.eval:
        for v in task.verifiers:
            out = v(ex, ex.reference)
            assert out.score == 1.0, (ex.id, v.name, ex.reference, out)
        # the subset validator (no jsonschema) agrees
        name = ex.fields["gold"]["name"]
        args = json.loads(ex.reference)["arguments"]
        assert validate_subset(ex.fields["tools"][name], args) is None


@needs_bfcl
def test_prompt_shows_the_function_among_distractors(task):
    positions = [0] * (1 + BFCL_DISTRACTORS)
    for ex in task.train + task.eval:
        tools, gold = ex.fields["tools"], ex.fields["gold"]["name"]
        assert len(tools) == 1 + BFCL_DISTRACTORS and gold in tools
        assert list(tools) == list(ex.fields["signature_spans"])
        positions[list(tools).index(gold)] += 1
    assert min(positions) > 100  # the gold function is anywhere, not first


@needs_bfcl
def test_spans_point_at_the_signatures_and_the_question(task):
    cases, _ = bfcl.load_cases()
    by_name = {}
    for c in cases:
        by_name.setdefault(c.name, c)
    for ex in task.train[:50]:
        case = _case_of(ex)
        s, e = ex.fields["request_span"]
        assert ex.prompt[s:e] == case.question and ex.prompt.endswith(case.question)
        for name, (s, e) in ex.fields["signature_spans"].items():
            shown = case if name == case.name else by_name[name]
            assert ex.prompt[s:e] == tool_defs.signature_line(
                name, shown.description, shown.parameters
            )
        sig = tuple(ex.fields["signature_spans"][case.name])
        assert CallName()(ex, ex.reference).spans == (sig,)
        assert ArgumentsMatch()(ex, ex.reference).spans == (sig, tuple(ex.fields["request_span"]))


@needs_bfcl
def test_a_wrong_function_name_fails_the_name_and_the_arguments(task):
    for ex in task.train[:40]:
        gold = ex.fields["gold"]["name"]
        args = json.loads(ex.reference)["arguments"]
        other = next(n for n in ex.fields["tools"] if n != gold)
        out = _scores(ex, _call(other, args))
        assert out["tool_format"] == 1.0
        assert out["tool_name"] == 0.0 and out["tool_args"] == 0.0
        assert _scores(ex, _call(gold + "_v2", args))["tool_schema"] == 0.0


def _wrong(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + " extra"
    if isinstance(value, list):
        return value + value if value else [0]
    return {**value, "zz_extra": 1}


@needs_bfcl
def test_any_listed_value_passes_and_another_value_fails(task):
    tried = 0
    for ex in task.train + task.eval:
        gold = ex.fields["gold"]
        ref = json.loads(ex.reference)["arguments"]
        for param, values in gold["arguments_any"].items():
            for value in values:
                assert _scores(ex, _call(gold["name"], {**ref, param: value}))["tool_args"] == 1.0
            if param in ref:
                bad = _wrong(ref[param])
                if not any(bad == v for v in values):
                    out = ArgumentsMatch()(ex, _call(gold["name"], {**ref, param: bad}))
                    assert out.score == 0.0 and f"wrong {param}" in out.reason, (ex.id, param)
                    tried += 1
    assert tried > 900


@needs_bfcl
def test_optional_parameters_may_be_left_out_required_ones_not(task):
    left_out = dropped_required = 0
    for ex in task.train + task.eval:
        gold = ex.fields["gold"]
        schema = ex.fields["tools"][gold["name"]]
        ref = json.loads(ex.reference)["arguments"]
        assert set(ref) == set(gold["arguments_any"]) - set(gold["optional"])
        left_out += len(gold["optional"])  # the reference (which passes) leaves them all out
        for param in ref:
            rest = {k: v for k, v in ref.items() if k != param}
            out = _scores(ex, _call(gold["name"], rest))
            assert out["tool_args"] == 0.0, (ex.id, param)
            if param in schema.get("required", ()):
                assert out["tool_schema"] == 0.0, (ex.id, param)
            dropped_required += 1
    assert left_out == 187 and dropped_required > 900


@needs_bfcl
def test_a_required_parameter_the_answers_mark_omissible_stays_required(task):
    ex = next(e for e in task.train + task.eval if e.id == "tools-bfcl-simple_python_17")
    ref = json.loads(ex.reference)
    assert ref["arguments"]["formatted"] is True
    del ref["arguments"]["formatted"]
    out = _scores(ex, json.dumps(ref))
    assert out["tool_schema"] == 0.0 and out["tool_args"] == 0.0
    assert ArgumentsValid()(ex, ex.reference).score == 1.0


@needs_bfcl
def test_a_number_beyond_double_range_earns_nothing_whatever_its_spelling(task):
    """Issue 32, item 1: on an integer parameter, ``1`` and 400 zeros was paid for format,
    name and schema while ``1e400`` (the same number) earned nothing; both earn nothing."""
    ex = next(
        e
        for e in task.train + task.eval
        if any(
            s.get("type") == "integer"
            for s in e.fields["tools"][e.fields["gold"]["name"]]["properties"].values()
        )
    )
    gold = ex.fields["gold"]["name"]
    ref = json.loads(ex.reference)["arguments"]
    props = ex.fields["tools"][gold]["properties"]
    param = next(k for k, s in props.items() if s.get("type") == "integer")
    for literal in ("1" + "0" * 400, "-" + "9" * 400, "1e400", "-1e400", "1" + "0" * 400 + ".0"):
        text = _call(gold, {**ref, param: 12345}).replace("12345", literal)
        assert set(_scores(ex, text).values()) == {0.0}, (ex.id, literal[:10])
    assert _scores(ex, _call(gold, {**ref, param: 10**300}))["tool_schema"] == 1.0
