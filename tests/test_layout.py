"""The house's layout rule (issue 44): no Python file of the packages, the benchmarks or the
tools above 500 lines; a file that grows past it is split by concern."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500
FOLDERS = ("mrtpo", "mrtpo_kernels", "bench", "tools")


def _files():
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_layout_rule_sees_the_packages():
    names = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "mrtpo/training/trainer.py" in names and "mrtpo_kernels/__init__.py" in names
    assert len(names) > 100


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_file_above_500_lines(folder):
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > LIMIT
    }
    assert not long, f"files above {LIMIT} lines (split them by concern): {long}"
