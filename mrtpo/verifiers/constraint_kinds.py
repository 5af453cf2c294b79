"""The IFEval-style constraint types that `ConstraintVerifier` judges
(mrtpo/verifiers/constraints.py): one `Constraint` per kind, each with its prompt sentence
(``sentence``), its check (``check``) and the spans of the RESPONSE its constraint concerns
(``relevant``, a verifier's ``relevant_chars``, used to measure credit precision), in
`CONSTRAINTS` by kind (`KINDS`, in a fixed order). What each type checks and returns:

| kind | checks | relevant_chars |
|---|---|---|
| ``word_count`` | at most / at least n words | every word |
| ``keyword_include`` | the word occurs (case-insensitive, whole word) | its occurrences |
| ``keyword_exclude`` | the word does not occur (needs a letter) | its occurrences (violations) |
| ``letter_frequency`` | the letter occurs at least n times (case-insensitive) | its occurrences |
| ``no_commas`` | no comma of any script (needs a letter) | the commas (the violations) |
| ``lowercase`` | no uppercase letter, one cased lowercase | the uppercase letters (violations) |
| ``uppercase`` | no lowercase letter, one cased uppercase | the lowercase letters (violations) |
| ``json_format`` | the text, or a fenced block that is all of it, is JSON (no NaN) | all of it |
| ``bullet_count`` | exactly n lines start with ``* `` or ``- `` and a letter/digit | the markers |
| ``paragraph_count`` | exactly n paragraphs split by ``***`` (ends ignored) | the dividers |
| ``start_phrase`` | the stripped text starts with the phrase, a whole word | its first chars |
| ``end_phrase`` | the stripped text ends with the phrase, a whole word | its last chars |
| ``placeholders`` | at least n ``[placeholders]`` with a letter or digit | the placeholders |
| ``title`` | a title ``<<like this>>`` with a letter or digit | the titles |
| ``sections`` | exactly n header lines ``SECTION k`` (``##``, ``**`` allowed) | the headers |
| ``quotation`` | the stripped text is in double quotes, a letter/digit inside | the quotes |

Words are maximal runs of letters and digits (apostrophes inside a word allowed). An
empty or whitespace-only response satisfies no constraint. Prohibitions point at what
breaks them (empty when satisfied); prescriptions point at where the required text is, or
must be. docs/verifiers.md lists every rule and its intended differences from the IFEval
checkers.

Every check but ``json_format`` judges the text a reader sees (`visible.reading`: NFKC,
invisible characters removed, look-alike letters and commas read as what they imitate),
and `ConstraintVerifier` also sets aside each copy of one of the prompt's sentences
(`visible.drop_copies`): an answer that only repeats the prompt satisfies nothing, and the
example markup of a copied constraint sentence counts for nothing. ``json_format`` parses
the raw text (a parser reads code points, not glyphs), and refuses ``NaN`` and
``Infinity``. Content must be visible: a title, a placeholder, a bullet's text, a paragraph
and the inside of the quotes need a letter or digit. ``relevant_chars`` reads the raw
response (its offsets are the response's).
"""

from __future__ import annotations

import json
import re
import unicodedata

from .base import Span, find_fence, json_nesting_depth
from .visible import COPY, drop_copies, reading

MAX_JSON_DEPTH = 32

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
# A bullet: a marker, a blank, then text on the same line with a letter or digit.
_BULLET = re.compile(r"^[ \t]*([*-])[ \t]+(?=[^\s])(?=[^\n]*?[^\W_])", re.M)
_DIVIDER = re.compile(r"\*\*\*")
# A placeholder: 1-40 characters with a letter or digit, no brackets or line break.
_PLACEHOLDER = re.compile(r"\[(?=[^\[\]\n]*?[^\W_])[^\[\]\n]{1,40}\]")
# A title: 1-80 characters with a letter or digit, without brackets or a line break.
_TITLE = re.compile(r"<<(?=[^<>\n]*?[^\W_])[^<>\n]{1,80}>>")
# A section header: a line starting with SECTION k, optionally as a Markdown heading
# (``## SECTION 1``) or in bold/italics (``**SECTION 1**``).
_SECTION = re.compile(r"^[ \t]*(?:#{1,6}[ \t]+|\*\*|__|\*|_)?SECTION[ \t]*\d+", re.M)


