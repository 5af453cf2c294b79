"""Every constraint type passes and fails where it should; spans and relevant_chars point
at the right text; junk never raises."""

import random
import time

import pytest

from mrtpo.tasks.data import instructions
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


# --- Rewards a careful judge would not pay (issue 19): one test per case -----------------


def test_echoing_the_prompt_earns_nothing():
    """The constraint sentences hold their own example markup (<<title>>, [name], the
    keyword, "***"); a copy of the prompt, in any case or spacing, satisfies nothing, and a
    copied sentence's markup does not count beside an answer either."""
    from mrtpo.tasks.builtin import load_task

    for name in ("constraints", "constraints-full", "constraints:title,placeholders,word_count"):
        task = load_task(name, seed=0)
        for ex in task.train[:40]:
            for echo in (ex.prompt, ex.prompt.upper(), ex.prompt.replace(" ", "\n"),
                         ex.prompt.replace(". ", "\n")):  # fmt: skip
                verdicts = [v(ex, echo) for v in task.verifiers]
                assert all(v.score == 0.0 for v in verdicts), (ex.prompt, echo, verdicts)
            assert [v(ex, ex.reference).score for v in task.verifiers] == [1.0] * len(
                task.verifiers
            )
    # Beside an answer, a copied sentence adds nothing: its <<title>> and [name] do not count,
    # and the answer does not start with the phrase when the copy comes first.
    for kind, params, answer in [
        ("title", {}, "my cat sleeps all day."),
        ("placeholders", {"n": 1}, "my cat sleeps all day."),
        ("keyword_include", {"word": "river"}, "my cat sleeps all day."),
        ("paragraph_count", {"n": 2}, "my cat sleeps all day."),
        ("start_phrase", {"phrase": "dear friend"}, "dear friend. my cat sleeps."),
    ]:
        ex = _example(kind, params)
        sentence = describe(kind, params)
        v = ConstraintVerifier(kind)
        for text in (f"{sentence}\n{answer}", f"{answer} {sentence.rstrip('.')}"):
            if kind == "start_phrase" and text.startswith(answer):
                continue  # the answer comes first: it does start with the phrase
            out = v(ex, text)
            assert out.score == 0.0, (kind, text, out)


@pytest.mark.parametrize(
    "response",
    [
        "the ri\u200bver is wide.",  # zero-width space
        "the ri\u00adver is wide.",  # soft hyphen
        "the riv\u2060er is wide.",  # word joiner
        "the r\u0456ver is wide.",  # Cyrillic i
        "the RIV\u0415R is wide.",  # Cyrillic capital E
        "the \u0280\u026a\u1d20\u1d07\u0280 is wide.",  # Latin small capitals
        "the \uff52\uff49\uff56\uff45\uff52 is wide.",  # fullwidth
        "the \U0001d42b\U0001d422\U0001d42f\U0001d41e\U0001d42b is wide.",  # mathematical bold
    ],
)
def test_invisible_and_look_alike_characters_do_not_hide_a_banned_word(response):
    ex = _example("keyword_exclude", {"word": "river"})
    out = ConstraintVerifier("keyword_exclude")(ex, response)
    assert out.score == 0.0 and "river" in out.reason, out
    # and the word they spell counts where it is asked for
    assert check("keyword_include", response, {"word": "river"}) is None


@pytest.mark.parametrize(
    "kind, params, response",
    [
        ("title", {}, "<<\u200b>>\nmy cat"),
        ("title", {}, "<<\u3164>>\nmy cat"),  # Hangul filler: a "letter" that shows nothing
        ("title", {}, "<<\u2800>>\nmy cat"),  # braille blank
        ("title", {}, "<<\u00ad\u0301>>\nmy cat"),  # soft hyphen, a lone accent
        ("title", {}, "<<...>>\nmy cat"),
        ("quotation", {}, '"\u200b\u200b"'),
        ("quotation", {}, '"\u3164"'),
        ("quotation", {}, '"..."'),
        ("bullet_count", {"n": 2}, "* my cat\n* \u200b"),
        ("bullet_count", {"n": 2}, "* my cat\n- \u2800"),
        ("bullet_count", {"n": 2}, "* my cat\n* ***"),
        ("paragraph_count", {"n": 2}, "my cat\n***\n\u200b\u2060"),
        ("paragraph_count", {"n": 2}, "my cat\n***\n\u3164"),
        ("paragraph_count", {"n": 2}, "my cat\n***\n!!!"),
        ("placeholders", {"n": 1}, "ask [\u200b]"),
        ("placeholders", {"n": 1}, "ask [ ]"),
        ("placeholders", {"n": 1}, "ask [\u3164]"),
        ("word_count", {"relation": "at least", "n": 1}, "\u200b\ufeff\u00ad"),
    ],
)
def test_content_that_shows_nothing_is_empty(kind, params, response):
    out = ConstraintVerifier(kind)(_example(kind, params), response)
    assert out.score == 0.0 and out.reason, out


