"""linear_logprobs and logprobs_from_logits against the float64 reference (CPU backends)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_within_budget, max_err

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R

SHAPES = [(n, v, d) for n in (1, 7, 129) for v in (1, 2, 1000, 50257) for d in (1, 3, 64)]


def _inputs(n, v, d, dtype=torch.float32, seed=0, scale=1.0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g) * scale
    w = torch.randn(v, d, generator=g) / max(d, 1) ** 0.5
    b = torch.randn(v, generator=g) * 0.1 if bias else None
    lab = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        lab[1] = -100
    return h.to(dtype), w.to(dtype), None if b is None else b.to(dtype), lab


@pytest.mark.parametrize("n,v,d", SHAPES)
def test_linear_logprobs_fp32_matches_reference(backend, n, v, d):
    h, w, b, lab = _inputs(n, v, d)
    lp, ent = mk.linear_logprobs(
        h, w, lab, bias=b, temperature=0.8, return_entropy=True, backend=backend
    )
    rlp, rent = R.linear_logprobs_ref(
        h.double(), w.double(), lab, bias=b.double(), temperature=0.8, return_entropy=True
    )
    plp, pent = R.linear_logprobs_ref(h, w, lab, bias=b, temperature=0.8, return_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (n,)
    assert_within_budget(lp, rlp, plp, atol=1e-5, name="logp")
    assert_within_budget(ent, rent, pent, atol=1e-5, name="entropy")
    if n > 2:
        assert lp[1] == 0 and ent[1] == 0  # ignored token


@pytest.mark.parametrize("n,v,d", [(7, 1000, 64), (129, 2, 3), (1, 50257, 3)])
def test_linear_logprobs_bf16_within_2x_plain_bf16(backend, n, v, d):
    h, w, b, lab = _inputs(n, v, d, dtype=torch.bfloat16, scale=2.0)
    lp, ent = mk.linear_logprobs(h, w, lab, bias=b, return_entropy=True, backend=backend)
    rlp, rent = R.linear_logprobs_ref(
        h.double(), w.double(), lab, bias=b.double(), return_entropy=True
    )
    plp, pent = R.linear_logprobs_ref(h, w, lab, bias=b, return_entropy=True)
    assert_within_budget(lp, rlp, plp, atol=1e-4, name="logp")
    assert_within_budget(ent, rent, pent, atol=1e-4, name="entropy")


@pytest.mark.parametrize("n,v,d", [(7, 1000, 64), (129, 1000, 3), (1, 2, 1), (7, 1, 3)])
def test_linear_logprobs_gradients_random_upstream(backend, n, v, d):
    h, w, b, lab = _inputs(n, v, d, seed=1)
    g_lp, g_ent = torch.randn(n), torch.randn(n)

    def grads(fn, dtype):
        hh, ww, bb = (t.detach().to(dtype, copy=True).requires_grad_() for t in (h, w, b))
        lp, ent = fn(hh, ww, bb)
        ((lp * g_lp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()).backward()
        return hh.grad, ww.grad, bb.grad

    kern = grads(
        lambda hh, ww, bb: mk.linear_logprobs(
            hh, ww, lab, bias=bb, temperature=1.3, return_entropy=True, backend=backend
        ),
        torch.float32,
    )

    def ref(hh, ww, bb):
        return R.linear_logprobs_ref(hh, ww, lab, bias=bb, temperature=1.3, return_entropy=True)

    truth = grads(ref, torch.float64)
    plain = grads(ref, torch.float32)
    for name, a, t, p in zip(("hidden", "weight", "bias"), kern, truth, plain):
        assert a.dtype == torch.float32
        assert_within_budget(a, t, p, atol=1e-5, name=f"grad_{name}")


def test_linear_logprobs_gradcheck_float64(backend):
    h, w, b, lab = _inputs(4, 6, 3, dtype=torch.float64, seed=2)
    lab[0] = -100
    h.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()

    def fn(hh, ww, bb):
        lp, ent = mk.linear_logprobs(
            hh, ww, lab, bias=bb, temperature=0.7, return_entropy=True, backend=backend
        )
        return lp, ent

    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-6, atol=1e-7)


def test_logprobs_only_gradient_no_entropy(backend):
    h, w, _, lab = _inputs(7, 1000, 64, seed=3, bias=False)
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    mk.linear_logprobs(hh, ww, lab, backend=backend).sum().backward()
    rh, rw = h.double().requires_grad_(), w.double().requires_grad_()
    R.linear_logprobs_ref(rh, rw, lab).sum().backward()
    assert max_err(hh.grad, rh.grad) < 1e-12 and max_err(ww.grad, rw.grad) < 1e-12


def test_padded_layout_and_chunk_boundaries(backend, monkeypatch):
    # Tiny chunk budget: many chunks, rows split at odd places; results must not change.
    h, w, b, lab = _inputs(30, 1000, 8, seed=4)
    ref = mk.linear_logprobs(h, w, lab, bias=b, backend=backend)
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * 1000 * 7))  # 7 rows per chunk
    lp3 = mk.linear_logprobs(h.view(5, 6, 8), w, lab.view(5, 6), bias=b, backend=backend)
    assert lp3.shape == (5, 6)
    assert torch.allclose(lp3.reshape(-1), ref, atol=1e-6, rtol=0)


def test_all_tokens_ignored(backend):
    h, w, b, _ = _inputs(7, 1000, 3)
    lab = torch.full((7,), -100)
    hh = h.clone().requires_grad_()
    lp, ent = mk.linear_logprobs(hh, w, lab, bias=b, return_entropy=True, backend=backend)
    assert torch.equal(lp, torch.zeros(7)) and torch.equal(ent, torch.zeros(7))
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(hh.grad, torch.zeros_like(h))


@pytest.mark.parametrize("kind", ["huge", "equal", "onehot"])
def test_extreme_logits_are_finite(backend, kind):
    n, v = 5, 1000
    logits = torch.zeros(n, v)
    if kind == "huge":
        logits = torch.randn(n, v) * 1e4
    elif kind == "onehot":
        logits[:, 3] = 1e4
        logits[:, 4:] = -1e4
    lab = torch.tensor([3, 0, 999, 3, 500])
    lp, ent = mk.logprobs_from_logits(logits, lab, return_entropy=True, backend=backend)
    rlp, rent = R.logprobs_from_logits_ref(logits.double(), lab, return_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert max_err(lp, rlp) <= 1e-6 * max(1.0, rlp.abs().max().item())
    assert max_err(ent, rent) < 1e-4
    if kind == "equal":
        assert torch.allclose(ent, torch.full((n,), torch.log(torch.tensor(1000.0)).item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits_and_gradient(backend, dtype):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 7, 5003, generator=g) * 3).to(dtype)
    lab = torch.randint(0, 5003, (2, 7), generator=g)
    lab[0, 0] = -100
    x = logits.clone().requires_grad_()
    lp, ent = mk.logprobs_from_logits(x, lab, temperature=0.9, return_entropy=True, backend=backend)
    g_lp, g_ent = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    (lp * g_lp + ent * g_ent).sum().backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    r = logits.double().requires_grad_()
    rlp, rent = R.logprobs_from_logits_ref(r, lab, temperature=0.9, return_entropy=True)
    (rlp * g_lp + rent * g_ent).sum().backward()
    p = logits.clone().requires_grad_()
    plp, pent = R.logprobs_from_logits_ref(p, lab, temperature=0.9, return_entropy=True)
    (plp * g_lp.to(dtype) + pent * g_ent.to(dtype)).sum().backward()
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_within_budget(lp, rlp, plp, atol=atol, name="logp")
    assert_within_budget(ent, rent, pent, atol=atol, name="entropy")
    assert_within_budget(x.grad, r.grad, p.grad, atol=atol, name="grad_logits")


def test_logprobs_from_logits_gradcheck(backend):
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    lab = torch.tensor([1, -100, 4])
    assert torch.autograd.gradcheck(
        lambda z: mk.logprobs_from_logits(z, lab, return_entropy=True, backend=backend), (logits,)
    )


def test_opcheck_linear_logprobs(backend):
    h, w, b, lab = _inputs(5, 11, 3, seed=6)
    h.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(
        torch.ops.mrtpo.linear_logprobs_fwd.default,
        (h, w, b, lab, 0.9, -100, True, backend),
    )
    z = torch.randn(5, 11, requires_grad=True)
    torch.library.opcheck(
        torch.ops.mrtpo.logprobs_from_logits_fwd.default, (z, lab, 1.0, -100, False, backend)
    )


def test_masked_vocabulary_entries(backend):
    # -inf logits (a masked vocabulary): finite entropy and gradients, as in the reference
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 300, generator=g)
    logits[:, 200:] = float("-inf")
    lab = torch.randint(0, 200, (5,), generator=g)
    x = logits.clone().requires_grad_()
    lp, ent = mk.logprobs_from_logits(x, lab, return_entropy=True, backend=backend)
    (lp.sum() + ent.sum()).backward()
    # the same distribution over the unmasked entries; masked entries get no gradient
    r = logits[:, :200].double().requires_grad_()
    rlp, rent = R.logprobs_from_logits_ref(r, lab, return_entropy=True)
    (rlp.sum() + rent.sum()).backward()
    assert max_err(lp, rlp) < 1e-5 and max_err(ent, rent) < 1e-5
    assert max_err(x.grad[:, :200], r.grad) < 1e-5
    assert torch.equal(x.grad[:, 200:], torch.zeros(5, 100))
