"""Every constraint type passes and fails where it should; spans and relevant_chars point
at the right text; junk never raises."""

import random
import time

import pytest

from mrtpo.data import instructions
from mrtpo.verifiers import Example
from mrtpo.verifiers.constraints import KINDS, ConstraintVerifier, check, describe

# kind, params, a passing response, a failing response, the substrings relevant_chars
# should return for the passing response (None: not checked here, see the dedicated tests).
CASES = [
    ("word_count", {"relation": "at most", "n": 3}, "one two three", "one two three four", None),
    ("word_count", {"relation": "at least", "n": 3}, "it's a cat", "a cat", ["it's", "a", "cat"]),
    ("keyword_include", {"word": "river"}, "the River runs", "the riverbank", ["River"]),
    ("keyword_exclude", {"word": "river"}, "the riverbank", "a river, a River", []),
    ("letter_frequency", {"letter": "e", "n": 3}, "Eve eats", "eve", ["E", "e", "e"]),
    ("no_commas", {}, "no commas here.", "one, two", []),
    ("lowercase", {}, "all small 123.", "Not small", []),
    ("uppercase", {}, "ALL BIG 123.", "ALL BIg", []),
    ("json_format", {}, ' {"a": [1, 2]} ', "{'a': 1}", ['{"a": [1, 2]}']),
    ("json_format", {}, '```json\n{"a": 1}\n```', "```json\n{a}\n```", None),
    ("bullet_count", {"n": 2}, "intro\n* one\n- two", "* one\n* two\n* three", ["*", "-"]),
    ("paragraph_count", {"n": 2}, "one\n***\ntwo", "one\n***\n\n***\ntwo", ["***"]),
    (
        "start_phrase",
        {"phrase": "dear friend"},
        "  dear friend. hi",
        "hi dear friend",
        ["dear friend"],
    ),
    ("end_phrase", {"phrase": "the end"}, "hi. the end\n", "the end. hi", ["the end"]),
    ("placeholders", {"n": 2}, "ask [name] at [place]", "ask [name]", ["[name]", "[place]"]),
    ("title", {}, "<<a cat>>\nmy cat", "<a cat>\nmy cat", ["<<a cat>>"]),
    ("sections", {"n": 2}, "SECTION 1\na\nSECTION 2\nb", "SECTION 1\na\nsection 2\nb", None),
    ("quotation", {}, '"hi there"', '"hi there', ['"', '"']),
]


def _example(kind, params):
    sentence = describe(kind, params)
    prompt = f"Write a short note about a cat. {sentence}"
    start = prompt.index(sentence)
    entry = {"kind": kind, "params": params, "span": [start, start + len(sentence)]}
    return Example(id="t", prompt=prompt, fields={"constraints": [entry]})


def test_at_least_twelve_kinds():
    assert len(KINDS) >= 12
    required = {
        "word_count", "keyword_include", "keyword_exclude", "letter_frequency", "no_commas",
        "lowercase", "uppercase", "json_format", "bullet_count", "paragraph_count",
        "start_phrase", "end_phrase", "placeholders", "title", "sections",
    }  # fmt: skip
    assert required <= set(KINDS)
    assert {c[0] for c in CASES} == set(KINDS)


@pytest.mark.parametrize("kind, params, good, bad, relevant", CASES)
def test_each_kind_passes_and_fails(kind, params, good, bad, relevant):
    ex = _example(kind, params)
    v = ConstraintVerifier(kind)
    ok = v(ex, good)
    assert ok.score == 1.0 and ok.reason is None
    no = v(ex, bad)
    assert no.score == 0.0 and no.reason and kind in no.reason
    for verdict in (ok, no):
        ((s, e),) = verdict.spans
        assert ex.prompt[s:e] == describe(kind, params)
    if relevant is not None:
        assert [good[s:e] for s, e in v.relevant_chars(ex, good)] == relevant