@pytest.mark.parametrize(
    "kind, response",
    [
        ("lowercase", "\ua4e7ello world"),  # Lisu letter shaped like H (no case)
        ("lowercase", "\U0001d407ello world"),  # mathematical bold capital H
        ("lowercase", "\uff28ello world"),  # fullwidth H
        ("lowercase", "hello \u13bborld"),  # Cherokee capital
        ("lowercase", "\u2122 hello"),  # trade mark sign: T and M
        ("uppercase", "HELLO \u0138"),  # kra: lowercase, no uppercase form
        ("uppercase", "HELLO W\u1d0f\u0280LD"),  # small capitals are lowercase letters...
        ("uppercase", "HELLO \u1d43"),  # modifier small a
        ("uppercase", "HELL\U0001d428"),  # mathematical bold small o
    ],
)
def test_look_alike_letters_do_not_fool_the_case_checks(kind, response):
    if "\u1d0f" in response:  # ...and read as the capitals they look like
        assert check(kind, response, {}) is None
        response = response.replace("W", "w")
    out = ConstraintVerifier(kind)(_example(kind, {}), response)
    assert out.score == 0.0 and "letter" in out.reason, out


@pytest.mark.parametrize(
    "comma",
    ["\u060c", "\u3001", "\uff0c", "\ufe50", "\u201a", "\u055d", "\u1363", "\ua4fe", "\u066c"],
)
def test_other_scripts_commas_are_commas(comma):
    ex = _example("no_commas", {})
    text = f"one{comma} two and three"
    out = ConstraintVerifier("no_commas")(ex, text)
    assert out.score == 0.0 and "comma" in out.reason, out
    assert [text[s:e] for s, e in ConstraintVerifier("no_commas").relevant_chars(ex, text)] == [
        comma
    ]


@pytest.mark.parametrize(
    "response",
    ["NaN", "Infinity", "-Infinity", '{"a": NaN}', "```json\n[1, Infinity]\n```"],
)
def test_json_format_refuses_nan_and_infinity(response):
    out = ConstraintVerifier("json_format")(_example("json_format", {}), response)
    assert out.score == 0.0 and "JSON" in out.reason, out
    assert check("json_format", '{"a": "NaN", "b": 1e308}', {}) is None  # a string is fine


@pytest.mark.parametrize(
    "kind, phrase, response",
    [
        ("start_phrase", "dear friend", "dear friendship is rare."),
        ("start_phrase", "dear friend", "dear friend's cat is here."),
        ("start_phrase", "good news", "good newsletter today."),
        ("start_phrase", "in short", "in shortbread we trust."),
        ("end_phrase", "the end", "we went to bathe end"),
        ("end_phrase", "thank you", "we say prethank you"),
        ("end_phrase", "see you soon", "i will oversee you soon"),
    ],
)
def test_start_and_end_phrases_do_not_match_inside_a_longer_word(kind, phrase, response):
    ex = _example(kind, {"phrase": phrase})
    out = ConstraintVerifier(kind)(ex, response)
    assert out.score == 0.0 and "word" in out.reason, out
    # whole words still pass, with punctuation or a line break beside them
    ok = f"{phrase}. more text." if kind == "start_phrase" else f"more text.\n{phrase}"
    assert ConstraintVerifier(kind)(ex, ok).score == 1.0
