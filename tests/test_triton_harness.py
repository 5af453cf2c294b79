"""The shared harness of the Triton interpreter checks (tests/triton_cases/_harness.py) can
fail: a NaN of the reference is matched only by a NaN (not by a 0 or any number), a finite
value only by a finite one within the error rule, and a run passes only with exit status
0 and a summary line of exactly 0 failures ("10 failures" is not "0 failures") after at
least one check, and a group that runs no check fails."""

from __future__ import annotations

import pytest
import torch
from triton_cases import _harness

NAN, INF = float("nan"), float("inf")


def _fails(ours, want, same=None, **kw) -> bool:
    before = len(_harness.FAILURES)
    _harness.close("probe", torch.tensor(ours), torch.tensor(want), same, **kw)
    failed = len(_harness.FAILURES) > before
    del _harness.FAILURES[before:]
    return failed


@pytest.mark.parametrize(
    "ours,want,ok",
    [
        ([1.0, NAN, INF, -INF], [1.0, NAN, INF, -INF], True),
        ([1.0, 0.0], [1.0, NAN], False),  # a 0 for a NaN (what nan_to_num let through)
        ([1.0, 2.0], [1.0, NAN], False),  # any finite value for a NaN
        ([1.0, NAN], [1.0, 2.0], False),  # a NaN for a finite value
        ([INF], [-INF], False),
        ([INF], [NAN], False),
        ([1.0 + 5e-6], [1.0], True),  # within atol + rtol max |want| = 2e-5
        ([1.0 + 5e-5], [1.0], False),
        ([[1.0, 2.0]], [1.0, 2.0], False),  # shape
    ],
)
def test_close_matches_nan_to_nan_only(ours, want, ok):
    assert _fails(ours, want) is not ok


def test_close_budget_counts_plain_pytorch_error():
    assert _fails([1.01], [1.0], same=torch.tensor([1.006]), atol=0, rtol=0) is False
    assert _fails([1.02], [1.0], same=torch.tensor([1.006]), atol=0, rtol=0) is True


@pytest.mark.parametrize(
    "printed,ok",
    [
        ("5 checks, 0 failures", True),
        ("0 failures", True),
        ("5 checks, 10 failures", False),  # contains "0 failures"
        ("0 checks, 0 failures", False),  # a run that checked nothing
        ("10 failures", False),
        ("no summary", False),
    ],
)
def test_run_interpreted_needs_a_summary_of_zero_failures(printed, ok):
    code = f"print({printed!r})"
    if ok:
        _harness.run_interpreted("-c", code, timeout=60)
    else:
        with pytest.raises(AssertionError):
            _harness.run_interpreted("-c", code, timeout=60)


def test_run_interpreted_needs_exit_status_zero():
    with pytest.raises(AssertionError, match="exit status 3"):
        _harness.run_interpreted("-c", "import sys; print('0 failures'); sys.exit(3)", timeout=60)


def test_a_group_that_runs_no_check_fails(capsys):
    def checks_one():
        _harness.expect("probe", True, "")

    def checks_nothing():  # a group whose cases were all skipped, or never written
        pass

    saved = (list(_harness.FAILURES), _harness.CHECKS[0])
    try:
        assert _harness.run({"one": checks_one}, []) == 0
        assert _harness.run({"one": checks_one, "none": checks_nothing}, []) == 1
        assert "FAIL none ran no check" in capsys.readouterr().out
    finally:
        _harness.FAILURES[:] = saved[0]
        _harness.CHECKS[0] = saved[1]
