"""The allocation decisions of MRTPO, in one home (docs/METHOD.md sections 3, 3b and 4): what
allocates each reward's advantage over a response's tokens, and what the two special cases
get.

- The relevance form (``relevance``): which relevance allocates each reward: ``js`` (the JS
  distance d_k of the contrastive replay), ``specific`` (d_k minus the mean d of the other
  rewards with spans, floored at 0), ``control`` (d_k minus the distance under removal of
  an unchecked prompt span), ``logratio`` (the |log p| change of the sampled token) or
  ``oracle`` (a diagnostic). The adapters (TRL, verl, OpenRLHF) replay without control spans
  or pointwise log-ratios, so they offer the forms computed from d alone:
  ``REPLAY_RELEVANCES``.
- Stop credit (``stop_credit``): the stop token that ends a finished response is allocated
  by ``relevance`` as any other token, or ``uniform`` (weight 1 for every reward, GDPO's
  share of the stop decision).
- Truncated credit (``truncated_credit``): a response cut at the length limit is allocated
  by ``relevance``, or ``uniform`` (GDPO's broadcast for every reward).

This module holds the vocabularies and their checks and imports no torch (the command
line's config imports it); ``mrtpo.allocation.tensors`` applies the decisions to a batch,
for ``mrtpo train`` (``mrtpo.training.trainer.compute_advantages``) and the TRL trainer alike.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CREDIT_MODES",
    "RELEVANCES",
    "REPLAY_RELEVANCES",
    "Allocation",
]

RELEVANCES = ("js", "specific", "control", "logratio", "oracle")  # mrtpo train --relevance
# the forms that need nothing but the replay's d (no control replay, no pointwise
# log-ratio, no verifier oracle): what the framework adapters give
REPLAY_RELEVANCES = ("js", "specific")
CREDIT_MODES = ("relevance", "uniform")  # --stop-credit, --truncated-credit


@dataclass(frozen=True)
class Allocation:
    """The three allocation decisions of a run, checked when built: a ``ValueError`` names
    the option (``names`` maps each decision to the caller's name for it, e.g.
    ``mrtpo_relevance`` in TRL's config) and says what is accepted. ``relevances``: the
    forms the caller can give (``RELEVANCES`` in ``mrtpo train``, ``REPLAY_RELEVANCES`` in
    the framework adapters)."""

    relevance: str = "js"
    stop_credit: str = "relevance"
    truncated_credit: str = "relevance"

    @classmethod
    def checked(
        cls,
        relevance: str = "js",
        stop_credit: str = "relevance",
        truncated_credit: str = "relevance",
        *,
        relevances: tuple = RELEVANCES,
        names: dict | None = None,
    ) -> Allocation:
        names = names or {}
        name = names.get("relevance", "relevance")
        if relevance not in relevances:
            only = [r for r in RELEVANCES if r not in relevances]
            listed = ", ".join(only[:-1]) + " and " + only[-1] if len(only) > 1 else "".join(only)
            note = f" ({listed} exist in `mrtpo train` only)" if only else ""
            raise ValueError(f"{name}: expected one of {relevances}, got {relevance!r}{note}")
        for key, value in (("stop_credit", stop_credit), ("truncated_credit", truncated_credit)):
            if value not in CREDIT_MODES:
                raise ValueError(
                    f"{names.get(key, key)}: expected one of {CREDIT_MODES}, got {value!r}"
                )
        return cls(relevance, stop_credit, truncated_credit)
