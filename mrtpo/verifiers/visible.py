"""The text a reader sees: what the constraint verifiers judge instead of the raw code points.

A response can look like one thing and be another to a naive check: a zero-width space or a
soft hyphen splits a banned word (``ri\\u200bver``) and fills an otherwise empty title
(``<<\\u200b>>``); a Cyrillic ``е`` or a Lisu ``ꓧ`` looks like a Latin letter and hides
from a keyword or a case check; an Arabic or ideographic comma is a comma to the reader and
not to ``","``; and a response that copies the prompt's constraint sentences back carries
their example markup (``<<title>>``, ``[name]``, the keyword itself) without doing anything.

`reading(text)` is what the verifiers judge:

1. every invisible character removed: Unicode's format controls (category Cf: zero-width
   space and joiners, soft hyphen, byte-order mark, bidirectional controls, tags, ...) and
   the other default-ignorable code points (variation selectors, Hangul fillers, the
   combining grapheme joiner, ...);
2. every look-alike in `LOOKALIKES` replaced by what it imitates: letters of other scripts
   (Cyrillic, Greek, Armenian, Cherokee, Lisu), Latin small capitals and dotless i/j become
   the Latin letters they look like, other scripts' commas become ``,`` and the braille
   blank a space;
3. NFKC normalization (fullwidth, mathematical, circled, superscript and ligature forms
   become the plain letters, digits and punctuation they stand for), then steps 1-2 again
   (NFKC turns a few look-alikes into other ones: the lunate sigma ``ϲ`` into ``ς``);
4. NFC normalization (a replaced letter may compose with a following accent).

ASCII text is returned as it is. `drop_copies(seen, pieces)` then replaces each copy of a
prompt sentence (its words in order; case, blanks and punctuation aside) with `COPY`, a
character that is no letter, digit, whitespace or markup: the copy counts for nothing, and
an answer that starts or ends with one does not start or end with anything else.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

COPY = "\ufffc"  # OBJECT REPLACEMENT CHARACTER: stands for a copied prompt sentence

# Default-ignorable code points outside category Cf (Unicode's DerivedCoreProperties), which
# a renderer shows as nothing.
_IGNORABLE_RANGES = (
    (0x034F, 0x034F),  # combining grapheme joiner
    (0x115F, 0x1160),  # Hangul choseong and jungseong fillers
    (0x17B4, 0x17B5),  # Khmer inherent vowels
    (0x180B, 0x180F),  # Mongolian free variation selectors and vowel separator
    (0x3164, 0x3164),  # Hangul filler
    (0xFE00, 0xFE0F),  # variation selectors
    (0xFFA0, 0xFFA0),  # halfwidth Hangul filler
    (0xFFF0, 0xFFF8),  # unassigned specials
    (0x1D173, 0x1D17A),  # musical symbol format controls
    (0xE0000, 0xE0FFF),  # tags and variation selectors supplement
)


def _table(pairs: str) -> dict[str, str]:
    """``"аa еe"`` -> ``{"а": "a", "е": "e"}``: each item is a look-alike, then its reading."""
    return {item[0]: item[1:] for item in pairs.split()}


_CHEROKEE = _table("ᎪA ᏴB ᏟC ᎠD ᎬE ᏀG ᎻH ᏦK ᏞL ᎷM ᏢP ᏒR ᏚS ᎢT ᏙV ᏔW ᏃZ")

# Letters that look like Latin letters, by script. Upper and lower case are listed apart:
# a look-alike reads as the Latin letter of the case it shows.
LOOKALIKES: dict[str, str] = {
    # Cyrillic
    **_table(
        "аa еe ёë һh іi їï јj оo рp сc уy хx ѕs ԁd ԛq ԝw ӏl "
        "АA ВB ЕE ЅS ІI ЈJ КK МM НH ОO РP СC ТT ХX УY ҮY ԚQ ԜW ӀI"
    ),
    # Greek
    **_table("ΑA ΒB ΕE ΖZ ΗH ΙI ΚK ΜM ΝN ΟO ΡP ΤT ΥY ΧX ϜF οo νv ιi αa ρp υu κk χx γy ϲc ϳj"),
    # Armenian
    **_table("օo սu ոn հh զq ցg ՍU ՕO"),
    # Latin letters that pass for others: dotless i and j, script a and g, small capitals
    **_table("ıi ȷj ɑa ɡg ɩi ᴀA ʙB ᴄC ᴅD ᴇE ɢG ʜH ɪI ᴊJ ᴋK ʟL ᴍM ɴN ᴏO ᴘP ʀR ꜱS ᴛT ᴜU ᴠV ᴡW ʏY ᴢZ"),
    # Cherokee (capital letters; their small forms are small capitals of the same shape)
    **_CHEROKEE,
    **{c.lower(): v for c, v in _CHEROKEE.items()},
    # Lisu (caseless letters shaped like Latin capitals)
    **_table("ꓐB ꓑP ꓓD ꓔT ꓖG ꓗK ꓙJ ꓚC ꓜZ ꓝF ꓟM ꓠN ꓡL ꓢS ꓣR ꓦV ꓧH ꓪW ꓫX ꓬY ꓮA ꓰE ꓲI ꓳO ꓴU"),
    # A blank that is not whitespace to Python (braille pattern blank): a space to a reader
    "\u2800": " ",
    # Commas of other scripts, and marks shaped like a comma (after NFKC, which already maps
    # the fullwidth, small and vertical presentation forms to ",").
    **dict.fromkeys(
        "\u055d\u060c\u066b\u066c\u07f8\u1363\u1802\u1808\u201a\u2e32\u2e34\u2e41\u2e49"
        "\u2e4c\u3001\ua4fe\ua60d\ua6f5\U0001144d\U0001145a\U00016e97\U0001da87",
        ",",
    ),
}


class _ReadTable(dict):
    """`str.translate` table: invisible characters to None, look-alikes to their reading;
    filled on first sight of each code point (at most `_MAX_KEPT` remembered)."""

    _MAX_KEPT = 1 << 16

    def __missing__(self, code: int):
        ch = chr(code)
        if unicodedata.category(ch) == "Cf" or any(a <= code <= b for a, b in _IGNORABLE_RANGES):
            out = None
        else:
            out = LOOKALIKES.get(ch, code)
        if len(self) < self._MAX_KEPT:
            self[code] = out
        return out


_READ = _ReadTable()


def reading(text: str) -> str:
    """``text`` as a reader sees it (see the module docstring); ASCII comes back unchanged."""
    if text.isascii():
        return text
    # Look-alikes before NFKC too: NFKC turns some (the lunate sigma, which looks like c)
    # into letters that look like nothing Latin.
    text = unicodedata.normalize("NFKC", text.translate(_READ)).translate(_READ)
    return unicodedata.normalize("NFC", text)


_WORDS = re.compile(r"[^\W_]+")


@lru_cache(maxsize=1024)
def _copies_pattern(pieces: tuple[str, ...]) -> re.Pattern | None:
    alternatives = []
    for piece in sorted(set(pieces), key=len, reverse=True):
        words = _WORDS.findall(reading(piece))
        if len(words) < 2:  # a single word is no sentence: it may be the answer's own
            continue
        # The sentence's words in order, whole, with anything but letters and digits (or
        # nothing) between them, then the punctuation or markup right after the last one
        # ("***"., <<title>>.): a copy with its quotes, periods or spaces changed, removed
        # or swapped for invisible characters (which `reading` drops) is still a copy.
        alternatives.append(
            r"(?<![^\W_])" + r"[\W_]*?".join(map(re.escape, words)) + r"(?![^\W_])(?:\s*[^\w\s]+)?"
        )
    if not alternatives:
        return None
    return re.compile("|".join(alternatives), re.IGNORECASE)


def drop_copies(seen: str, pieces: tuple[str, ...]) -> str:
    """``seen`` (a `reading`) with each copy of one of the prompt sentences ``pieces``
    replaced by `COPY`. A copy is the sentence's words, whole and in order, in any letter
    case, with anything but letters and digits (or nothing) between them, and the
    punctuation or markup that follows the last word."""
    pattern = _copies_pattern(pieces)
    return seen if pattern is None else pattern.sub(COPY, seen)


def prompt_pieces(prompt: str, spans) -> tuple[str, ...]:
    """The sentences of ``prompt`` that a response must not get credit for copying: each
    span (the constraint sentences) and the text between them (the instruction), stripped."""
    bounds = sorted((int(s), int(e)) for s, e in spans)
    pieces, pos = [], 0
    for s, e in bounds:
        pieces.append(prompt[pos:s])
        pieces.append(prompt[s:e])
        pos = max(pos, e)
    pieces.append(prompt[pos:])
    return tuple(p.strip() for p in pieces if p.strip())
