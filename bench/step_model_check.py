"""The step model checked against the CPU records: each row's ratio predicted from its own
GDPO step and u / f, j / f carried from a different measurement, beside the measured one."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from .step_model_parts import Parts, step_times, transfer
from .step_model_records import K4_RECORD, METHOD_STEP_RECORDS, Case, k4_cases, method_step_cases

TOLERANCE = 0.10  # |predicted / measured - 1| of the ratio, the rows held to it:
MIN_TOKENS = 1024  # responses at least this long, and the K = 4 training runs (a 64-token
# row's units cost what the prompt past its shared prefix costs, which depends on where each
# kept reward's span starts: reported, not held to the tolerance)


def _donor(case: Case, pool: list[Case]) -> Case | None:
    """The measurement whose u / f and j / f predict ``case``: the other variant of the same
    case, else the same model in the same record at the nearest other length."""
    same = [c for c in pool if c.group == case.group and c is not case]
    for c in same:
        if c.run == case.run and c.tokens == case.tokens and c.variant != case.variant:
            return c
    near = [c for c in same if c.tokens != case.tokens and c.variant == case.variant]
    if not near:
        return None
    return min(near, key=lambda c: (abs(math.log(c.tokens / case.tokens)), c.run != case.run))


def check_rows(
    records=METHOD_STEP_RECORDS, k4: str | None = K4_RECORD, *, scale_unit: float = 1.0
) -> list[dict]:
    """Predicted beside measured, one row per record row that replays. ``scale_unit``
    multiplies every carried u (a deliberately wrong part for the tests)."""
    rows = []
    for name in records:
        cases = method_step_cases(name)
        for c in cases:
            d = _donor(c, cases)
            if d is None:
                continue
            p = transfer(c.parts, d.parts)
            p = replace(p, unit_per_pair=p.unit_per_pair * scale_unit)
            how = ("other variant" if d.tokens == c.tokens else f"{d.tokens} tokens") + (
                f" ({d.variant})"
            )
            rows.append(_row(c, p, how))
    if k4:
        for c in k4_cases(k4):
            p = replace(c.parts, unit_per_pair=c.parts.unit_per_pair * scale_unit)
            rows.append(_row(c, p, "replay profile, same batch and code"))
    return rows


def _row(c: Case, p: Parts, how: str) -> dict:
    pred = step_times(p, "separate")
    f = p.info_forward / p.responses
    # after issue 43 items 1-2 (one epoch, one minibatch): where the head pass is known
    after = {
        m: step_times(p, m)["ratio"] if p.head_pass > 0 else None
        for m in ("own-forward", "from-update")
    }
    held = c.tokens >= MIN_TOKENS or c.source == K4_RECORD
    return dict(
        source=c.source,
        case=c.label,
        variant=c.variant,
        kept=p.kept,
        held=held,
        after_own_forward=after["own-forward"],
        after_from_update=after["from-update"],
        parts=p,
        pairs=p.responses * p.K,
        donor=how,
        u_over_f=p.unit_per_pair / f,
        j_over_f=p.js_per_side / f,
        generation_share=pred["generation_share"],
        measured=c.measured,
        predicted=pred["ratio"],
        error=pred["ratio"] / c.measured - 1,
    )


def signed_pct(x: float) -> str:
    """A relative error as text: "+1.2 %"."""
    return f"{x:+.1%}".replace("%", " %")


def check_table(rows: list[dict]) -> str:
    lines = [
        "| record | case | variant | pairs kept | u / f, j / f carried from | u / f | j / f "
        "| generation share | measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['case']} | {r['variant']} | {r['kept']:g} of {r['pairs']:g} "
            f"| {r['donor']} | {r['u_over_f']:.2f} | {r['j_over_f']:.3f} "
            f"| {r['generation_share']:.0%} | {r['measured']:.3f}x | {r['predicted']:.3f}x "
            f"| {signed_pct(r['error'])} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    def one(sel, what):
        errs = [abs(r["error"]) for r in sel]
        worst = max(sel, key=lambda r: abs(r["error"]))
        return (
            f"{what}: {len(sel)}, |error| median {statistics.median(errs):.1%}, largest "
            f"{max(errs):.1%} ({worst['case']}, {worst['variant']})"
        )

    held = [r for r in rows if r["held"]]
    miss = [r for r in held if abs(r["error"]) > TOLERANCE]
    text = one(held, f"rows held to the {TOLERANCE:.0%} tolerance") + (
        f"; {len(miss)} beyond it" if miss else "; all within it"
    )
    rest = [r for r in rows if not r["held"]]
    if rest:
        text += "; " + one(rest, f"rows under {MIN_TOKENS} tokens (reported only)")
    return text
