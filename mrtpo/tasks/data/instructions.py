"""The built-in instruction-following data: prompts composed from constraint templates.

A prompt is a short base instruction ("Write a short note about the sea.") followed by
constraint sentences (a fixed list, or 2-4 drawn kinds unless ``n_kinds`` says otherwise).
The gold response is assembled from closed word lists so that
it satisfies every constraint by construction (and is checked against every verifier);
count-like parameters (word bounds, letter counts, excluded words) are then chosen to
agree with it. Everything is lowercase prose of a few dozen words over a vocabulary of
a few hundred words, so that a tiny model trained from scratch can learn it.
"""

from __future__ import annotations

import json
import random
import re

from mrtpo.verifiers.base import Example
from mrtpo.verifiers.constraints import CONSTRAINTS, KINDS, describe

TOPICS: dict[str, list[str]] = {
    "the sea": ["the sea is wide and calm.", "waves roll on the sand.", "boats sail at dawn."],
    "a forest": [
        "the forest is dark and deep.",
        "tall trees hide the sky.",
        "birds sing in the oaks.",
    ],
    "the city": ["the city never sleeps.", "streets are full of cars.", "lights shine all night."],
    "a cat": ["my cat sleeps all day.", "she likes warm milk.", "her fur is soft."],
    "the moon": ["the moon is pale tonight.", "it pulls the tides.", "it shines on the lake."],
    "a garden": ["the garden is in bloom.", "roses grow by the wall.", "bees visit every flower."],
    "the rain": ["the rain falls softly.", "roofs drip all evening.", "puddles fill the road."],
    "a train": ["the train leaves at noon.", "it runs along the coast.", "people read on board."],
    "a song": ["the song is short and sweet.", "it has a simple tune.", "we sing it at night."],
    "the winter": ["winter days are short.", "snow covers the hills.", "we stay by the fire."],
    "a book": ["the book is old and thin.", "it tells a long story.", "i read it every year."],
    "the market": ["the market opens early.", "farmers sell fresh bread.", "the square gets busy."],
}
START_PHRASES = ["dear friend", "hello there", "good news", "listen well", "in short", "to begin"]
END_PHRASES = [
    "that is all",
    "see you soon",
    "the end",
    "best wishes",
    "thank you",
    "until next time",
]
KEYWORDS = [
    "river",
    "light",
    "green",
    "music",
    "quiet",
    "bright",
    "stone",
    "happy",
    "silver",
    "gentle",
    "golden",
    "paper",
    "window",
    "morning",
    "purple",
    "honey",
]
PLACEHOLDER_NAMES = ["name", "place", "date", "time"]

DEFAULT_KINDS = ("start_phrase", "keyword_include", "end_phrase")

# Pairs that cannot hold together, or that this simple composer does not combine.
_STRUCTURE = ("bullet_count", "paragraph_count", "sections")
_CONFLICTS = {
    frozenset(p)
    for p in [
        ("lowercase", "uppercase"),
        ("lowercase", "sections"),
        ("uppercase", "start_phrase"),
        ("uppercase", "end_phrase"),
        ("title", "start_phrase"),
        ("json_format", "uppercase"),
        *[("json_format", k) for k in ("title", "start_phrase", "end_phrase", "quotation")],
        *[("json_format", k) for k in _STRUCTURE],
        *[("quotation", k) for k in ("title", "start_phrase", "end_phrase", *_STRUCTURE)],
        *[(a, b) for a in _STRUCTURE for b in _STRUCTURE if a != b],
    ]
}


def compatible(kinds: list[str] | tuple[str, ...]) -> bool:
    """True when no two of ``kinds`` conflict (and none repeats)."""
    if len(set(kinds)) != len(kinds):
        return False
    return all(
        frozenset((a, b)) not in _CONFLICTS for i, a in enumerate(kinds) for b in kinds[i + 1 :]
    )


def _sample_kinds(rng: random.Random, low: int, high: int) -> list[str]:
    while True:
        kinds = rng.sample(KINDS, rng.randint(low, high))
        if compatible(kinds):
            return kinds


