"""Every constraint type against the IFEval rules, re-derived here as a test-only oracle, on
a few hundred generated edge cases each.

For each kind, ``IFEVAL[kind](text, params)`` is the IFEval checker's rule written from its
description (not imported from the verifier), and ``DEVIATIONS[kind]`` lists the intended
differences documented in docs/verifiers.md: each is a predicate that says when it applies
and what the verdict must then be. ``READING`` lists how the verifier reads the text before
any rule (invisible characters removed, look-alike letters read as Latin, NFKC), each as a
transformation re-derived here for the fragments that exercise it. The verifier must agree
with IFEval wherever no deviation applies, and follow the documented deviation where one
does. The test also checks that every kind saw both verdicts and that the generated cases
exercise each deviation, so a generator that drifts cannot make it pass vacuously.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
import re
import unicodedata

import pytest

from mrtpo.verifiers.constraints import KINDS, check

# ---------------------------------------------------------------------------------------
# IFEval's rules (the lm-eval "instructions" checkers), re-derived.


def _ifeval_words(text):
    return len(re.findall(r"\w+", text))  # nltk's RegexpTokenizer(r"\w+")


def ife_word_count(text, p):
    n = _ifeval_words(text)
    # Our prompt says "at most n": IFEval's "less than n + 1".
    return n < p["n"] + 1 if p["relation"] == "at most" else n >= p["n"]


def ife_keyword_include(text, p):
    return re.search(p["word"], text, flags=re.IGNORECASE) is not None


def ife_keyword_exclude(text, p):
    return not re.search(r"\b" + p["word"] + r"\b", text, flags=re.IGNORECASE)


def ife_letter_frequency(text, p):
    return collections.Counter(text.lower())[p["letter"]] >= p["n"]


def ife_no_commas(text, p):
    return not re.search(r"\,", text)


def ife_lowercase(text, p):
    return text == text.lower()


def ife_uppercase(text, p):
    return text == text.upper()


def ife_json_format(text, p):
    value = (
        text.strip()
        .removeprefix("```json")
        .removeprefix("```Json")
        .removeprefix("```JSON")
        .removeprefix("```")
        .removesuffix("```")
        .strip()
    )
    try:
        json.loads(value)
    except (ValueError, RecursionError):
        return False
    return True


def ife_bullet_count(text, p):
    stars = re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
    return len(stars) + len(dashes) == p["n"]


def ife_paragraph_count(text, p):
    parts = re.split(r"\s?\*\*\*\s?", text)
    n = len(parts)
    for i, part in enumerate(parts):
        if not part.strip():
            if i == 0 or i == len(parts) - 1:
                n -= 1
            else:
                return False
    return n == p["n"]


def ife_start_phrase(text, p):  # as IFEval's "repeat the request first" check
    return text.strip().lower().startswith(p["phrase"].strip().lower())


def ife_end_phrase(text, p):
    return text.strip().lower().endswith(p["phrase"].strip().lower())


def ife_placeholders(text, p):
    return len(re.findall(r"\[.*?\]", text)) >= p["n"]


def ife_title(text, p):
    for title in re.findall(r"<<[^\n]+>>", text):
        if title.lstrip("<").rstrip(">").strip():
            return True
    return False


def _ife_section_count(text):
    return len(re.split(r"\s?SECTION\s?\d+\s?", text)) - 1


def ife_sections(text, p):
    return _ife_section_count(text) >= p["n"]


def ife_quotation(text, p):
    t = text.strip()
    return len(t) > 1 and t[0] == '"' and t[-1] == '"'


IFEVAL = {k[4:]: f for k, f in globals().items() if k.startswith("ife_")}

# ---------------------------------------------------------------------------------------
# The intended deviations (docs/verifiers.md). Each: (name, applies(text, p), verdict(text, p)).


def _alnum_runs(text):
    """Words as the verifier defines them, found by a scan instead of a regex."""
    words, cur = [], ""
    for i, ch in enumerate(text):
        inner_apostrophe = (
            ch == "'" and cur and i + 1 < len(text) and text[i + 1].isalnum() and text[i + 1] != "_"
        )
        if (ch.isalnum() and ch != "_") or inner_apostrophe:
            cur += ch
        else:
            if cur:
                words.append(cur)
            cur = ""
    if cur:
        words.append(cur)
    return words


def _whole_word_hits(text, word):
    hits = 0
    for m in re.finditer(re.escape(word), text, flags=re.IGNORECASE):
        before = text[m.start() - 1] if m.start() > 0 else " "
        after = text[m.end()] if m.end() < len(text) else " "
        if not (before.isalnum() and before != "_") and not (after.isalnum() and after != "_"):
            hits += 1
    return hits


def _no_letter(text):
    return not any(c.isalpha() for c in text)


def _word_count_rule(text, p):
    n = len(_alnum_runs(text))
    return n <= p["n"] if p["relation"] == "at most" else n >= p["n"]


def _alnum(text):
    return any(c.isalnum() for c in text)


def _bullet_lines(text):
    count = 0
    for line in text.split("\n"):
        s = line.lstrip(" \t")
        if s[:1] in ("*", "-") and s[1:2] in (" ", "\t") and _alnum(s[1:]):
            count += 1
    return count


def _odd_bullet_line(text):
    """A line starting with a marker that is not "marker, blank, text with a letter or
    digit" (``-5``, ``---``, ``*x``, a bare ``*``, ``**bold**``, ``- ***``): IFEval's
    patterns may count it."""
    for line in text.split("\n"):
        s = line.lstrip(" \t")
        if s[:1] in ("*", "-") and not (s[1:2] in (" ", "\t") and _alnum(s[1:])):
            return True
    return False


def _our_placeholders(text):
    return sum(
        1
        for m in re.finditer(r"\[([^\[\]]*)\]", text)
        if 1 <= len(m.group(1)) <= 40 and "\n" not in m.group(1) and _alnum(m.group(1))
    )


def _ife_placeholder_odd(text):
    return any(
        not (1 <= len(m) - 2 <= 40) or "[" in m[1:-1] or not _alnum(m)
        for m in re.findall(r"\[.*?\]", text)
    )


def _our_titles(text):
    return any(
        1 <= len(m.group(1)) <= 80 and _alnum(m.group(1))
        for m in re.finditer(r"<<([^<>\n]*)>>", text)
    )


def _ife_title_odd(text):
    return any(
        ("<" in t[2:-2] or ">" in t[2:-2] or len(t) - 4 > 80 or (t[2:-2].strip() and not _alnum(t)))
        for t in re.findall(r"<<[^\n]+>>", text)
    )


def _paragraph_without_alnum(text):
    parts = text.split("***")
    if len(parts) > 1 and not parts[-1].strip():
        parts.pop()
    if len(parts) > 1 and not parts[0].strip():
        parts.pop(0)
    return any(not _alnum(part) for part in parts)


def _continues_word(text, i, step):
    """text[i] is a letter or digit, or an apostrophe before one (in direction step)."""
    if not 0 <= i < len(text):
        return False
    if text[i] == "'":
        return 0 <= i + step < len(text) and text[i + step].isalnum()
    return text[i].isalnum()


def _starts_inside_a_word(t, phrase):
    t = t.strip()
    return t.startswith(phrase) and _continues_word(t, len(phrase), 1)


def _ends_inside_a_word(t, phrase):
    t = t.strip()
    return t.endswith(phrase) and _continues_word(t, len(t) - len(phrase) - 1, -1)


def _json_constant(text):
    return re.search(r"\b(NaN|-?Infinity)\b", text) is not None


def _section_headers(text):
    count = 0
    for line in text.split("\n"):
        s = line.lstrip(" \t")
        hashes = len(s) - len(s.lstrip("#"))
        if 1 <= hashes <= 6 and s[hashes : hashes + 1] in (" ", "\t"):
            s = s[hashes:].lstrip(" \t")
        elif s.startswith(("**", "__")):
            s = s[2:]
        elif s.startswith(("*", "_")):
            s = s[1:]
        if s.startswith("SECTION") and s[7:].lstrip(" \t")[:1].isdecimal():
            count += 1
    return count


def _fence_one_sided(text):
    t = text.strip()
    return t.startswith("```") != t.endswith("```") or t == "```"


def _fence_lang_case(text):
    """An opening fence whose json tag IFEval does not strip (``jSon``, `` json``)."""
    t = text.strip()
    m = re.match(r"```([ \t]*)(json)(?![\w.+#-])", t, flags=re.I)
    return bool(m) and (m.group(1) != "" or m.group(2) not in ("json", "Json", "JSON"))


def _ife_json_normalised(text, p):
    return ife_json_format(re.sub(r"^```[ \t]*json", "```json", text.strip(), flags=re.I), p)


def _json_depth(text):
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _fence_other_lang(text):
    t = text.strip()
    if not t.startswith("```"):
        return False
    first = t[3:].split("\n", 1)[0]
    if "\n" not in t and t.endswith("```") and len(t) >= 6:
        first = t[3:-3]
    m = re.match(r'([A-Za-z][\w.+#-]*)(?=[\s{\["]|$)', first)
    return bool(m) and m.group(1).lower() != "json"


DEVIATIONS = {
    "word_count": [
        ("at most n words needs a word with a letter",
         lambda t, p: p["relation"] == "at most" and _no_letter(t), lambda t, p: False),
        ("words are letter/digit runs, inner apostrophes join, underscores split",
         lambda t, p: len(_alnum_runs(t)) != _ifeval_words(t), _word_count_rule),
    ],
    "keyword_include": [
        ("the keyword must be a whole word",
         lambda t, p: ife_keyword_include(t, p) and not _whole_word_hits(t, p["word"]),
         lambda t, p: False),
    ],
    "keyword_exclude": [
        ("a letter-free answer does not pass", lambda t, p: _no_letter(t), lambda t, p: False),
        ("an underscore separates words",
         lambda t, p: (_whole_word_hits(t, p["word"]) > 0) == ife_keyword_exclude(t, p),
         lambda t, p: _whole_word_hits(t, p["word"]) == 0),
    ],
    "no_commas": [
        ("a letter-free answer does not pass", lambda t, p: _no_letter(t), lambda t, p: False),
    ],
    "lowercase": [
        ("needs at least one lowercase letter that has case",
         lambda t, p: not any(c.swapcase() != c and c == c.lower() for c in t),
         lambda t, p: False),
    ],
    "uppercase": [
        ("a lowercase letter by its category is lowercase, even if upper-casing keeps it",
         lambda t, p: any(unicodedata.category(c) in ("Ll", "Lt") and c.upper() == c for c in t),
         lambda t, p: False),
        ("needs at least one uppercase letter that has case",
         lambda t, p: not any(c.swapcase() != c and c == c.upper() for c in t),
         lambda t, p: False),
    ],
    "json_format": [
        ("NaN and Infinity are not JSON", lambda t, p: _json_constant(t), lambda t, p: False),
        ("a fence must open and close the whole answer", lambda t, p: _fence_one_sided(t),
         lambda t, p: False),
        ("nesting deeper than 32 levels is refused", lambda t, p: _json_depth(t) > 32,
         lambda t, p: False),
        ("the fence language json is case-insensitive and may follow a space",
         lambda t, p: _fence_lang_case(t), _ife_json_normalised),
        ("another fence language is not JSON", lambda t, p: _fence_other_lang(t),
         lambda t, p: False),
    ],
    "bullet_count": [
        ("a bullet is a marker, a blank, then text with a letter or digit",
         lambda t, p: _odd_bullet_line(t), lambda t, p: _bullet_lines(t) == p["n"]),
    ],
    "paragraph_count": [
        ("a paragraph needs a letter or digit", lambda t, p: _paragraph_without_alnum(t),
         lambda t, p: False),
    ],
    "start_phrase": [
        ("the phrase is case-sensitive",
         lambda t, p: ife_start_phrase(t, p) and not t.strip().startswith(p["phrase"]),
         lambda t, p: False),
        ("the phrase must end where a word ends",
         lambda t, p: _starts_inside_a_word(t, p["phrase"]), lambda t, p: False),
    ],
    "end_phrase": [
        ("the phrase is case-sensitive",
         lambda t, p: ife_end_phrase(t, p) and not t.strip().endswith(p["phrase"]),
         lambda t, p: False),
        ("the phrase must start where a word starts",
         lambda t, p: _ends_inside_a_word(t, p["phrase"]), lambda t, p: False),
    ],
    "placeholders": [
        ("a placeholder holds 1-40 characters with a letter or digit, no brackets",
         lambda t, p: _ife_placeholder_odd(t), lambda t, p: _our_placeholders(t) >= p["n"]),
    ],
    "title": [
        ("a title holds 1-80 characters with a letter or digit, no angle brackets",
         lambda t, p: _ife_title_odd(t), lambda t, p: _our_titles(t)),
    ],
    "sections": [
        ("exactly n section header lines (## and ** headers count)",
         lambda t, p: _section_headers(t) != _ife_section_count(t) or _section_headers(t) > p["n"],
         lambda t, p: _section_headers(t) == p["n"]),
    ],
    "quotation": [
        ("a letter or digit must be inside the quotes",
         lambda t, p: ife_quotation(t, p) and not _alnum(t.strip()[1:-1]), lambda t, p: False),
    ],
}  # fmt: skip
ALL_KINDS = ("empty or whitespace-only answers pass nothing", lambda t, p: not t.strip())

# How every kind but json_format reads the text before any rule: (name, applies, the text
# read). Re-derived for the fragments below that exercise each.
_INVISIBLE = "\u200b\u00ad\u2060\ufeff"
_LOOKALIKE = {
    "\u0456": "i",
    "\u0406": "I",
    "\u0435": "e",
    "\u0415": "E",
    "\ua4e7": "H",
    "\u060c": ",",
    "\u1d07": "E",
}
READING = [
    ("invisible characters are removed", lambda t: any(c in t for c in _INVISIBLE),
     lambda t: "".join(c for c in t if c not in _INVISIBLE)),
    ("look-alike letters and commas read as what they imitate",
     lambda t: any(c in t for c in _LOOKALIKE), lambda t: "".join(_LOOKALIKE.get(c, c) for c in t)),
    ("the text is read in NFKC form", lambda t: unicodedata.normalize("NFKC", t) != t,
     lambda t: unicodedata.normalize("NFKC", t)),
]  # fmt: skip

# ---------------------------------------------------------------------------------------
# Generated edge cases.

FRAGMENTS = [
    "river", "River", "RIVER", "riverbank", "_river_", "river_", "it's", "don't", "a", "The",
    "cat", "dog", "e", "eve", "EEE", ",", ".", "!", "123", "4,5", "'", "_", "  ", "\t",
    "\u4f60\u597d", "\u00df", "\u0130", "\u01c5", "\u00aa", "\u00e9t\u00e9", "\u03a3", "\u00b2",
    "* item", "- item", "*", "-", "---", "**bold**", "-5", "*x", "*\tx", "- ", "  * nested",
    "***", "****", " *** ", "dear friend", "Dear Friend", "the end", "The End",
    "[name]", "[]", "[" + "x" * 50 + "]", "[a [b] c]", "[a\nb]", "[ ]",
    "<<t>>", "<< >>", "<<>>", "<<a<b>>", "<<<x>>>", "<<" + "y" * 90 + ">>", "<<a>> <<b>>",
    "SECTION 1", "## SECTION 2", "**SECTION 3**", "Section 4", "SECTION5", "see SECTION 2",
    "_SECTION 1_", "####### SECTION 1", "SECTION \u0663",
    '"', '""', '" "', '{"a": 1}', "[1, 2]", "```", "```json", "null",
    # read as a reader sees them (READING): invisible characters, look-alikes, NFKC forms
    "ri\u200bver", "\u00adriver", "\u2060", "r\u0456ver", "\u0435v\u0435", "\ua4e7ELLO",
    "a\u060cb", "\u1d07", "\uff32iver", "\u0138", "<<?>>",
]  # fmt: skip
SEPARATORS = ["", " ", "\n", "\n\n", " \n"]

PARAMS = {
    "word_count": lambda r: {"relation": r.choice(["at most", "at least"]), "n": r.randint(0, 6)},
    "keyword_include": lambda r: {"word": "river"},
    "keyword_exclude": lambda r: {"word": "river"},
    "letter_frequency": lambda r: {"letter": "e", "n": r.randint(1, 4)},
    "no_commas": lambda r: {},
    "lowercase": lambda r: {},
    "uppercase": lambda r: {},
    "json_format": lambda r: {},
    "bullet_count": lambda r: {"n": r.randint(1, 3)},
    "paragraph_count": lambda r: {"n": r.randint(1, 3)},
    "start_phrase": lambda r: {"phrase": r.choice(["dear friend", "the end"])},
    "end_phrase": lambda r: {"phrase": r.choice(["dear friend", "the end"])},
    "placeholders": lambda r: {"n": r.randint(1, 2)},
    "title": lambda r: {},
    "sections": lambda r: {"n": r.randint(1, 3)},
    "quotation": lambda r: {},
}


def _random_text(rng, pool):
    parts = []
    for _ in range(rng.randint(0, 7)):
        parts.append(rng.choice(pool))
        parts.append(rng.choice(SEPARATORS))
    text = "".join(parts)
    return text.upper() if rng.random() < 0.1 else text.lower() if rng.random() < 0.1 else text


def _json_cases():
    bodies = ['{"a": [1, 2]}', '{"s": "fence ``` inside"}', "{a: 1}", "[" * 33 + "]" * 33,
              "[" * 32 + "]" * 32, "", "5", '"x"', "NaN", '{"a": -Infinity}']  # fmt: skip
    opens = ["", "```", "```json", "```JSON", "```Json", "```jSon", "``` json", "```python",
             "```json5"]  # fmt: skip
    closes = ["", "```", "\n```", "\n```\nbye", "\n``` "]
    for lead, o, sep, b, c in itertools.product(["", "Here:\n"], opens, ["\n", " ", ""],
                                                 bodies, closes):  # fmt: skip
        if o or not sep:
            yield lead + o + sep + b + c


_PHRASES = ["dear friend", "Dear Friend", "DEAR FRIEND", "the end", "The End", "the end."]
_WRAP = ["", " ", "\n", "  \n"]
# Texts built around what a kind looks at, for half of its cases.
STRUCTURED = {
    "start_phrase": lambda r, t: (
        r.choice(_WRAP) + r.choice(_PHRASES) + r.choice([*SEPARATORS, "ship", "'s"]) + t
    ),
    "end_phrase": lambda r, t: (
        t + r.choice([*SEPARATORS, "bathe", "4"]) + r.choice(_PHRASES) + r.choice(_WRAP)
    ),
    "quotation": lambda r, t: (
        r.choice(_WRAP) + '"' + t + r.choice(['"', "", '" ']) + r.choice(_WRAP)
    ),
}


def _cases(kind, n=400):
    rng = random.Random(KINDS.index(kind) + 11)
    cases = [("", PARAMS[kind](rng)), ("   \n\t", PARAMS[kind](rng))]
    while len(cases) < n:
        text = _random_text(rng, FRAGMENTS)
        if kind in STRUCTURED and rng.random() < 0.5:
            text = STRUCTURED[kind](rng, text)
        cases.append((text, PARAMS[kind](rng)))
    if kind == "json_format":
        cases += [(t, {}) for t in _json_cases()]
    return cases


def _expected(kind, text, p):
    """(verdict, the deviation that decided it or None)."""
    if ALL_KINDS[1](text, p):
        return False, ALL_KINDS[0]
    if kind != "json_format":  # json_format parses the raw text
        for name, applies, read in READING:
            if applies(text):
                return _expected(kind, read(text), p)[0], name
    for name, applies, verdict in DEVIATIONS.get(kind, []):
        if applies(text, p):
            return verdict(text, p), name
    return IFEVAL[kind](text, p), None


def test_every_kind_has_an_oracle():
    assert set(IFEVAL) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_verifier_matches_ifeval_up_to_documented_deviations(kind):
    outcomes = collections.Counter()
    used = collections.Counter()
    for text, p in _cases(kind):
        want, why = _expected(kind, text, p)
        got = check(kind, text, p) is None
        assert got == want, (kind, text, p, why, check(kind, text, p))
        outcomes[got] += 1
        used[why] += 1
    assert outcomes[True] >= 10 and outcomes[False] >= 10, outcomes
    assert used[None] >= 50, used  # plenty of plain agreement with IFEval
    for name, *_ in DEVIATIONS.get(kind, []):
        assert used[name] > 0, (kind, name, used)  # every deviation exercised
    if kind != "json_format":
        for name, *_ in READING:
            assert used[name] > 0, (kind, name, used)
    assert used[ALL_KINDS[0]] >= 2