def test_relevant_chars_of_prohibitions_point_at_violations():
    def rel(kind, params, text):
        return [
            text[s:e]
            for s, e in ConstraintVerifier(kind).relevant_chars(_example(kind, params), text)
        ]

    assert rel("keyword_exclude", {"word": "river"}, "a river, a River") == ["river", "River"]
    assert rel("no_commas", {}, "one, two, three") == [",", ","]
    assert rel("lowercase", {}, "Not sMall") == ["N", "M"]
    assert rel("uppercase", {}, "ALL BIg") == ["g"]
    assert rel("sections", {"n": 2}, "SECTION 1\na\n  SECTION 2\nb") == ["SECTION 1", "  SECTION 2"]
    # Prescriptions point where the text must be even when it is missing.
    assert rel("start_phrase", {"phrase": "dear friend"}, "  hello there, pal") == ["hello there"]
    assert rel("end_phrase", {"phrase": "the end"}, "that is all\n") == [" is all"]
    assert rel("keyword_include", {"word": "river"}, "no water") == []
    assert rel("word_count", {"relation": "at most", "n": 1}, "a b") == ["a", "b"]


def test_relevant_chars_of_end_phrase_is_the_tail():
    ex = _example("end_phrase", {"phrase": "the end"})
    text = "that is all\n"
    ((s, e),) = ConstraintVerifier("end_phrase").relevant_chars(ex, text)
    assert (s, e) == (len("that is all") - len("the end"), len("that is all"))


def test_keyword_is_a_whole_word_and_case_insensitive():
    assert check("keyword_include", "Rivers run", {"word": "river"}) is not None
    assert check("keyword_include", "RIVER!", {"word": "river"}) is None
    assert check("keyword_exclude", "riverside", {"word": "river"}) is None
    assert check("keyword_exclude", "(river)", {"word": "river"}) is not None


def test_deep_or_huge_json_is_rejected_without_recursion_error():
    ex = _example("json_format", {})
    v = ConstraintVerifier("json_format")
    deep = v(ex, "[" * 100_000 + "]" * 100_000)
    assert deep.score == 0.0 and deep.reason
    huge = v(ex, "[" + "1," * 200_000 + "1]")
    assert huge.score == 0.0 and "longer" in huge.reason
    assert v(ex, "[" * 30 + "]" * 30).score == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   \n",
        "\x00\xff\ufffd" * 50,
        "[[[[",
        "<<<<>>>>",
        "*" * 10_000,
        "x" * 1_000_000,
        None,
        42,
    ],
)
def test_junk_never_raises(response):
    for kind, params, *_ in CASES:
        ex = _example(kind, params)
        v = ConstraintVerifier(kind)
        out = v(ex, response)
        assert out.score in (0.0, 1.0)
        assert out.score == 1.0 or out.reason
        assert isinstance(v.relevant_chars(ex, response), list)


def test_slot_verifier_and_missing_constraint():
    ex = _example("title", {})
    assert ConstraintVerifier(slot=0)(ex, "<<t>> x").score == 1.0
    absent = ConstraintVerifier(slot=3)(ex, "anything")
    assert absent.score == 1.0 and absent.spans == ()
    missing = ConstraintVerifier("no_commas")(ex, "a, b")
    assert missing.score == 0.0 and "no no_commas constraint" in missing.reason
    broken = Example(id="b", prompt="p", fields={"constraints": [{"kind": "nope"}]})
    out = ConstraintVerifier(slot=0)(broken, "x")
    assert out.score == 0.0 and out.reason


def test_constructor_errors():
    with pytest.raises(ValueError, match="kind"):
        ConstraintVerifier("no_such_kind")
    with pytest.raises(ValueError, match="exactly one"):
        ConstraintVerifier()
    with pytest.raises(ValueError, match="slot"):
        ConstraintVerifier(slot=-1)


