"""The built-in tool-calling data: tool definitions (JSON schemas) and request templates.

`TOOLS` maps a tool name to its description and the JSON schema of its arguments.
`signature(name)` renders the one-line signature shown in prompts. `sample_request(rng)`
draws a request in plain words with its gold call; everything is small and closed-vocabulary
so that a tiny model can learn it.
"""

from __future__ import annotations

import json
import random

_STR = {"type": "string", "minLength": 1, "maxLength": 60}
_CITY = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Oslo", "Prague"]
_PEOPLE = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gia", "Hugo"]
_ARTISTS = ["Bach", "Mozart", "Chopin", "Verdi", "Haydn", "Brahms"]
_RESTAURANTS = ["Luigi", "Sakura", "Bistro", "Taverna", "Dragon"]
_LANGS = ["french", "german", "spanish", "italian"]
_CURRENCIES = ["EUR", "USD", "GBP", "JPY", "CHF"]
_TASKS = ["buy milk", "call mom", "pay rent", "water plants", "clean desk", "book dentist"]
_TEXTS = ["good morning", "thank you", "see you soon", "where is the station", "i am hungry"]


def _obj(props: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


TOOLS: dict[str, dict] = {
    "get_weather": {
        "description": "current weather in a city",
        "parameters": _obj(
            {"city": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            ["city", "unit"],
        ),
    },
    "set_alarm": {
        "description": "set an alarm clock",
        "parameters": _obj(
            {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            },
            ["hour", "minute"],
        ),
    },
    "set_timer": {
        "description": "start a countdown timer",
        "parameters": _obj(
            {"minutes": {"type": "integer", "minimum": 1, "maximum": 180}}, ["minutes"]
        ),
    },
    "convert_currency": {
        "description": "convert money between currencies",
        "parameters": _obj(
            {
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "source": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "target": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
            ["amount", "source", "target"],
        ),
    },
    "send_message": {
        "description": "send a text message to a contact",
        "parameters": _obj({"to": _STR, "text": _STR}, ["to", "text"]),
    },
    "add_todo": {
        "description": "add an item to the to-do list",
        "parameters": _obj(
            {"title": _STR, "priority": {"type": "string", "enum": ["low", "medium", "high"]}},
            ["title", "priority"],
        ),
    },
    "play_music": {
        "description": "play music by an artist",
        "parameters": _obj(
            {"artist": _STR, "volume": {"type": "integer", "minimum": 0, "maximum": 10}},
            ["artist"],
        ),
    },
    "book_table": {
        "description": "book a table at a restaurant",
        "parameters": _obj(
            {
                "restaurant": _STR,
                "people": {"type": "integer", "minimum": 1, "maximum": 20},
                "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            },
            ["restaurant", "people", "time"],
        ),
    },
    "translate": {
        "description": "translate a short text",
        "parameters": _obj(
            {"text": _STR, "language": {"type": "string", "enum": _LANGS}}, ["text", "language"]
        ),
    },
}


def signature(name: str) -> str:
    """One line: ``name(arg: type, opt?: type, e: "a" | "b") - description``."""
    return signature_line(name, TOOLS[name]["description"], TOOLS[name]["parameters"])


def signature_line(name: str, description: str, parameters: dict) -> str:
    """The one-line signature of a function whose arguments follow the JSON schema
    ``parameters`` (an object): ``name(arg: type, opt?: type, e: "a" | "b") - description``.
    Arrays read ``array[item type]``, objects with properties ``{key: type, ...}``, a value
    of no declared type ``any``."""
    return f"{name}({_fields(parameters)}) - {description}"


def _fields(schema: dict) -> str:
    required = set(schema.get("required", ()))
    return ", ".join(
        f"{arg}{'' if arg in required else '?'}: {_kind(spec)}"
        for arg, spec in schema.get("properties", {}).items()
    )


def _kind(spec: dict) -> str:
    if "enum" in spec:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in spec["enum"])
    kind = spec.get("type", "any")
    if kind == "array" and "items" in spec:
        return f"array[{_kind(spec['items'])}]"
    if kind == "object" and spec.get("properties"):
        return "{" + _fields(spec) + "}"
    return kind


def sample_request(rng: random.Random) -> tuple[str, dict]:
    """A request in words and its gold call ``{"name": ..., "arguments": {...}}``."""
    name = rng.choice(sorted(TOOLS))
    if name == "get_weather":
        city, unit = rng.choice(_CITY), rng.choice(["celsius", "fahrenheit"])
        text = rng.choice(
            [
                f"What is the weather in {city} in {unit}?",
                f"Tell me the {unit} temperature in {city}.",
            ]
        )
        args = {"city": city, "unit": unit}
    elif name == "set_alarm":
        h, m = rng.randint(0, 23), rng.choice([0, 5, 10, 15, 20, 30, 40, 45, 50])
        text = rng.choice([f"Wake me up at {h}:{m:02d}.", f"Set an alarm for {h}:{m:02d}."])
        args = {"hour": h, "minute": m}
    elif name == "set_timer":
        n = rng.choice([1, 2, 3, 5, 10, 12, 15, 20, 25, 30, 45, 60, 90])
        text = rng.choice([f"Start a timer for {n} minutes.", f"Count down {n} minutes."])
        args = {"minutes": n}
    elif name == "convert_currency":
        amount = rng.choice([5, 10, 20, 50, 100, 250, 1000, 12.5])
        src, dst = rng.sample(_CURRENCIES, 2)
        text = rng.choice(
            [f"Convert {amount} {src} to {dst}.", f"How much is {amount} {src} in {dst}?"]
        )
        args = {"amount": amount, "source": src, "target": dst}
    elif name == "send_message":
        who, what = rng.choice(_PEOPLE), rng.choice(_TEXTS)
        text = rng.choice([f"Text {who}: {what}.", f"Send {who} the message '{what}'."])
        args = {"to": who, "text": what}
    elif name == "add_todo":
        task, prio = rng.choice(_TASKS), rng.choice(["low", "medium", "high"])
        text = rng.choice(
            [
                f"Add '{task}' to my list with {prio} priority.",
                f"Remind me to {task}, {prio} priority.",
            ]
        )
        args = {"title": task, "priority": prio}
    elif name == "play_music":
        artist = rng.choice(_ARTISTS)
        if rng.random() < 0.5:
            vol = rng.randint(1, 10)
            text = f"Play some {artist} at volume {vol}."
            args = {"artist": artist, "volume": vol}
        else:
            text = rng.choice([f"Play some {artist}.", f"I want to hear {artist}."])
            args = {"artist": artist}
    elif name == "book_table":
        place, people = rng.choice(_RESTAURANTS), rng.randint(1, 8)
        time = f"{rng.randint(17, 22)}:{rng.choice([0, 15, 30, 45]):02d}"
        text = rng.choice(
            [
                f"Book a table for {people} at {place} at {time}.",
                f"Reserve {place} for {people} people at {time}.",
            ]
        )
        args = {"restaurant": place, "people": people, "time": time}
    else:  # translate
        what, lang = rng.choice(_TEXTS), rng.choice(_LANGS)
        text = rng.choice(
            [f"Translate '{what}' into {lang}.", f"How do you say '{what}' in {lang}?"]
        )
        args = {"text": what, "language": lang}
    return text, {"name": name, "arguments": args}
