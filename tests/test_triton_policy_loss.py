"""Triton fused policy loss (mrtpo_kernels/triton_kernels/policy_loss.py).

CPU: the kernels run under the Triton interpreter, which must be switched on before triton
is imported, so the checks live in tests/triton_cases/policy_loss_cases.py and run here in
a subprocess per Triton variant (MRTPO_TRITON_VARIANT=rows: the chunk driver with the row
kernels; fused: this file's kernels, both of its modes: recompute and kept logits over
several token chunks): bias, KL term, the three aggregation rules, bf16,
torch.library.opcheck.
GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): the real shapes in bf16 and fp32
against the float64 reference, both variants.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_logprobs import DEV, _inputs, _within_budget, gpu_test
from triton_cases._harness import CASES, VARIANTS, needs_triton, run_interpreted

import mrtpo_kernels as mk
from mrtpo_kernels.reference import linear_policy_loss_ref


@needs_triton
@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_policy_loss_under_interpreter(variant):
    run_interpreted(CASES / "policy_loss_cases.py", env={"MRTPO_TRITON_VARIANT": variant})


# --------------------------------------------------------------------------- GPU


@gpu_test
@pytest.mark.parametrize("keep_logits", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_linear_policy_loss_real_shape(dtype, keep_logits, monkeypatch):
    """Both variants of triton_kernels/policy_loss.py: (b) recompute (default), (a) kept logits."""
    monkeypatch.setenv("MRTPO_POLICY_KEEP_LOGITS", keep_logits)
    n, d = 2048, 4096
    h, w, lab = _inputs(n, d, dtype, seed=3)
    with torch.no_grad():
        cur = mk.linear_logprobs(h, w, lab, backend="triton")
    g = torch.Generator(device=DEV).manual_seed(4)
    # rounded to dtype once, so that every run sees the same input values
    old = (cur + 0.3 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    adv = torch.randn(n, device=DEV, generator=g).to(dtype)
    ref_lp = (cur + 0.3 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    out = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww = (t.detach().to(dt).requires_grad_() for t in (h, w))
        args = (hh, ww, lab, old.to(dt), adv.to(dt))
        kw = dict(ref_logprobs=ref_lp.to(dt), beta=0.05, clip_high=0.28)
        if key == "ours":
            loss, met = mk.linear_policy_loss(*args, backend="triton", **kw)
        else:
            loss, met = linear_policy_loss_ref(*args, **kw)
        loss.backward()
        out[key] = (loss, met, hh.grad, ww.grad)
    _within_budget(out["ours"][0], out["ref"][0], out["same"][0], atol=1e-5)
    for k in out["ref"][1]:
        _within_budget(out["ours"][1][k], out["ref"][1][k], out["same"][1][k], atol=1e-5)
    _within_budget(out["ours"][2], out["ref"][2], out["same"][2], atol=1e-6)
    _within_budget(out["ours"][3], out["ref"][3], out["same"][3], atol=1e-6)
