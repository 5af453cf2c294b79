"""The ``mrtpo train`` and ``mrtpo compare`` flags, built from the fields of `TrainConfig` and
`CompareConfig` (their metadata: help, kind, choices, range, group; see
`mrtpo.training.config.setting`):
`add_flags` adds them to a parser, `from_namespace` reads a config back, `flag_for_error` turns
a ``field: ...`` ValueError into ``argument --flag: ...``, and `command_line` writes the
``mrtpo compare`` command that gives a config."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace

from .config import (
    COMPARE_FIXED,
    INT64_MAX,
    CompareConfig,
    TrainConfig,
    check_value,
    model_default_note,
    value_kind,
)

# the namespace attribute holding the destinations of the flags a command line gave
GIVEN = "_given"


def given_flags(ns: argparse.Namespace, *, prefix: str = "") -> set[str]:
    """The fields (``prefix`` removed) whose flags the parsed command line gave."""
    return {d.removeprefix(prefix) for d in getattr(ns, GIVEN, ()) if d.startswith(prefix)}


def _mark(ns, dest: str) -> None:
    if getattr(ns, GIVEN, None) is None:
        setattr(ns, GIVEN, set())
    getattr(ns, GIVEN).add(dest)


class _Store(argparse.Action):
    """``store``, remembering that the flag was given (a built-in model's defaults fill only
    the flags a command line leaves out)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _StoreConst(argparse.Action):
    """``store_true`` / ``store_false``, remembering that the flag was given."""

    def __init__(self, option_strings, dest, const, **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const)
        _mark(namespace, self.dest)


def flag_of(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _brief(text: str) -> str:
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def _arg_type(f):
    kind = value_kind(f)

    def parse(text: str):
        if kind == "int":
            digits = text.strip().lstrip("+-").lstrip("0")
            if len(digits) > 60 and digits.isascii() and digits.isdigit():  # named, not printed
                raise argparse.ArgumentTypeError(
                    f"expected an integer of at most 2^63 - 1 = {INT64_MAX} in magnitude "
                    f"(int64), got an integer of {len(digits)} digits"
                )
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected an integer, got {_brief(text)}"
                ) from None
        elif kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected a number, got {_brief(text)}") from None
        elif kind == "algos":
            value = tuple(a.strip() for a in text.split(",") if a.strip())
        else:
            value = text
        msg = check_value(f, value)
        if msg:
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def add_flags(parser, default, *, skip=(), prefix: str = "", groups=None):
    """Add a flag for every field of the dataclass instance ``default`` (its values are the
    flags' defaults); a field's value lands in ``prefix + name`` of the namespace."""
    groups = {} if groups is None else groups
    for f in fields(default):
        md = f.metadata
        if f.name in skip or md.get("cli") is False:
            continue
        value = getattr(default, f.name)
        dest = prefix + f.name
        title = md.get("group")
        target = parser
        if title is not None:
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            target = groups[title]
        if hasattr(value, "__dataclass_fields__"):
            keep = md.get("nested")
            inner_skip = [g.name for g in fields(value) if keep is not None and g.name not in keep]
            add_flags(target, value, skip=inner_skip, prefix=dest + ".", groups=groups)
            continue
        help_text = md["help"]
        if value_kind(f) == "bool":
            target.add_argument(
                flag_of(f),
                dest=dest,
                action=_StoreConst,
                const=not value,
                default=value,
                help=help_text,
            )
            continue
        if value is not None and "(default" not in help_text:
            shown = ",".join(value) if value_kind(f) == "algos" else value
            note = model_default_note(f.name) if isinstance(default, TrainConfig) else ""
            help_text += f" (default: {shown}{note})"
        choices = md.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper()
        target.add_argument(
            flag_of(f),
            dest=dest,
            type=_arg_type(f),
            default=value,
            action=_Store,
            metavar=md.get("metavar") or metavar,
            help=help_text,
        )
    return parser


def from_namespace(default, ns: argparse.Namespace, *, prefix: str = ""):
    """The dataclass ``default`` with every field that has a flag taken from ``ns``."""
    values = vars(ns)
    changes = {}
    for f in fields(default):
        dest = prefix + f.name
        value = getattr(default, f.name)
        if hasattr(value, "__dataclass_fields__"):
            changes[f.name] = from_namespace(value, ns, prefix=dest + ".")
        elif dest in values:
            v = values[dest]
            if value_kind(f) == "algos" and isinstance(v, str):
                v = _arg_type(f)(v)
            changes[f.name] = v
    return replace(default, **changes)


def flag_for_error(message: str, default) -> str:
    """Rewrite a ``field: ...`` (or ``outer.field: ...``) ValueError message from validate()
    as ``argument --flag: ...`` when that field has a flag on the dataclass ``default``."""
    head, sep, rest = message.partition(": ")
    if not sep:
        return message
    obj, f = default, None
    for part in head.split("."):
        if not hasattr(obj, "__dataclass_fields__"):
            return message
        f = {g.name: g for g in fields(obj)}.get(part)
        if f is None:
            return message
        obj = getattr(obj, part)
    if f is None or f.metadata.get("cli") is False or hasattr(obj, "__dataclass_fields__"):
        return message
    return f"argument {flag_of(f)}: {rest}"


def command_line(cfg: CompareConfig) -> str:
    """The ``mrtpo compare`` command that gives ``cfg`` (flags that differ from defaults)."""
    default = CompareConfig()
    parts = ["mrtpo compare", f"--task {cfg.task}"]
    for f in fields(cfg):
        if f.name in ("task", "train"):
            continue
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if v != d:
            if isinstance(v, bool):
                parts.append(flag_of(f))
            else:
                parts.append(f"{flag_of(f)} {','.join(v) if isinstance(v, tuple) else v}")
    for f in fields(cfg.train):
        v, d = getattr(cfg.train, f.name), getattr(default.train, f.name)
        if f.name in COMPARE_FIXED or f.metadata.get("cli") is False or v == d:
            continue
        if f.name == "tiny":
            if v.warm_steps != d.warm_steps:
                parts.append(f"--warm-steps {v.warm_steps}")
            if v.warm_noise != d.warm_noise:
                parts.append(f"--warm-noise {v.warm_noise}")
            continue
        if isinstance(v, bool):
            parts.append(flag_of(f))
        else:
            parts.append(f"{flag_of(f)} {v}")
    return " ".join(parts)
