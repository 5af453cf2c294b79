"""The advantage ops' settings: their vocabularies and their one check layer.

``advantage_settings`` is the only place the advantage hyper-parameters (the fields of
``AdvantageSettings``) are checked. The public ops (``gdpo_advantages``,
``mrtpo_token_advantages``), their float64 references and the framework adapters (TRL, verl,
OpenRLHF, each with its own defaults and keyword names) all build their settings through
it and hand the result down as one value. Every failure is a ValueError naming the
argument: the keyword the caller used (verl's ``epsilon``), or the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from . import _validation as check
from ._types import ADVANTAGE_DEFAULTS, AdvantageSettings

BATCH_NORMS = ("sequence", "token")
NAN_POLICIES = ("error", "zero")
SCALE_REWARDS = ("group", "batch", "none")

FIELDS = tuple(f.name for f in dataclasses.fields(AdvantageSettings))


def _clip(name: str, x):
    if x is None:
        return None
    lo, hi = check.pair(name, x)
    if not (0.0 <= lo <= 1.0 <= hi):
        raise ValueError(f"{name}: expected (w_min, w_max) with w_min <= 1 <= w_max, got {x}")
    return (lo, hi)


def _optional_non_negative(name: str, x):
    return None if x is None else check.non_negative(name, x)


def _one_of(options):
    def check_choice(name: str, x):
        check.choice(name, x, options)
        return x

    return check_choice


# field -> its check: (argument name, value) -> the value normalized (numbers as floats,
# clip as a pair of floats), or a ValueError naming the argument
_CHECKS = {
    "alpha": check.unit_interval,
    "gamma": check.positive_finite,
    "eps": check.non_negative,
    "eps_batch": _optional_non_negative,
    "scale_rewards": _one_of(SCALE_REWARDS),
    "batch_norm": _one_of(BATCH_NORMS),
    "delta": check.non_negative,
    "clip": _clip,
    "nan": _one_of(NAN_POLICIES),
}
assert set(_CHECKS) == set(FIELDS), "every AdvantageSettings field has its check"


_CHECKED = "_checked_by_advantage_settings"


def _alias(value, aliases: Mapping):
    """The value an alias stands for (TRL's scale_rewards=True for "group"), matched by type
    and value (so 1 is not True), else the value itself."""
    for key, target in aliases.items():
        if type(key) is type(value) and key == value:
            return target
    return value


def advantage_settings(
    settings: AdvantageSettings | None = None,
    options: Mapping | None = None,
    *,
    defaults: AdvantageSettings = ADVANTAGE_DEFAULTS,
    names: Mapping[str, str] | None = None,
    values: Mapping[str, Mapping] | None = None,
    also: tuple[str, ...] = (),
    where: str = "advantage settings",
) -> AdvantageSettings:
    """The advantage settings of one call, checked: ``settings`` (an ``AdvantageSettings``;
    ``defaults`` where None) with ``options`` (keyword -> value) put over it.

    Args:
        settings: the hyper-parameters as one value, or None.
        options: keywords naming fields (or, through ``names``, the caller's own keywords);
            each replaces its field.
        defaults: the caller's defaults where ``settings`` is None (an adapter's: TRL's
            eps 1e-4, verl's batch_norm "token").
        names: the caller's keyword -> field (verl's ``epsilon`` -> ``eps``); the keywords it
            takes are exactly these (default: the field names). Any other keyword is a
            ValueError naming it.
        values: field -> {alias: value} (TRL's scale_rewards True -> "group"); an alias is
            matched by type and value.
        also: the caller's other keywords (verl's ``reward_weights``): skipped here, and
            listed with the settings' in the unknown-keyword message.
        where: the caller, for the unknown-keyword message.

    Returns:
        an ``AdvantageSettings`` whose every field is checked (numbers as floats, clip a
        pair of floats or None; ``eps_batch`` stays None for "eps": ``batch_eps`` reads
        it). The result is marked as checked: handed down again without options (an
        adapter's settings reaching the op), it is returned as it is, not checked twice.
    """
    if settings is None:
        settings = defaults
    elif not isinstance(settings, AdvantageSettings):
        raise ValueError(
            f"settings: expected an AdvantageSettings or None, got {type(settings).__name__}"
        )
    if not options and getattr(settings, _CHECKED, False):
        return settings
    names = {f: f for f in FIELDS} if names is None else names
    options = {} if options is None else options
    unknown = sorted(set(options) - set(names) - set(also))
    if unknown:
        raise ValueError(
            f"{where}: unknown options {', '.join(map(repr, unknown))}; expected some of "
            f"{sorted({*names, *also})}"
        )
    given = {names[key]: (key, value) for key, value in options.items() if key in names}
    values = {} if values is None else values
    out = {}
    for field in FIELDS:
        label, value = given.get(field, (field, getattr(settings, field)))
        value = _alias(value, values.get(field, {}))
        try:
            out[field] = _CHECKS[field](label, value)
        except ValueError as exc:
            if field not in values:
                raise
            extra = ", ".join(f"{k!r} for {v!r}" for k, v in values[field].items())
            raise ValueError(f"{exc} (or {extra})") from None
    checked = AdvantageSettings(**out)
    # a mark outside the fields (equality, hashing and dataclasses.replace ignore it: a
    # replaced copy is checked again)
    object.__setattr__(checked, _CHECKED, True)
    return checked


def from_keywords(settings, keywords: dict) -> AdvantageSettings:
    """A public op's settings: its keyword block (``keywords``, every field) or
    ``settings``, not both: with ``settings`` given, a keyword set to another value than
    its default is a ValueError naming it."""
    if settings is None:
        return advantage_settings(None, keywords)
    for name, value in keywords.items():
        if _differs(value, getattr(ADVANTAGE_DEFAULTS, name)):
            raise ValueError(
                f"{name}: given both as a keyword and in settings=; give the advantage "
                f"settings in one place (AdvantageSettings fields, or the keywords)"
            )
    return advantage_settings(settings)


def _differs(value, default) -> bool:
    if value is default:
        return False
    try:
        return bool(value != default)
    except (TypeError, ValueError, RuntimeError):
        return True
