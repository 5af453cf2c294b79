"""Built-in offline data of the tasks: the shop database and its questions (`shop`), tool
definitions and requests (`tool_defs`), constraint prompts (`instructions`), and readers of
packaged benchmark data (`bfcl`, `ifbench`)."""

from __future__ import annotations


def noisy_reference(rng, example, p_wrong: float) -> str:
    """``example``'s reference with its constraints broken at rate ``p_wrong`` (the warm
    start's ``--warm-noise``), by its task's rule: every constraint of an ``ifbench-real``
    example (`ifbench.noisy_reference`), the swappable ones of a constraints example
    (`instructions.noisy_reference`)."""
    if "ifbench" in example.fields:
        from .ifbench import noisy_reference as rule
    else:
        from .instructions import noisy_reference as rule
    return rule(rng, example, p_wrong)
