"""MRTPO's own options, described once: the help text, default and accepted values of each
option that ``mrtpo train`` (a field of `mrtpo.training.config.TrainConfig`, flag ``--name``)
and the framework adapters (TRL: a field ``mrtpo_<name>`` of ``MRTPOConfig``) share. Each entry is
the keywords of `mrtpo.training.config_fields.setting`; ``method_setting(name)`` is the field.
``parse_variant`` reads the algorithm variants of ``mrtpo compare --algos`` that set them
(``mrtpo:specific:gamma=2``). Torch-free (the command line imports it). The allocation
decisions' vocabularies are ``mrtpo.allocation``'s.
"""

from __future__ import annotations

from mrtpo.allocation import CREDIT_MODES, RELEVANCES

from .config_fields import check_value, setting

__all__ = ["ALGOS", "METHOD_OPTIONS", "VARIANT_KEYS", "method_setting", "parse_variant"]

METHOD_OPTIONS: dict[str, dict] = {
    "alpha": dict(
        default=1.0,
        help="share of each reward's advantage reallocated by relevance; 0 gives GDPO",
        lo=0.0,
        hi=1.0,
    ),
    "gamma": dict(default=1.0, help="sharpening exponent on the relevance", lo=0.0, open_lo=True),
    "relevance": dict(
        default="js",
        help="relevance that allocates each reward (METHOD.md 3, 3b): js (the JS distance "
        "d_k), specific (d_k minus the mean of the other rewards' d, floored at 0; no extra "
        "forward) or control (d_k minus the distance under removal of an unchecked prompt "
        "span of similar length; one extra replay per response), logratio (|log p(y_t)| "
        "change of the sampled token under the same replays, instead of the JS distance of "
        "the whole distribution) or oracle (a diagnostic, not the method: 1 on the response "
        "tokens the verifier names, 0 elsewhere, i.e. credit precision 1; where a verifier "
        "names none, uniform)",
        choices=RELEVANCES,
    ),
    "truncated_credit": dict(
        default="relevance",
        help="allocation on a response cut at the length limit (`mrtpo train "
        "--max-new-tokens`, TRL's `max_completion_length`): relevance (as any other) or "
        "uniform (GDPO's broadcast for every reward: a cut answer's failure is the stop "
        "decision, spread over its tokens, not where the relevance points)",
        choices=CREDIT_MODES,
    ),
    "stop_credit": dict(
        default="relevance",
        help="allocation on the stop token that ends a finished answer: relevance (as any "
        "other token) or uniform (its weight is 1 for every reward, GDPO's share: its "
        "relevance is set to the mean of the answer's other tokens)",
        choices=CREDIT_MODES,
    ),
    "replay_all": dict(
        default=False,
        help="replay every (response, reward) pair with spans, also those whose GDPO "
        "advantage is 0 (by default MRTPO skips them: they move no token advantage); the "
        "token advantages are the same, the relevance diagnostics cover every pair, at the "
        "replay's full cost",
    ),
}


def method_setting(name: str, **over):
    """The `setting` field of MRTPO option ``name`` (``over``: more metadata, e.g. its group)."""
    if name not in METHOD_OPTIONS:
        raise ValueError(f"name: expected one of {tuple(METHOD_OPTIONS)}, got {name!r}")
    return setting(**{**METHOD_OPTIONS[name], **over})


ALGOS = ("grpo", "gdpo", "mrtpo")
# what an algorithm variant of `mrtpo compare --algos` may set (mrtpo:specific:gamma=2)
VARIANT_KEYS = ("relevance", "gamma", "alpha", "stop_credit", "truncated_credit")


def parse_variant(label: str) -> tuple[str, dict]:
    """``mrtpo:specific:gamma=2`` -> ("mrtpo", {"relevance": "specific", "gamma": 2.0}).

    An algorithm, then optional ``:``-separated items: a relevance name (js, specific,
    control) or ``key=value`` with key in VARIANT_KEYS (MRTPO only), e.g.
    ``mrtpo:specific:gamma=2:stop_credit=uniform``. A setting given twice (a relevance name
    is ``relevance=``) is an error naming the variant."""
    algo, *items = label.split(":")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r} in {label!r}")
    over: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "relevance", item
        if key not in VARIANT_KEYS:
            raise ValueError(f"unknown setting {key!r} in {label!r}; known: {VARIANT_KEYS}")
        if key in over:  # mrtpo:gamma=2:gamma=3, mrtpo:specific:control: which one?
            raise ValueError(f"{key} is set twice in {label!r}; give each setting once")
        if algo != "mrtpo":
            raise ValueError(f"{label!r}: only mrtpo takes settings")
        choices = METHOD_OPTIONS[key].get("choices")
        if choices:
            if value not in choices:
                raise ValueError(f"{key} {value!r} in {label!r}; expected one of {choices}")
            over[key] = value
        else:
            try:
                over[key] = float(value)
            except ValueError:
                raise ValueError(f"{key} in {label!r}: expected a number, got {value!r}") from None
            msg = check_value(method_setting(key), over[key])
            if msg:
                raise ValueError(f"{key} in {label!r}: {msg}")
    return algo, over


def task_slug(task: str) -> str:
    """A file-name form of a task name (``constraints:a,b`` -> ``constraints-a-b``)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task)


def variant_slug(label: str) -> str:
    """A folder-name form of a variant label (``mrtpo:control:gamma=2`` -> mrtpo-control-gamma2)."""
    return label.replace(":", "-").replace("=", "")


def check_algos(names) -> str | None:
    want = (
        f"a comma-separated list of distinct {', '.join(ALGOS)} or mrtpo variants "
        f"(mrtpo:specific, mrtpo:control:gamma=2), got {names!r}"
    )
    if not names or len(set(names)) != len(names):
        return f"expected {want}"
    for a in names:
        try:
            parse_variant(a)
        except ValueError as err:
            return f"expected {want}: {err}"
    return None
