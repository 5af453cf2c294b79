"""Shared test helpers: backends under test and the error-budget rule.

Error budget (README.md, "Numerics"): a kernel's max error against the float64
reference may be at most 2x the error of plain PyTorch in the same dtype, plus a small atol.
"""

from __future__ import annotations

import os

import pytest
import torch

from mrtpo_kernels import backend_status

CPU_BACKENDS = [b for b in ("cpu", "torch") if backend_status().get(b) == "ok"]


def pytest_report_header(config):
    return [f"mrtpo_kernels backends: {backend_status()}"]


@pytest.fixture(scope="session", autouse=True)
def models_cache(tmp_path_factory):
    """One model cache (MRTPO_CACHE) for the whole session: a built-in model is converted
    once and shared by every test that loads it, and no test writes into the user's own
    cache. Tests that check the cache rules themselves set MRTPO_CACHE with monkeypatch."""
    path = tmp_path_factory.mktemp("mrtpo-cache")
    before = os.environ.get("MRTPO_CACHE")
    os.environ["MRTPO_CACHE"] = str(path)
    yield path
    if before is None:
        os.environ.pop("MRTPO_CACHE", None)
    else:
        os.environ["MRTPO_CACHE"] = before


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_budget(out, ref64, plain, *, atol: float, name: str = "output"):
    """max|out - ref64| <= 2 max|plain - ref64| + atol."""
    err = max_err(out, ref64)
    budget = 2.0 * max_err(plain, ref64) + atol
    assert err <= budget, f"{name}: error {err:.3e} exceeds budget {budget:.3e}"