def _word_re(word: str) -> re.Pattern:
    return re.compile(r"(?<![^\W_])" + re.escape(word) + r"(?![^\W_])", re.I)


def _spans_of(pattern: re.Pattern, text: str, group: int = 0) -> list[Span]:
    return [m.span(group) for m in pattern.finditer(text)]


def _has_letter(text: str) -> bool:
    return any(ch.isalpha() for ch in text)


def _has_alnum(text: str) -> bool:
    """A letter or a digit: what makes content visible (not blanks, marks or symbols)."""
    return any(ch.isalnum() for ch in text)


def _in_word(text: str, i: int, step: int) -> bool:
    """True when ``text[i]`` continues a word: a letter or digit, or an apostrophe followed
    (in the direction ``step``) by one, as in ``friend's``."""
    if not 0 <= i < len(text):
        return False
    ch = text[i]
    if ch == "'":
        j = i + step
        return 0 <= j < len(text) and text[j].isalnum()
    return ch.isalnum()


def _stripped_bounds(text: str) -> Span:
    start = len(text) - len(text.lstrip())
    end = len(text.rstrip())
    return (start, max(start, end))


class Constraint:
    """One constraint type: its prompt sentence, its check and its relevant response spans."""

    kind = ""
    raw = False  # True: `_check` reads the raw text, not `visible.reading` of it

    def sentence(self, p: dict) -> str:
        raise NotImplementedError

    def check(self, text: str, p: dict, prompt: tuple[str, ...] = ()) -> str | None:
        """None if ``text`` satisfies the constraint, else the reason it does not.

        The check reads `visible.reading` of ``text`` (``json_format``: the raw text), with
        each copy of one of the sentences ``prompt`` set aside (`visible.drop_copies`). An
        answer with nothing visible, or with no letter or digit besides its copies of the
        prompt, satisfies no constraint."""
        seen = reading(text)
        if not seen.strip():
            return "empty answer"
        if prompt:
            seen = drop_copies(seen, prompt)
            # Copies of the prompt with only blanks, quotes, brackets or other marks around
            # them: nothing of the answer's own.
            if COPY in seen and not _has_alnum(seen.replace(COPY, "")):
                return "the answer only repeats the prompt"
        return self._check(text if self.raw else seen, p)

    def _check(self, text: str, p: dict) -> str | None:
        raise NotImplementedError

    def relevant(self, text: str, p: dict) -> list[Span]:
        raise NotImplementedError


class WordCount(Constraint):
    kind = "word_count"

    def sentence(self, p):
        return f"Answer with {p['relation']} {p['n']} words."

    def _check(self, text, p):
        n = sum(1 for _ in _WORD.finditer(text))
        if p["relation"] == "at most" and not _has_letter(text):
            return "no words with letters"
        if p["relation"] == "at most" and n > p["n"]:
            return f"{n} words, more than {p['n']}"
        if p["relation"] == "at least" and n < p["n"]:
            return f"{n} words, fewer than {p['n']}"
        return None

    def relevant(self, text, p):
        return _spans_of(_WORD, text)


class KeywordInclude(Constraint):
    kind = "keyword_include"

    def sentence(self, p):
        return f'Include the word "{p["word"]}".'

    def _check(self, text, p):
        return None if _word_re(p["word"]).search(text) else f"the word {p['word']!r} is missing"

    def relevant(self, text, p):
        return _spans_of(_word_re(p["word"]), text)


class KeywordExclude(Constraint):
    kind = "keyword_exclude"

    def sentence(self, p):
        return f'Do not use the word "{p["word"]}".'

    def _check(self, text, p):
        if not _has_letter(text):
            return "no words with letters"
        return f"uses the word {p['word']!r}" if _word_re(p["word"]).search(text) else None

    def relevant(self, text, p):
        return _spans_of(_word_re(p["word"]), text)