def _compose(rng: random.Random, topic: str, kinds: list[str]) -> tuple[str, dict[str, dict]]:
    """A gold response satisfying ``kinds`` and the parameters of each constraint."""
    p: dict[str, dict] = {}
    sentences = TOPICS[topic]
    n_units = 1
    for k in _STRUCTURE:
        if k in kinds:
            n_units = rng.randint(2, 3)
            p[k] = {"n": n_units}
    units = [sentences[i % len(sentences)] for i in range(n_units)]
    if n_units == 1 and rng.random() < 0.5:
        units = [" ".join(rng.sample(sentences, 2))]
    extra = []
    if "keyword_include" in kinds:
        word = rng.choice(KEYWORDS)
        p["keyword_include"] = {"word": word}
        extra.append(f"i think of {word}.")
    if "placeholders" in kinds:
        n = rng.randint(1, 2)
        names = rng.sample(PLACEHOLDER_NAMES, n)
        p["placeholders"] = {"n": n}
        extra.append("ask " + " at ".join(f"[{x}]" for x in names) + ".")
    if extra:
        units[-1] = units[-1] + " " + " ".join(extra)

    if "bullet_count" in kinds:
        body = "\n".join(f"* {u}" for u in units)
    elif "sections" in kinds:
        body = "\n".join(f"SECTION {i + 1}\n{u}" for i, u in enumerate(units))
    elif "paragraph_count" in kinds:
        body = "\n***\n".join(units)
    else:
        body = units[0]
    sep = "\n" if n_units > 1 else " "
    text = body
    if "start_phrase" in kinds:
        phrase = rng.choice(START_PHRASES)
        p["start_phrase"] = {"phrase": phrase}
        text = f"{phrase}.{sep}{text}"
    if "end_phrase" in kinds:
        phrase = rng.choice(END_PHRASES)
        p["end_phrase"] = {"phrase": phrase}
        text = f"{text}{sep}{phrase}"
    if "title" in kinds:
        p["title"] = {}
        text = f"<<{topic}>>\n{text}"
    if "uppercase" in kinds:
        p["uppercase"] = {}
        text = text.upper()
    if "lowercase" in kinds:
        p["lowercase"] = {}
        text = text.lower()
    if "quotation" in kinds:
        p["quotation"] = {}
        text = f'"{text}"'
    if "json_format" in kinds:
        p["json_format"] = {}
        text = json.dumps({"answer": text})
    if "no_commas" in kinds:
        p["no_commas"] = {}
        text = text.replace(",", "")

    # Parameters chosen to agree with the finished text.
    if "word_count" in kinds:
        n = len(CONSTRAINTS["word_count"].relevant(text, {}))
        if rng.random() < 0.5:
            p["word_count"] = {"relation": "at most", "n": n + rng.randint(0, 5)}
        else:
            p["word_count"] = {"relation": "at least", "n": max(1, n - rng.randint(0, 5))}
    if "letter_frequency" in kinds:
        low = text.lower()
        letters = sorted({c for c in low if "a" <= c <= "z" and low.count(c) >= 2})
        letter = rng.choice(letters)
        p["letter_frequency"] = {"letter": letter, "n": rng.randint(2, min(6, low.count(letter)))}
    if "keyword_exclude" in kinds:
        words = set(text.lower().split())
        p["keyword_exclude"] = {"word": rng.choice([w for w in KEYWORDS if w not in words])}
    return text, p


