"""Tool-call parsing, the four tool rewards, their spans, and oversized or nested input."""

import json
import sys
import time

import pytest

from mrtpo.tasks.builtin import load_task
from mrtpo.tasks.data import tool_defs
from mrtpo.verifiers.tools import (
    MAX_CALL_CHARS,
    ArgumentsMatch,
    ArgumentsValid,
    CallFormat,
    CallName,
    CallParseError,
    parse_call,
    tool_verifiers,
    validate_arguments,
)


@pytest.fixture(scope="module")
def task():
    return load_task("tools", seed=0)


def _find(task, name):
    return next(e for e in task.train if e.fields["gold"]["name"] == name)


def _call(name, args):
    return json.dumps({"name": name, "arguments": args})


def test_parse_plain_fenced_and_string_arguments():
    assert parse_call('{"name": "f", "arguments": {"a": 1}}') == ("f", {"a": 1})
    assert parse_call('Sure:\n```json\n{"name": "f", "arguments": {}}\n```') == ("f", {})
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 2}"}') == ("f", {"a": 2})


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "empty"),
        ("call f(1)", "JSON"),
        ("[1, 2]", "object"),
        ('{"arguments": {}}', "name"),
        ('{"name": "f"}', "arguments"),
        ('{"name": "f", "arguments": [1]}', "arguments"),
        ("[" * 100_000 + "]" * 100_000, "characters"),
        ("[" * 40 + "]" * 40, "nested"),
        ('{"name": "f", "arguments": ' + "{" * 5000 + "}" * 5000 + "}", "nested"),
        ('{"name": "f", "arguments": {"a": "' + "x" * MAX_CALL_CHARS + '"}}', "characters"),
        ("\x00\xff\ufffd", "JSON"),
    ],
)
def test_parse_errors_are_clean(text, why):
    with pytest.raises(CallParseError, match=why):
        parse_call(text)


def test_depth_counts_only_brackets_outside_strings():
    deep_string = '"' + "[" * 100 + '"'
    assert parse_call('{"name": "f", "arguments": {"s": ' + deep_string + "}}")[1] == {
        "s": "[" * 100
    }


def test_gold_scores_one_and_spans_are_signatures(task):
    for ex in task.train[:50] + task.eval[:20]:
        verdicts = [v(ex, ex.reference) for v in tool_verifiers()]
        assert [v.score for v in verdicts] == [1.0] * 4, (ex.prompt, ex.reference, verdicts)
        gold_sig = tool_defs.signature(ex.fields["gold"]["name"])
        fmt, name, schema, args = verdicts
        assert fmt.spans == ()
        assert [ex.prompt[s:e] for s, e in name.spans] == [gold_sig]
        assert [ex.prompt[s:e] for s, e in schema.spans] == [gold_sig]
        texts = [ex.prompt[s:e] for s, e in args.spans]
        assert texts[0] == gold_sig and ex.prompt.endswith(texts[1]) and len(texts) == 2


def test_wrong_name_and_schema_span_follows_the_called_tool(task):
    ex = _find(task, "get_weather")
    other = next(n for n in ex.fields["tools"] if n != "get_weather")
    resp = _call(other, {"x": 1})
    assert CallFormat()(ex, resp).score == 1.0
    wrong = CallName()(ex, resp)
    assert wrong.score == 0.0 and "get_weather" in wrong.reason
    schema = ArgumentsValid()(ex, resp)
    assert schema.score == 0.0
    assert [ex.prompt[s:e] for s, e in schema.spans] == [tool_defs.signature(other)]
    unknown = ArgumentsValid()(ex, _call("rm_rf", {}))
    assert unknown.score == 0.0 and "no tool" in unknown.reason


@pytest.mark.parametrize(
    "args, valid",
    [
        ({"hour": 7, "minute": 30}, True),
        ({"hour": 7}, False),  # missing required
        ({"hour": "7", "minute": 30}, False),  # wrong type
        ({"hour": 24, "minute": 0}, False),  # out of range
        ({"hour": 7, "minute": 30, "second": 1}, False),  # extra property
        ({"hour": 7.5, "minute": 30}, False),
    ],
)
def test_schema_validation(task, args, valid):
    ex = _find(task, "set_alarm")
    out = ArgumentsValid()(ex, _call("set_alarm", args))
    assert out.score == (1.0 if valid else 0.0)
    assert (out.reason is None) == valid
    assert (validate_arguments(tool_defs.TOOLS["set_alarm"]["parameters"], args) is None) == valid


