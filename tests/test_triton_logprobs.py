"""Triton log-prob and entropy kernels (mrtpo_kernels/triton_kernels/logprobs.py); the fused policy
loss is in test_triton_policy_loss.py.

CPU: the kernels run under the Triton interpreter, which must be switched on before triton
is imported, so the checks live in tests/triton_cases/logprobs_cases.py and run here in a
subprocess per Triton variant (MRTPO_TRITON_VARIANT=rows: the chunk driver with the row
kernels of triton_kernels/rows.py; fused: triton_kernels/logprobs.py): odd shapes, all
tokens ignored, extreme logits, temperature, bias, gradients with random upstream
gradients, torch.library.opcheck.
GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): the real shapes in bf16 and fp32
against float64 references computed in row chunks, torch.compile(fullgraph=True) of a
caller, and N x V > 2^31.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_cases._harness import CASES, VARIANTS, needs_triton, run_interpreted

import mrtpo_kernels as mk
from mrtpo_kernels.reference import (
    linear_logprobs_ref,
    logprobs_from_logits_ref,
)


@needs_triton
@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_logprobs_under_interpreter(variant):
    run_interpreted(CASES / "logprobs_cases.py", env={"MRTPO_TRITON_VARIANT": variant})


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_backend_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.triton_kernels import logprobs

    h, w = torch.randn(3, 4), torch.randn(5, 4)
    lab = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="hidden"):
        logprobs.linear_logprobs_fwd(h, w, None, lab, 1.0, -100, False)
    with pytest.raises(ValueError, match="logits"):
        logprobs.logprobs_from_logits_fwd(torch.randn(3, 5), lab, 1.0, -100, False)


# --------------------------------------------------------------------------- GPU


def gpu_test(fn):
    """Marked ``gpu`` (deselected by default) and skipped where CUDA is absent."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


V_REAL = 151936
DEV = "cuda"  # the GPU tests run on the first CUDA device


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _within_budget(ours, ref64, same, atol):
    """The numerics contract: error <= 2 x plain PyTorch's in the same dtype + atol."""
    e, base = _err(ours, ref64), _err(same, ref64)
    assert e <= 2 * base + atol, f"error {e:.3e} > 2 x {base:.3e} + {atol:g}"


def _rows_ref(h, w, lab, dtype, rows=1024, **kw):
    """linear_logprobs_ref in ``dtype``, row chunk by row chunk (the rows are independent)."""
    outs = []
    wd = w.to(dtype)
    for s in range(0, h.shape[0], rows):
        out = linear_logprobs_ref(h[s : s + rows].to(dtype), wd, lab[s : s + rows], **kw)
        outs.append(out if isinstance(out, tuple) else (out,))
    return [torch.cat(parts) for parts in zip(*outs)]


def _inputs(n, d, dtype, seed=0, v=V_REAL):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(n, d, device=DEV, generator=g).to(dtype)
    w = (torch.randn(v, d, device=DEV, generator=g) / d**0.5).to(dtype)
    lab = torch.randint(0, v, (n,), device=DEV, generator=g)
    lab[::7] = -100
    return h, w, lab


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n,d", [(16384, 896), (4096, 4096)])
def test_gpu_linear_logprobs_real_shapes(n, d, dtype):
    h, w, lab = _inputs(n, d, dtype)
    kw = dict(temperature=0.9, return_entropy=True)
    lp, en = mk.linear_logprobs(h, w, lab, backend="triton", **kw)
    with torch.no_grad():
        rl, re = _rows_ref(h, w, lab, torch.float64, **kw)
        sl, se = _rows_ref(h, w, lab, dtype, **kw)
    _within_budget(lp, rl, sl, atol=1e-4)
    _within_budget(en, re, se, atol=1e-4)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_linear_logprobs_grad_real_shape(dtype):
    n, d = 1024, 4096
    h, w, lab = _inputs(n, d, dtype, seed=1)
    b = torch.randn(V_REAL, device=DEV).to(dtype)
    g = torch.Generator(device=DEV).manual_seed(2)
    g_lp = torch.randn(n, device=DEV, generator=g)
    g_en = torch.randn(n, device=DEV, generator=g)
    grads = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww, bb = (t.detach().to(dt).requires_grad_() for t in (h, w, b))
        kw = dict(bias=bb, temperature=1.1, return_entropy=True)
        if key == "ours":
            lp, en = mk.linear_logprobs(hh, ww, lab, backend="triton", **kw)
        else:
            lp, en = linear_logprobs_ref(hh, ww, lab, **kw)
        ((lp.float() * g_lp).sum() + (en.float() * g_en).sum()).backward()
        grads[key] = (hh.grad, ww.grad, bb.grad)
        del lp, en
    assert grads["ours"][0].dtype == dtype
    for i in range(3):
        _within_budget(grads["ours"][i], grads["ref"][i], grads["same"][i], atol=1e-5)


@gpu_test
def test_gpu_torch_compile_fullgraph():
    h, w, lab = _inputs(300, 256, torch.bfloat16, seed=5, v=5003)
    old = torch.full((300,), -8.0, device=DEV)
    adv = torch.randn(300, device=DEV)

    def caller(h, w):
        lp, en = mk.linear_logprobs(h, w, lab, return_entropy=True, backend="triton")
        loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, backend="triton")
        return lp.sum() + 0.1 * en.sum() + loss

    compiled = torch.compile(caller, fullgraph=True)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    eager = caller(h1, w1)
    eager.backward()
    got = compiled(h2, w2)
    got.backward()
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)


@gpu_test
def test_gpu_no_int32_overflow():
    """N x V > 2^31 for both the logits path (5 GB of bf16 logits) and the fused path."""
    n, v = 16384, V_REAL
    assert n * v > 2**31
    g = torch.Generator(device=DEV).manual_seed(6)
    logits = torch.randn(n, v, device=DEV, generator=g).to(torch.bfloat16)
    lab = torch.randint(0, v, (n,), device=DEV, generator=g)
    z = logits.requires_grad_()
    lp, en = mk.logprobs_from_logits(z, lab, return_entropy=True, backend="triton")
    lp.sum().backward()
    tail = slice(n - 8, n)  # rows whose element offsets are past 2^31
    z64 = logits[tail].detach().double().requires_grad_()
    rl, re = logprobs_from_logits_ref(z64, lab[tail], return_entropy=True)
    rl.sum().backward()
    assert _err(lp[tail], rl) < 1e-4 and _err(en[tail], re) < 1e-4
    assert _err(z.grad[tail], z64.grad) < 1e-2
    del z, logits, lp, en
    h, w, lab = _inputs(n, 64, torch.bfloat16, seed=7)
    lp = mk.linear_logprobs(h, w, lab, backend="triton")
    rl = linear_logprobs_ref(h[tail].double(), w.double(), lab[tail])
    assert _err(lp[tail], rl) < 1e-3
