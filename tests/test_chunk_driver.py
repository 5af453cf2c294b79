"""The chunk driver (mrtpo_kernels/backends/_chunked.py) with every row-kernel
implementation (torch, cpu, Triton under the interpreter), and the Triton row kernels
(mrtpo_kernels/triton/rows.py) on their own, against the float64 references.

The interpreter must be switched on before triton is imported, so the checks live in
tests/triton_cases/rows_cases.py and run here in a subprocess: odd shapes, extreme and
masked logits, NaN and all -inf rows, all-ignored rows, JS with K = 1, 3, 5, the policy
loss with the dual clip and kl_iw, chunk boundaries (chunks of 4 to 6 rows), the low-memory
(vocabulary-chunked) backward, the 16-bit GEMM path of CUDA emulated on the CPU, and int64
row offsets past 2^31 by index arithmetic.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "triton_cases" / "rows_cases.py"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_row_kernels_and_chunk_driver_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MRTPO_STRICT_BACKEND="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(CASES)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"cases failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert " 0 failures" in proc.stdout, proc.stdout


def test_low_memory_setting():
    from mrtpo_kernels import settings

    old = {k: os.environ.get(k) for k in ("MRTPO_LOW_MEMORY", "MRTPO_DW_BUDGET_BYTES")}
    try:
        os.environ["MRTPO_LOW_MEMORY"] = "auto"
        os.environ["MRTPO_DW_BUDGET_BYTES"] = "1000"
        assert settings.low_memory(1001) and not settings.low_memory(1000)
        os.environ["MRTPO_LOW_MEMORY"] = "0"
        assert not settings.low_memory(10**12)
        os.environ["MRTPO_LOW_MEMORY"] = "1"
        assert settings.low_memory(1)
        os.environ["MRTPO_LOW_MEMORY"] = "sometimes"
        with pytest.raises(ValueError, match="MRTPO_LOW_MEMORY"):
            settings.low_memory(1)
        os.environ["MRTPO_TRITON_VARIANT"] = "fastest"
        with pytest.raises(ValueError, match="MRTPO_TRITON_VARIANT"):
            settings.triton_variant()
    finally:
        os.environ.pop("MRTPO_TRITON_VARIANT", None)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_f32_out_probe_on_cpu_is_false_or_exact():
    """The run-time check of torch.mm(out_dtype=float32): CPU torch has no such kernel, so
    the driver upcasts there; where it exists the probe has checked it is exact."""
    import torch

    from mrtpo_kernels.backends import _chunked

    got = _chunked.f32_out_supported(torch.device("cpu"), torch.bfloat16)
    try:
        torch.mm(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16),
                 out_dtype=torch.float32)  # fmt: skip
        exists = True
    except (RuntimeError, TypeError, NotImplementedError):
        exists = False
    assert got == exists