def test_argument_equality(task):
    ex = _find(task, "set_alarm")
    gold = ex.fields["gold"]["arguments"]
    v = ArgumentsMatch()
    assert v(ex, _call("set_alarm", dict(reversed(list(gold.items()))))).score == 1.0
    as_float = {k: float(x) for k, x in gold.items()}
    assert v(ex, _call("set_alarm", as_float)).score == 1.0  # 7 == 7.0
    off = dict(gold, minute=(gold["minute"] + 1) % 60)
    r = v(ex, _call("set_alarm", off))
    assert r.score == 0.0 and "minute" in r.reason
    r = v(ex, _call("set_alarm", {"hour": gold["hour"]}))
    assert r.score == 0.0 and "missing minute" in r.reason
    ex2 = _find(task, "play_music")
    g2 = ex2.fields["gold"]["arguments"]
    assert v(ex2, _call("play_music", dict(g2, extra=True))).score == 0.0


def test_booleans_are_not_numbers():
    from mrtpo.verifiers.tool_schema import _same

    assert not _same(True, 1) and not _same(1, True) and _same(1, 1.0)
    assert _same({"a": [1, {"b": 2.0}]}, {"a": [1.0, {"b": 2}]})
    assert not _same({"a": [1]}, {"a": [1, 1]})


@pytest.mark.parametrize(
    "response",
    [
        "",
        None,
        "\x00" * 100,
        "x" * (MAX_CALL_CHARS + 1),
        "{" * 100_000,
        "[" * 50 + "]" * 50,
        '{"name": ' * 1000,
        "```json\n" + "[" * 1000 + "\n```",
        "y" * 2_000_000,
    ],
)
def test_oversized_nested_or_junk_scores_zero_with_reason(task, response):
    ex = task.train[0]
    for v in tool_verifiers():
        out = v(ex, response)
        assert out.score == 0.0 and out.reason


def test_fast_enough(task):
    verifiers = tool_verifiers()
    examples = task.train[:100]
    t0 = time.perf_counter()
    calls = 0
    for ex in examples * 5:
        for v in verifiers:
            v(ex, ex.reference)
            calls += 1
    rate = calls / (time.perf_counter() - t0)
    assert rate > 1000, f"{rate:.0f} calls/s"


# --- Rewards a careful judge would not pay (issue 19): one test per case -----------------


def test_nan_and_infinity_are_not_json_and_earn_nothing(task):
    ex = _find(task, "convert_currency")
    gold = ex.fields["gold"]["arguments"]
    for const in ("NaN", "Infinity", "-Infinity", "1e400"):
        text = json.dumps({"name": "convert_currency", "arguments": {**gold, "amount": 1}})
        text = text.replace('"amount": 1', f'"amount": {const}')
        verdicts = [v(ex, text) for v in tool_verifiers()]
        assert [v.score for v in verdicts] == [0.0] * 4, (const, verdicts)
        assert const.lstrip("-") in verdicts[0].reason
    with pytest.raises(CallParseError, match="NaN"):
        parse_call('{"name": "f", "arguments": "{\\"a\\": NaN}"}')  # inside a string too


@pytest.mark.parametrize("use_jsonschema", [True, False])
def test_a_trailing_newline_does_not_match_an_anchored_pattern(task, monkeypatch, use_jsonschema):
    from mrtpo.verifiers import tool_schema, tools

    if use_jsonschema:
        pytest.importorskip("jsonschema")
    else:
        monkeypatch.setattr(tool_schema, "_validator", lambda schema_json: None)
    ex = _find(task, "convert_currency")
    gold = ex.fields["gold"]["arguments"]
    assert ArgumentsValid()(ex, _call("convert_currency", gold)).score == 1.0
    for bad in ("EUR\n", "EU\nR", "\u0665\u0665\u0665"):
        out = ArgumentsValid()(ex, _call("convert_currency", {**gold, "source": bad}))
        assert out.score == 0.0 and "source" in out.reason, (bad, out)
    params = tool_defs.TOOLS["book_table"]["parameters"]
    args = {"restaurant": "Luigi", "people": 2, "time": "19:30"}
    assert validate_arguments(params, args) is None
    assert validate_arguments(params, {**args, "time": "19:30\n"}) is not None
    assert validate_arguments(params, {**args, "time": "\u0661\u0669:30"}) is not None
    assert tools.json_schema_regex(r"a$|[$]b\$").search("$b$")  # $ in a class or escaped
    assert not tools.json_schema_regex(r"^a$").search("a\n")


