"""The packages are laid out by the formatter alone (issue 44): no ``# fmt: skip`` or
``# fmt: off`` in ``mrtpo/`` or ``mrtpo_kernels/``; a table that reads better by hand is
written as data instead."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_no_formatter_opt_outs_in_the_packages():
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("mrtpo", "mrtpo_kernels")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if MARKER.search(line)
    ]
    assert not found, f"formatter opt-outs in the packages: {found}"


def test_the_marker_pattern_finds_both_forms():
    assert MARKER.search("x = 1  # fmt: skip") and MARKER.search("# fmt: off")
    assert not MARKER.search("# format: the skip list")