def test_composed_examples_spans_are_their_sentences():
    rng = random.Random(5)
    for ex in instructions.make_examples(rng, 60, kinds=None, shuffle_constraints=True):
        for i, entry in enumerate(ex.fields["constraints"]):
            v = ConstraintVerifier(slot=i)
            verdict = v(ex, ex.reference)
            assert verdict.score == 1.0, (ex.prompt, ex.reference, verdict)
            ((s, e),) = verdict.spans
            assert ex.prompt[s:e] == describe(entry["kind"], entry["params"])


def test_make_examples_rejects_bad_kinds():
    with pytest.raises(ValueError, match="unknown"):
        instructions.make_examples(random.Random(0), 1, kinds=("nope",))
    with pytest.raises(ValueError, match="cannot all hold"):
        instructions.make_examples(random.Random(0), 1, kinds=("lowercase", "uppercase"))


def test_fast_enough():
    examples = instructions.make_examples(random.Random(1), 50, kinds=None)
    verifiers = [ConstraintVerifier(slot=i) for i in range(4)]
    t0 = time.perf_counter()
    calls = 0
    for _ in range(10):
        for ex in examples:
            for v in verifiers:
                v(ex, ex.reference)
                calls += 1
    rate = calls / (time.perf_counter() - t0)
    assert rate > 2000, f"{rate:.0f} calls/s"


_FARMING = [
    # (kind, params, response): none of these may earn the reward.
    *[(k, p, r) for k, p, *_ in CASES for r in ("", "   ", "\n\t \n")],
    ("no_commas", {}, "..."),
    ("no_commas", {}, "123 456"),
    ("keyword_exclude", {"word": "river"}, "!!!"),
    ("word_count", {"relation": "at most", "n": 5}, "?"),
    ("lowercase", {}, "123 ..."),
    ("lowercase", {}, "\u4f60\u597d"),  # letters without case
    ("uppercase", {}, "123 ..."),
    ("uppercase", {}, "\u4f60\u597d"),
    ("json_format", {}, 'Here it is:\n```json\n{"a": 1}\n```'),
    ("json_format", {}, '```json\n{"a": 1}\n```\nHope this helps'),
    ("json_format", {}, '```python\n{"a": 1}\n```'),
    ("title", {}, "<< >>\nbody"),
    ("quotation", {}, '"  "'),
]


@pytest.mark.parametrize("kind, params, response", _FARMING)
def test_empty_or_letter_free_answers_earn_nothing(kind, params, response):
    out = ConstraintVerifier(kind)(_example(kind, params), response)
    assert out.score == 0.0 and out.reason


@pytest.mark.parametrize(
    "kind, params, response",
    [
        ("lowercase", {}, "\u4f60\u597d hello"),
        ("uppercase", {}, "\u4f60\u597d HELLO 123"),
        ("json_format", {}, '```json\n{"s": "a ``` b", "t": "```"}\n```'),
        ("json_format", {}, '```json {"a": 1}```'),
        ("json_format", {}, "```JSON\n[1, 2]\n```\n"),
        ("json_format", {}, '```\n{"a": 1}\n```'),
        ("sections", {"n": 2}, "## SECTION 1\na\n## SECTION 2\nb"),
        ("sections", {"n": 2}, "**SECTION 1**\na\n**SECTION 2**\nb"),
        ("paragraph_count", {"n": 2}, "***\none\n***\ntwo\n***"),
        ("title", {}, "<<a title>>\nbody"),
    ],
)
def test_well_formed_answers_still_pass(kind, params, response):
    out = ConstraintVerifier(kind)(_example(kind, params), response)
    assert out.score == 1.0, out.reason


def test_sections_count_is_exact_and_only_headers_count():
    assert check("sections", "SECTION 1\na\nsee SECTION 2 below", {"n": 2}) is not None
    assert check("sections", "SECTION 1\nSECTION 2\nSECTION 3", {"n": 2}) is not None