def test_the_arguments_reward_needs_the_gold_tool(task):
    ex = _find(task, "set_alarm")
    gold = ex.fields["gold"]["arguments"]
    other = next(n for n in ex.fields["tools"] if n != "set_alarm")
    out = ArgumentsMatch()(ex, _call(other, gold))
    assert out.score == 0.0 and other in out.reason
    out = ArgumentsMatch()(ex, _call("no_such_tool", gold))
    assert out.score == 0.0
    assert ArgumentsMatch()(ex, _call("set_alarm", gold)).score == 1.0


def test_a_key_given_twice_is_not_a_call(task):
    ex = _find(task, "set_timer")
    m = ex.fields["gold"]["arguments"]["minutes"]
    twice_arg = f'{{"name": "set_timer", "arguments": {{"minutes": 999, "minutes": {m}}}}}'
    twice_name = f'{{"name": "translate", "name": "set_timer", "arguments": {{"minutes": {m}}}}}'
    both = f'{{"name": "set_timer", "arguments": {{"minutes": {m}}}, "parameters": {{}}}}'
    for text in (twice_arg, twice_name, both):
        verdicts = [v(ex, text) for v in tool_verifiers()]
        assert [v.score for v in verdicts] == [0.0] * 4, (text, verdicts)
    assert "twice" in CallFormat()(ex, twice_arg).reason


def test_two_calls_in_one_answer_earn_nothing(task):
    ex = _find(task, "set_timer")
    gold = _call("set_timer", ex.fields["gold"]["arguments"])
    wrong = _call("set_alarm", {"hour": 7, "minute": 0})
    for text in (
        f"```json\n{gold}\n```\n```json\n{wrong}\n```",
        f"```json\n{wrong}\n```\n```json\n{gold}\n```",
        f"```json\n{gold}\n```\nor else {wrong}",
        f"{wrong}\n```json\n{gold}\n```",
        gold[:-1] + f', "then": {wrong}}}',  # a second call under another key
        gold[:-1] + f', "id": {wrong}}}',  # or under a key a call may have
    ):
        verdicts = [v(ex, text) for v in tool_verifiers()]
        assert [v.score for v in verdicts] == [0.0] * 4, (text, verdicts)
        reason = verdicts[0].reason
        assert "more than one call" in reason or "then" in reason or '"id"' in reason
    # One fenced call with prose around it is still one call.
    ok = f"Here you go:\n```json\n{gold}\n```\nDone."
    assert [v(ex, ok).score for v in tool_verifiers()] == [1.0] * 4


# --- Issue 32, item 1: beyond double range, whatever the spelling ---------------------------

_MAX_DOUBLE_INT = int(sys.float_info.max)  # 1.797...e308 as an exact integer (309 digits)
_HALF_ULP = 2**970  # half the gap between the largest double and the next power of two


@pytest.mark.parametrize(
    "literal",
    [
        "1e400",
        "-1e400",
        "1E+400",
        "1.8e308",
        "1" + "0" * 400,  # the same number as 1e400, as an integer
        "-" + "1" * 400,
        "9" * 5000,  # past Python's int-to-string limit too: refused for its range
        "1" + "0" * 400 + ".0",
        str(2**1024),
        str(_MAX_DOUBLE_INT + _HALF_ULP),  # rounds to 2**1024: out of range
    ],
)
def test_a_number_beyond_double_range_earns_nothing_however_spelled(task, literal):
    ex = _find(task, "convert_currency")
    gold = ex.fields["gold"]["arguments"]
    text = json.dumps({"name": "convert_currency", "arguments": {**gold, "amount": 1}})
    text = text.replace('"amount": 1', f'"amount": {literal}')
    verdicts = [v(ex, text) for v in tool_verifiers()]
    assert [v.score for v in verdicts] == [0.0] * 4, (literal[:20], verdicts)
    assert "out of range" in verdicts[0].reason
    with pytest.raises(CallParseError, match="out of range"):  # inside a string too
        parse_call(json.dumps({"name": "f", "arguments": f'{{"a": {literal}}}'}))


@pytest.mark.parametrize(
    "value", [_MAX_DOUBLE_INT, -_MAX_DOUBLE_INT, _MAX_DOUBLE_INT + _HALF_ULP - 1, 10**308]
)
def test_an_integer_and_its_decimal_spelling_get_the_same_verdict(value):
    """At the edge of the range an integer literal is refused exactly when the same number
    written with ``.0`` is (both round to nearest), and a finite one keeps its exact value."""
    as_int = parse_call(f'{{"name": "f", "arguments": {{"a": {value}}}}}')[1]["a"]
    as_float = parse_call(f'{{"name": "f", "arguments": {{"a": {value}.0}}}}')[1]["a"]
    assert as_int == value and type(as_int) is int
    assert as_float == float(value)
