"""The step model's arithmetic: one step's parts and both arms' times under each mode.

What each part means and which forwards each mode runs: ``bench/step_model.py``'s text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MODES = ("separate", "own-forward", "from-update")


@dataclass(frozen=True)
class Parts:
    """One step's parts, in any one unit of time (ms here), and the batch's counts."""

    responses: int
    K: int
    kept: float  # pairs replayed (a mean where the parts sum several steps)
    generation: float  # G
    update: float  # U: policy forward + policy loss + backward
    info_forward: float  # F: with-information no-grad forward and old log-probs
    unit_per_pair: float  # u
    js_per_side: float  # j
    advantages_gdpo: float = 0.0
    advantages_mrtpo: float = 0.0
    head_pass: float = 0.0  # H (part of F too: F less H is the forward alone)

    def __post_init__(self):
        if self.responses < 1:
            raise ValueError(f"responses: expected at least 1, got {self.responses}")
        if self.K < 1:
            raise ValueError(f"K: expected at least 1, got {self.K}")
        if not 0 <= self.kept <= self.responses * self.K:
            raise ValueError(f"kept: expected 0..{self.responses * self.K}, got {self.kept}")
        for name in (
            "generation",
            "update",
            "info_forward",
            "unit_per_pair",
            "js_per_side",
            "advantages_gdpo",
            "advantages_mrtpo",
            "head_pass",
        ):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite time >= 0, got {v}")


def step_times(p: Parts, mode: str = "separate") -> dict:
    """Both arms' step times and their ratio under ``mode`` (see the module's text)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    base = p.generation + p.update
    replay = p.kept * p.unit_per_pair
    js = (p.responses + p.kept) * p.js_per_side
    if mode == "separate":
        gdpo_old, mrtpo_old = p.info_forward, p.info_forward
    elif mode == "own-forward":
        gdpo_old, mrtpo_old = p.head_pass, p.info_forward  # F less H, plus the update's H
    else:
        gdpo_old, mrtpo_old = p.head_pass, p.head_pass
    gdpo = base + p.advantages_gdpo + gdpo_old
    mrtpo = base + p.advantages_mrtpo + mrtpo_old + replay + js
    return dict(
        gdpo=gdpo,
        mrtpo=mrtpo,
        ratio=mrtpo / gdpo,
        replay=replay,
        js=js,
        generation_share=p.generation / gdpo,
    )


def transfer(p: Parts, donor: Parts) -> Parts:
    """``p`` with its u and j taken from ``donor``, each relative to the with-information
    forward per response of its own measurement (u / f, j / f carried over)."""
    f_p, f_d = p.info_forward / p.responses, donor.info_forward / donor.responses
    if f_d <= 0:
        raise ValueError("donor: its info_forward must be > 0 to carry u / f and j / f")
    return replace(
        p,
        unit_per_pair=donor.unit_per_pair / f_d * f_p,
        js_per_side=donor.js_per_side / f_d * f_p,
        head_pass=p.head_pass or donor.head_pass / f_d * f_p,
        advantages_mrtpo=p.advantages_mrtpo or donor.advantages_mrtpo,
    )