def make_examples(
    rng: random.Random,
    n: int,
    *,
    kinds: tuple[str, ...] | None = DEFAULT_KINDS,
    shuffle_constraints: bool = False,
    id_prefix: str = "constraints",
    max_tries: int = 100,
    n_kinds: tuple[int, int] = (2, 4),
    instruction: str = "Write a short note about {topic}.",
) -> list[Example]:
    """``n`` examples. With ``kinds``, every example has exactly those constraints, in that
    order unless ``shuffle_constraints``; with ``kinds=None`` each draws between
    ``n_kinds[0]`` and ``n_kinds[1]`` compatible kinds (inclusive). ``instruction`` is the
    base request before the constraint sentences (``{topic}`` filled in).

    ``fields["constraints"]`` lists ``{"kind", "params", "span"}`` in prompt order.
    """
    if kinds is not None:
        unknown = [k for k in kinds if k not in CONSTRAINTS]
        if unknown:
            raise ValueError(
                f"kinds: unknown constraint types {unknown}; known: {', '.join(KINDS)}"
            )
        if not compatible(tuple(kinds)):
            raise ValueError(f"kinds: {kinds} cannot all hold at once")
    low, high = n_kinds
    if not 1 <= low <= high <= len(KINDS):
        raise ValueError(f"n_kinds: expected 1 <= low <= high <= {len(KINDS)}, got {n_kinds!r}")
    out: list[Example] = []
    for i in range(n):
        for _ in range(max_tries):
            chosen = list(kinds) if kinds is not None else _sample_kinds(rng, low, high)
            if shuffle_constraints:
                rng.shuffle(chosen)
            topic = rng.choice(sorted(TOPICS))
            gold, params = _compose(rng, topic, chosen)
            if all(CONSTRAINTS[k].check(gold, params[k]) is None for k in chosen):
                break
        else:
            raise RuntimeError(f"could not compose a gold response for {chosen}")
        prompt = instruction.format(topic=topic)
        entries = []
        for k in chosen:
            sentence = describe(k, params[k])
            start = len(prompt) + 1
            prompt = f"{prompt} {sentence}"
            entries.append({"kind": k, "params": params[k], "span": [start, start + len(sentence)]})
        out.append(
            Example(
                id=f"{id_prefix}-{i}",
                prompt=prompt,
                fields={"topic": topic, "constraints": entries},
                reference=gold,
            )
        )
    return out


# The parameter of each kind that a reference can get wrong while keeping its form, and the
# values to draw a wrong one from (the warm start's data mix, `noisy_reference`).
_SWAPPABLE = {
    "start_phrase": ("phrase", START_PHRASES),
    "end_phrase": ("phrase", END_PHRASES),
    "keyword_include": ("word", KEYWORDS),
}
NOISY_KINDS = tuple(_SWAPPABLE)


def noisy_reference(rng: random.Random, example: Example, p_wrong: float) -> str:
    """``example``'s gold response with, independently for each of its constraints whose
    kind is in ``NOISY_KINDS``, probability ``p_wrong`` of that constraint's parameter (the
    start phrase, the keyword, the end phrase) replaced by another value of the same kind:
    the response keeps its form and fails exactly the constraints drawn. A supervised warm
    start on such references passes each of those constraints about 1 - p_wrong of the time
    (a model that has the behaviour but not yet reliably), which calibrates the rewards'
    starting pass rates without changing the task. Other kinds are left as they are."""
    if not 0.0 <= p_wrong <= 1.0:
        raise ValueError(f"p_wrong: expected a probability in [0, 1], got {p_wrong!r}")
    text = example.reference
    if text is None:
        raise ValueError(f"example: {example.id!r} has no gold reference")
    entries = example.fields.get("constraints", [])
    for entry in entries:
        kind = entry["kind"]
        if kind not in _SWAPPABLE or rng.random() >= p_wrong:
            continue
        key, values = _SWAPPABLE[kind]
        right = entry["params"][key]
        # fails this one, keeps every other verdict
        wanted = [
            e is not entry and CONSTRAINTS[e["kind"]].check(text, e["params"]) is None
            for e in entries
        ]
        for wrong in rng.sample([x for x in values if x != right], len(values) - 1):
            cand = _swap(text, kind, right, wrong)
            if cand is None:
                break
            verdicts = [CONSTRAINTS[e["kind"]].check(cand, e["params"]) is None for e in entries]
            if verdicts == wanted:
                text = cand
                break
    return text


def _swap(text: str, kind: str, right: str, wrong: str) -> str | None:
    """``text`` with the occurrence of ``right`` that ``kind`` checks (any letter case; the
    replacement takes the case of what it replaces) replaced by ``wrong``; None if absent."""
    found = list(re.finditer(rf"\b{re.escape(right)}\b", text, flags=re.IGNORECASE))
    if not found:
        return None
    if kind == "start_phrase":
        found = found[:1]
    elif kind == "end_phrase":
        found = found[-1:]
    # keyword_include: every whole-word occurrence (the gold says it once: "i think of X.")
    for m in reversed(found):
        new = wrong.upper() if m.group().isupper() else wrong
        text = text[: m.start()] + new + text[m.end() :]
    return text
