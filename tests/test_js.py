"""JS distance (fused with the LM head and from logits) against the reference and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import assert_within_budget, max_err
from scipy.spatial.distance import jensenshannon

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R


def _heads(n, v, d, k=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(n, d, generator=g)
    shape = (n, d) if k is None else (k, n, d)
    hq = hp + 0.5 * torch.randn(shape, generator=g)
    w = torch.randn(v, d, generator=g) / max(d, 1) ** 0.5
    b = torch.randn(v, generator=g) * 0.1
    return hp.to(dtype), hq.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("v", [1, 2, 1000, 50257])
@pytest.mark.parametrize("d", [1, 3, 64])
def test_linear_js_matches_reference(backend, n, v, d):
    hp, hq, w, b = _heads(n, v, d, k=3)
    out = mk.linear_js_distance(hp, hq, w, bias=b, temperature=0.9, backend=backend)
    ref = R.linear_js_distance_ref(
        hp.double(), hq.double(), w.double(), bias=b.double(), temperature=0.9
    )
    plain = R.linear_js_distance_ref(hp, hq, w, bias=b, temperature=0.9)
    assert out.shape == (3, n) and out.dtype == torch.float32
    assert_within_budget(out, ref, plain, atol=2e-5, name="js")


def test_linear_js_single_stream_and_padded_layout(backend):
    hp, hq, w, b = _heads(12, 1000, 8, seed=1)
    flat = mk.linear_js_distance(hp, hq, w, bias=b, backend=backend)
    assert flat.shape == (12,)
    padded = mk.linear_js_distance(hp.view(3, 4, 8), hq.view(3, 4, 8), w, bias=b, backend=backend)
    assert padded.shape == (3, 4)
    assert torch.allclose(padded.reshape(-1), flat, atol=1e-7, rtol=0)
    many = mk.linear_js_distance(hp, hq[None].expand(2, 12, 8), w, bias=b, backend=backend)
    assert many.shape == (2, 12) and torch.allclose(many[1], flat, atol=1e-7, rtol=0)


def test_js_bf16_within_budget(backend):
    hp, hq, w, b = _heads(7, 1000, 64, k=2, dtype=torch.bfloat16, seed=2)
    out = mk.linear_js_distance(hp, hq, w, bias=b, backend=backend)
    ref = R.linear_js_distance_ref(hp.double(), hq.double(), w.double(), bias=b.double())
    plain = R.linear_js_distance_ref(hp, hq, w, bias=b)
    assert_within_budget(out, ref, plain, atol=1e-3, name="js bf16")


def test_js_equals_scipy(backend):
    rng = np.random.default_rng(3)
    logits_p = rng.normal(size=(20, 257)) * 2
    logits_q = rng.normal(size=(20, 257)) * 2
    out = mk.js_distance(
        torch.tensor(logits_p, dtype=torch.float32),
        torch.tensor(logits_q, dtype=torch.float32),
        backend=backend,
    )

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    expect = np.array(
        [jensenshannon(a, b, base=2) for a, b in zip(softmax(logits_p), softmax(logits_q))]
    )
    np.testing.assert_allclose(out.numpy(), expect, atol=2e-6, rtol=0)


def test_js_properties(backend):
    g = torch.Generator().manual_seed(4)
    p = torch.randn(64, 1000, generator=g) * 3
    q = torch.randn(64, 1000, generator=g) * 3
    d_pq = mk.js_distance(p, q, backend=backend)
    d_qp = mk.js_distance(q, p, backend=backend)
    assert torch.equal(d_pq, d_qp) or max_err(d_pq, d_qp) < 1e-6  # symmetric
    assert ((d_pq >= 0) & (d_pq <= 1)).all()
    assert torch.equal(mk.js_distance(p, p, backend=backend), torch.zeros(64))  # exactly 0
    # disjoint supports: distance 1
    a = torch.full((3, 10), -1e4)
    b = torch.full((3, 10), -1e4)
    a[:, :5] = 0
    b[:, 5:] = torch.randn(3, 5, generator=g)
    assert torch.allclose(mk.js_distance(a, b, backend=backend), torch.ones(3), atol=1e-6)
    # tiny perturbation: small but nonzero, and close to the float64 value
    q2 = p + 1e-3 * torch.randn(64, 1000, generator=g)
    d = mk.js_distance(p, q2, backend=backend)
    ref = R.js_distance_ref(p.double(), q2.double())
    assert (d > 0).all() and max_err(d, ref) < 5e-4 * ref.max().item() + 1e-6


@pytest.mark.parametrize("kind", ["huge", "equal", "onehot"])
def test_js_extreme_logits_finite(backend, kind):
    g = torch.Generator().manual_seed(5)
    if kind == "huge":
        p, q = torch.randn(4, 1000, generator=g) * 1e4, torch.randn(4, 1000, generator=g) * 1e4
    elif kind == "equal":
        p, q = torch.zeros(4, 1000), torch.full((4, 1000), 7.0)
    else:
        p = torch.full((4, 1000), -1e4)
        q = torch.full((4, 1000), -1e4)
        p[:, 0] = 1e4
        q[:, 1] = 1e4
    d = mk.js_distance(p, q, backend=backend)
    ref = R.js_distance_ref(p.double(), q.double())
    assert torch.isfinite(d).all()
    assert max_err(d, ref) < 1e-5
    if kind == "equal":  # same distribution from shifted logits: 0 up to fp32 rounding
        assert (d < 1e-6).all()


def test_js_one_vs_many_from_logits(backend):
    g = torch.Generator().manual_seed(6)
    p = torch.randn(2, 5, 5003, generator=g)
    q = torch.randn(3, 2, 5, 5003, generator=g)
    d = mk.js_distance(p, q, temperature=0.7, backend=backend)
    assert d.shape == (3, 2, 5)
    ref = R.js_distance_ref(
        p.reshape(10, -1).double(), q.reshape(3, 10, -1).double(), temperature=0.7
    )
    assert max_err(d.reshape(3, 10), ref) < 1e-6
    one = mk.js_distance(p[0, 0], q[:, 0, 0], temperature=0.7, backend=backend)
    assert one.shape == (3,) and max_err(one, d[:, 0, 0]) < 1e-7


def test_js_has_no_gradient_and_leaves_inputs(backend):
    hp, hq, w, b = _heads(5, 100, 4, k=2, seed=7)
    hp.requires_grad_()
    before = hq.clone()
    out = mk.linear_js_distance(hp, hq, w, bias=b, backend=backend)
    assert not out.requires_grad
    assert torch.equal(hq, before)


def test_opcheck_js(backend):
    hp, hq, w, b = _heads(5, 11, 3, k=2, seed=8)
    torch.library.opcheck(torch.ops.mrtpo.linear_js_distance.default, (hp, hq, w, b, 1.0, backend))
    torch.library.opcheck(
        torch.ops.mrtpo.js_distance.default,
        (torch.randn(4, 9), torch.randn(2, 4, 9), 1.0, backend),
    )


def test_js_upper_bound_is_one():
    assert math.isclose(
        R.js_distance_ref(torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]])).item(), 1.0
    )


def test_js_with_masked_vocabulary_entries(backend):
    # -inf logits (a masked vocabulary) contribute nothing, as in the reference
    g = torch.Generator().manual_seed(9)
    p = torch.randn(6, 500, generator=g)
    q = torch.randn(6, 500, generator=g)
    p[:, :100] = float("-inf")
    q[:, 50:120] = float("-inf")
    d = mk.js_distance(p, q, backend=backend)
    ref = R.js_distance_ref(p.double(), q.double())
    assert torch.isfinite(d).all()
    assert max_err(d, ref) < 1e-6
    assert torch.equal(mk.js_distance(p, p, backend=backend), torch.zeros(6))