class LetterFrequency(Constraint):
    kind = "letter_frequency"

    def sentence(self, p):
        return f'Use the letter "{p["letter"]}" at least {p["n"]} times.'

    def _check(self, text, p):
        n = text.lower().count(p["letter"].lower())
        return None if n >= p["n"] else f"letter {p['letter']!r} {n} times, fewer than {p['n']}"

    def relevant(self, text, p):
        return _spans_of(re.compile(re.escape(p["letter"]), re.I), text)


class NoCommas(Constraint):
    kind = "no_commas"

    def sentence(self, p):
        return "Do not use any commas."

    def _check(self, text, p):
        n = text.count(",")  # other scripts' commas read as "," (visible.LOOKALIKES)
        if n:
            return f"{n} commas"
        return None if _has_letter(text) else "no words with letters"

    def relevant(self, text, p):
        return [(i, i + 1) for i, ch in enumerate(text) if "," in reading(ch)]


class Lowercase(Constraint):
    kind = "lowercase"

    def sentence(self, p):
        return "Write only in lowercase letters."

    def _check(self, text, p):
        # An uppercase or titlecase letter by its category too, whether or not lower-casing
        # changes it.
        if text != text.lower() or any(unicodedata.category(ch) in ("Lu", "Lt") for ch in text):
            return "contains uppercase letters"
        # At least one letter that has case: digits, symbols or caseless scripts alone
        # are not "lowercase".
        return None if any(ch != ch.upper() for ch in text) else "no lowercase letter"

    def relevant(self, text, p):
        return [(i, i + 1) for i, ch in enumerate(text) if ch != ch.lower()]


class Uppercase(Constraint):
    kind = "uppercase"

    def sentence(self, p):
        return "Write only in capital letters."

    def _check(self, text, p):
        if text != text.upper() or any(unicodedata.category(ch) in ("Ll", "Lt") for ch in text):
            return "contains lowercase letters"
        return None if any(ch != ch.lower() for ch in text) else "no uppercase letter"

    def relevant(self, text, p):
        return [(i, i + 1) for i, ch in enumerate(text) if ch != ch.upper()]


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class JsonFormat(Constraint):
    kind = "json_format"
    raw = True  # a JSON parser reads code points: fullwidth braces are not braces

    def sentence(self, p):
        return "Wrap your whole answer in JSON."

    def _check(self, text, p):
        t = text.strip()
        if t.startswith("```"):
            fence = find_fence(t)
            if fence is None or not fence.closed or fence.end != len(t):
                return "text after the fenced block, or the fence is not closed"
            if fence.lang.lower() not in ("", "json"):
                return f"fence language {fence.lang[:20]!r}, expected json or none"
            body = fence.body.strip()
        elif t.endswith("```"):
            return "a closing fence without an opening one"
        else:
            body = t
        if not body:
            return "empty answer"
        if json_nesting_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        try:
            json.loads(body, parse_constant=_no_constant)  # NaN, Infinity: not JSON
        except (ValueError, RecursionError) as e:
            return f"not valid JSON: {str(e)[:80]}"
        return None

    def relevant(self, text, p):
        s, e = _stripped_bounds(text)
        return [(s, e)] if e > s else []


class BulletCount(Constraint):
    kind = "bullet_count"

    def sentence(self, p):
        return f'Use exactly {p["n"]} bullet points like "* item".'

    def _check(self, text, p):
        n = sum(1 for _ in _BULLET.finditer(text))
        return None if n == p["n"] else f"{n} bullet points, expected {p['n']}"

    def relevant(self, text, p):
        return _spans_of(_BULLET, text, 1)


