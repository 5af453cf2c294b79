"""The public ops inside a caller's torch.autocast region (the trainer's --autocast runs the
decoder's forwards under it): values and gradients as without it, at fp32 accuracy against
float64 (autocast does not reach the GEMMs of the registered custom ops)."""

from __future__ import annotations

import pytest
import torch

from mrtpo_kernels import linear_js_distance, linear_logprobs, linear_policy_loss
from mrtpo_kernels.reference import linear_logprobs_ref as ref_linear_logprobs


def _inputs(seed=0, n=24, d=32, v=301):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g) * 2
    w = torch.randn(v, d, generator=g) * 0.5
    lab = torch.randint(0, v, (n,), generator=g)
    return h, w, lab


def _grads(fn, *leaves):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    out.sum().backward()
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_logprobs_under_autocast_match_float64(backend):
    h, w, lab = _inputs()
    fn = lambda a, b: linear_logprobs(a, b, lab, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, (gh, gw) = _grads(fn, h, w)
    ref, (rh, rw) = _grads(lambda a, b: ref_linear_logprobs(a, b, lab), h.double(), w.double())
    assert out.dtype == torch.float32
    # fp32 accuracy, not bf16's (bf16 logits are off by ~1e-2 here)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-4, atol=1e-5)


def test_policy_loss_and_js_under_autocast_equal_plain_calls():
    h, w, lab = _inputs(1)
    old = torch.randn(h.shape[0]) * 0.1 - 3
    adv = torch.randn(h.shape[0])
    fn = lambda a, b: linear_policy_loss(a, b, lab, old, adv)[0]
    plain, (ph, pw) = _grads(fn, h, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp, (ah, aw) = _grads(fn, h, w)
    torch.testing.assert_close(amp, plain, rtol=0, atol=0)
    torch.testing.assert_close(ah, ph, rtol=0, atol=0)
    torch.testing.assert_close(aw, pw, rtol=0, atol=0)
    hq = h + 0.3 * torch.randn_like(h)
    want = linear_js_distance(h, hq, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_js_distance(h, hq, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autocast_is_restored_after_the_op():
    h, w, lab = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_logprobs(h, w, lab)
        assert torch.is_autocast_enabled("cpu")
        assert (h @ w.T).dtype == torch.bfloat16
