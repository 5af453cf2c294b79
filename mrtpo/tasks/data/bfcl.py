"""The Berkeley Function Calling Leaderboard's simple Python cases, as tool-calling cases
the project's tool verifiers can score (the ``tools-bfcl`` task, `mrtpo.tasks.builtin`).

The cases are read, offline, from the data files inside the ``bfcl-eval`` wheel
(`DIST_VERSION`; the [real] extra, installed with --no-deps by requirements-real.txt):
`QUESTIONS` holds one JSON case a line (a user question and the one function it is about:
name, description, parameters in BFCL's schema dialect) and `ANSWERS` the acceptable
values of each parameter (a list; ``""`` in it: the parameter may be left out). The
package is located without being imported (its ``__init__`` imports packages this project
does not need), as `mrtpo.model.builtin` locates the built-in model's GGUF file.

Each case becomes a `Case`:

- ``parameters``: BFCL's schema as JSON Schema. ``dict`` reads ``object`` (the top level
  with ``additionalProperties: false``), ``float`` ``number``, ``tuple`` ``array`` (JSON
  has no tuple), ``any`` no type at all; ``integer``, ``string``, ``boolean`` and
  ``array`` are the same. ``properties``, ``required``, ``items`` and ``enum`` are kept;
  descriptions, defaults and BFCL's ``optional`` flag are dropped (the prompt shows none of
  them; an optional parameter is one not in ``required``).
- ``arguments_any``: per parameter, the acceptable values as plain JSON values. A
  dict-valued answer lists the acceptable values of each of its keys in turn (BFCL's
  nesting); it is expanded into every whole dict it allows (at most `MAX_ALTERNATIVES`).
- ``optional``: the parameters the call may leave out (``""`` among their answers).

Where the schema shown and the answer list disagree, the schema wins, so that no verdict
contradicts another: a value that breaks its parameter's schema is dropped (it would pass
``tool_args`` and fail ``tool_schema``; 4 values in 3 cases of `DIST_VERSION`: a string
parameter answered ``true``, a list of strings answered with a list of lists, two
lower-case or abbreviated values outside an enum), and ``""`` is ignored for a parameter
the schema requires (leaving it out fails ``tool_schema``; 2 cases). A case whose answers
then leave a parameter it may not omit without a value is skipped, as is one whose schema
or answers use anything not described above; none of the 400 is (`N_CASES` load,
`SKIPPED` is empty; `load_cases` returns the reasons where another version differs).

String values are compared exactly; BFCL's own checker also forgives case and some
punctuation, so ``tool_args`` is the stricter of the two.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from mrtpo.verifiers.tools import validate_arguments

PACKAGE = "bfcl_eval"  # import name that holds the data files
DIST = "bfcl-eval"  # distribution name (pip)
DIST_VERSION = "2026.3.23"
QUESTIONS = "data/BFCL_v4_simple_python.json"
ANSWERS = "data/possible_answer/BFCL_v4_simple_python.json"
N_CASES = 400  # cases in the files of DIST_VERSION, all loaded
SKIPPED: dict[str, str] = {}  # case id -> why, for DIST_VERSION (load_cases recounts)
MAX_ALTERNATIVES = 64  # whole values one parameter may expand into

_TYPES = {
    "dict": "object",
    "integer": "integer",
    "float": "number",
    "string": "string",
    "boolean": "boolean",
    "array": "array",
    "tuple": "array",
    "any": None,
}
_OMIT = ""  # in an answer list: the parameter may be left out


class UnsupportedCase(ValueError):
    """A BFCL case this module cannot express as a schema and acceptable values."""


@dataclass(frozen=True)
class Case:
    id: str
    question: str
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments (an object)
    arguments_any: dict[str, list] = field(default_factory=dict)
    optional: tuple[str, ...] = ()

    def gold(self) -> dict:
        """The gold call as `mrtpo.verifiers.tools` reads it (``arguments_any`` form)."""
        return {
            "name": self.name,
            "arguments_any": {k: list(v) for k, v in self.arguments_any.items()},
            "optional": list(self.optional),
        }

    def reference(self) -> dict:
        """One right call: the first acceptable value of every parameter that may not be
        left out, ``{"name": ..., "arguments": {...}}``."""
        args = {k: v[0] for k, v in self.arguments_any.items() if k not in self.optional}
        return {"name": self.name, "arguments": args}


def install_hint() -> str:
    return (
        f"install the project's [real] extra without its declared needs: "
        f"pip install --no-deps {DIST}=={DIST_VERSION} (`make setup` does)"
    )


def data_dir() -> Path:
    """The ``bfcl_eval`` package folder that holds `QUESTIONS` and `ANSWERS`; a one-line
    ValueError naming the package and how to install it where it is absent."""
    found = importlib.util.find_spec(PACKAGE)
    for loc in list(found.submodule_search_locations or []) if found is not None else []:
        if (Path(loc) / QUESTIONS).is_file() and (Path(loc) / ANSWERS).is_file():
            return Path(loc)
    raise ValueError(f"task: 'tools-bfcl' needs the package {DIST}; {install_hint()}")


def _json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def to_schema(spec: dict, where: str = "parameters", *, top: bool = False) -> dict:
    """BFCL's schema dialect ``spec`` as JSON Schema (see the module docstring); raises
    `UnsupportedCase` naming ``where`` for a type or shape it does not know."""
    if not isinstance(spec, dict) or spec.get("type") not in _TYPES:
        got = spec.get("type") if isinstance(spec, dict) else spec
        raise UnsupportedCase(f"{where}: type {got!r} is not one of {sorted(_TYPES)}")
    out: dict = {}
    if _TYPES[spec["type"]] is not None:
        out["type"] = _TYPES[spec["type"]]
    if "enum" in spec:
        out["enum"] = list(spec["enum"])
    if "properties" in spec:
        out["properties"] = {k: to_schema(v, f"{where}/{k}") for k, v in spec["properties"].items()}
    if "required" in spec:
        out["required"] = list(spec["required"])
    if "items" in spec:
        out["items"] = to_schema(spec["items"], f"{where}/items")
    if top:
        if out.get("type") != "object":
            raise UnsupportedCase(f"{where}: expected a dict of parameters, got {spec['type']!r}")
        out.setdefault("properties", {})
        out["additionalProperties"] = False
    return out


def _expand(answer, where: str) -> list:
    """The whole JSON values a BFCL answer value stands for: a dict maps each key to its
    acceptable values (``""``: the key may be absent), a list holds such values in turn."""
    if isinstance(answer, dict):
        per_key = []
        for key, options in answer.items():
            if not isinstance(options, list):
                raise UnsupportedCase(f"{where}/{key}: expected a list of acceptable values")
            values = [(key, v) for o in options if o != _OMIT for v in _expand(o, where)]
            per_key.append(values + ([None] if _OMIT in options else []))
        combos = _product(per_key, where)
        return [{kv[0]: kv[1] for kv in combo if kv is not None} for combo in combos]
    if isinstance(answer, list):
        return [list(c) for c in _product([_expand(x, where) for x in answer], where)]
    return [answer]


def _product(choices: list[list], where: str) -> list[tuple]:
    n = 1
    for c in choices:
        n *= len(c)
    if n > MAX_ALTERNATIVES:
        raise UnsupportedCase(f"{where}: {n} acceptable values, more than {MAX_ALTERNATIVES}")
    return list(itertools.product(*choices))


def _dedupe(values: list) -> list:
    seen, out = set(), []
    for v in values:
        key = json.dumps(v, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def to_case(question: dict, answer: dict) -> Case:
    """One `Case` from a line of `QUESTIONS` and its line of `ANSWERS`; raises
    `UnsupportedCase` saying why where it cannot be expressed."""
    cid = question.get("id")
    turns = question.get("question")
    functions = question.get("function")
    truth = answer.get("ground_truth")
    if answer.get("id") != cid:
        raise UnsupportedCase(f"{cid}: its answer line is {answer.get('id')!r}")
    if not (isinstance(turns, list) and len(turns) == 1 and len(turns[0]) == 1):
        raise UnsupportedCase(f"{cid}: not a single user turn")
    if turns[0][0].get("role") != "user" or not isinstance(turns[0][0].get("content"), str):
        raise UnsupportedCase(f"{cid}: not a single user turn")
    if not (isinstance(functions, list) and len(functions) == 1):
        raise UnsupportedCase(f"{cid}: {len(functions or [])} functions, expected one")
    if not (isinstance(truth, list) and len(truth) == 1 and len(truth[0]) == 1):
        raise UnsupportedCase(f"{cid}: not one expected call")
    fn = functions[0]
    ((name, answers),) = truth[0].items()
    if name != fn["name"]:
        raise UnsupportedCase(f"{cid}: the answer calls {name!r}, the function is {fn['name']!r}")
    schema = to_schema(fn["parameters"], f"{cid}/parameters", top=True)
    props, required = schema["properties"], set(schema.get("required", ()))
    unknown = sorted(set(answers) - set(props))
    if unknown:
        raise UnsupportedCase(f"{cid}: answers for parameters {unknown} it does not have")
    allowed, optional = {}, []
    for param, options in answers.items():
        where = f"{cid}/{param}"
        if not isinstance(options, list):
            raise UnsupportedCase(f"{where}: expected a list of acceptable values")
        values = [v for o in options if o != _OMIT for v in _expand(o, where)]
        values = [v for v in _dedupe(values) if validate_arguments(props[param], v) is None]
        omissible = _OMIT in options and param not in required
        if not values and not omissible:
            raise UnsupportedCase(f"{where}: no acceptable value fits the schema")
        allowed[param] = values
        if omissible:
            optional.append(param)
    missing = sorted(required - set(allowed))
    if missing:
        raise UnsupportedCase(f"{cid}: no answers for required parameters {missing}")
    return Case(
        id=cid,
        question=turns[0][0]["content"],
        name=name,
        description=" ".join(str(fn.get("description", "")).split()),
        parameters=schema,
        arguments_any=allowed,
        optional=tuple(optional),
    )


@lru_cache(maxsize=1)
def _load(folder: str) -> tuple[tuple[Case, ...], tuple[tuple[str, str], ...]]:
    questions = _json_lines(Path(folder) / QUESTIONS)
    answers = {a.get("id"): a for a in _json_lines(Path(folder) / ANSWERS)}
    cases, skipped = [], []
    for q in questions:
        try:
            cases.append(to_case(q, answers.get(q.get("id"), {})))
        except UnsupportedCase as e:
            skipped.append((str(q.get("id")), str(e)))
    return tuple(cases), tuple(skipped)


def load_cases() -> tuple[list[Case], dict[str, str]]:
    """The cases that load and ``{case id: why}`` for those skipped, in file order (read
    once per process)."""
    cases, skipped = _load(str(data_dir()))
    return list(cases), dict(skipped)