class ParagraphCount(Constraint):
    kind = "paragraph_count"

    def sentence(self, p):
        return f'Write exactly {p["n"]} paragraphs separated by "***".'

    def _check(self, text, p):
        parts = _DIVIDER.split(text)
        # A divider at the very start or end does not open an empty paragraph.
        if len(parts) > 1 and not parts[-1].strip():
            parts.pop()
        if len(parts) > 1 and not parts[0].strip():
            parts.pop(0)
        if any(not _has_alnum(part) for part in parts):
            return "a paragraph without a letter or digit"
        return None if len(parts) == p["n"] else f"{len(parts)} paragraphs, expected {p['n']}"

    def relevant(self, text, p):
        return _spans_of(_DIVIDER, text)


class StartPhrase(Constraint):
    kind = "start_phrase"

    def sentence(self, p):
        return f'Start your answer with "{p["phrase"]}".'

    def _check(self, text, p):
        t, phrase = text.lstrip(), p["phrase"]
        if not t.startswith(phrase):
            return "does not start with the phrase"
        if phrase[-1:].isalnum() and _in_word(t, len(phrase), 1):
            return "starts with the phrase inside a longer word"
        return None

    def relevant(self, text, p):
        s, e = _stripped_bounds(text)
        return [(s, min(e, s + len(p["phrase"])))] if e > s else []


class EndPhrase(Constraint):
    kind = "end_phrase"

    def sentence(self, p):
        return f'End your answer with "{p["phrase"]}".'

    def _check(self, text, p):
        t, phrase = text.rstrip(), p["phrase"]
        if not t.endswith(phrase):
            return "does not end with the phrase"
        if phrase[:1].isalnum() and _in_word(t, len(t) - len(phrase) - 1, -1):
            return "ends with the phrase inside a longer word"
        return None

    def relevant(self, text, p):
        s, e = _stripped_bounds(text)
        return [(max(s, e - len(p["phrase"])), e)] if e > s else []


class Placeholders(Constraint):
    kind = "placeholders"

    def sentence(self, p):
        noun = "placeholder" if p["n"] == 1 else "placeholders"
        return f"Include at least {p['n']} {noun} in square brackets like [name]."

    def _check(self, text, p):
        n = sum(1 for _ in _PLACEHOLDER.finditer(text))
        return None if n >= p["n"] else f"{n} placeholders, fewer than {p['n']}"

    def relevant(self, text, p):
        return _spans_of(_PLACEHOLDER, text)


class Title(Constraint):
    kind = "title"

    def sentence(self, p):
        return "Give your answer a title in double angular brackets like <<title>>."

    def _check(self, text, p):
        return None if _TITLE.search(text) else "no <<title>>"

    def relevant(self, text, p):
        return _spans_of(_TITLE, text)


class Sections(Constraint):
    kind = "sections"

    def sentence(self, p):
        return f'Divide your answer into {p["n"]} sections that start with "SECTION X".'

    def _check(self, text, p):
        n = sum(1 for _ in _SECTION.finditer(text))
        return None if n == p["n"] else f"{n} sections, expected {p['n']}"

    def relevant(self, text, p):
        return _spans_of(_SECTION, text)


class Quotation(Constraint):
    kind = "quotation"

    def sentence(self, p):
        return "Wrap your whole answer in double quotes."

    def _check(self, text, p):
        t = text.strip()
        ok = len(t) >= 2 and t[0] == '"' and t[-1] == '"'
        if not ok:
            return "not wrapped in double quotes"
        return None if _has_alnum(t[1:-1]) else "no letter or digit inside the quotes"

    def relevant(self, text, p):
        s, e = _stripped_bounds(text)
        if e - s < 2:
            return [(s, e)] if e > s else []
        return [(s, s + 1), (e - 1, e)]


CONSTRAINTS: dict[str, Constraint] = {
    c.kind: c
    for c in (
        WordCount(),
        KeywordInclude(),
        KeywordExclude(),
        LetterFrequency(),
        NoCommas(),
        Lowercase(),
        Uppercase(),
        JsonFormat(),
        BulletCount(),
        ParagraphCount(),
        StartPhrase(),
        EndPhrase(),
        Placeholders(),
        Title(),
        Sections(),
        Quotation(),
    )
}
KINDS = tuple(CONSTRAINTS)
