"""linear_logprobs and logprobs_from_logits: every check of the two ops in one place.

- CPU backends (the ``backend`` fixture: cpu, torch) against the float64 reference.
- Extreme inputs (more, shared with js_distance: tests/test_numerics_extreme.py).
- Fuzz (hypothesis; shared machinery in tests/fuzzing.py): ``test_fuzz``, and the
  ``slow``-marked ``test_fuzz_long``.
- Triton under the interpreter (marker ``triton``; ``make test-triton``): TRITON_INTERPRET=1
  must be set before triton is imported, so the ``group_*`` functions below run in a
  subprocess (the chunk driver with the row kernels of triton_kernels/rows.py), started by
  tests/triton_cases/_harness.py: odd shapes, all tokens ignored, extreme logits,
  temperature, bias, gradients with random upstream gradients, torch.library.opcheck. The
  policy loss is in tests/test_policy_loss.py.
- GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): the real shapes in bf16 and fp32
  against float64 references computed in row chunks, torch.compile(fullgraph=True) of a
  caller, and N x V > 2^31.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import assert_within_budget, max_err
from fuzzing import (
    DTYPES,
    INJECT,
    LAYOUTS,
    TEMPS,
    _acc,
    _assert_matches,
    _backends,
    _body,
    _gemm_tol,
    _inject,
    _linear_case,
    _low,
    _names_an_argument,
    _scale,
    _tensor,
    fuzz_tests,
)
from hypothesis import strategies as st
from triton_cases import _harness
from triton_cases._harness import (
    close,
    expect,
    interpreted,
    needs_triton,
    opcheck,
    run_groups,
)

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R
from mrtpo_kernels.backends import cpu_backend
from mrtpo_kernels.reference import (
    linear_logprobs_ref,
    logprobs_from_logits_ref,
)

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


# --------------------------------------------------------------------------- extreme inputs


BACKENDS = ["torch"] + (["cpu"] if cpu_backend.available() else [])
FMAX = torch.finfo(torch.float32).max
V = 67


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflowing_spread_row(backend):
    """Finite logits at both ends of the float range: z / T overflows both ways at T < 1."""
    z = torch.zeros(2, V)
    z[:, :3] = FMAX
    z[:, 3:6] = -FMAX
    y = torch.tensor([1, 4])
    lp, en = mk.logprobs_from_logits(z, y, temperature=0.3, return_entropy=True, backend=backend)
    rlp, ren = R.logprobs_from_logits_ref(z.double(), y, temperature=0.3, return_entropy=True)
    assert rlp[0].item() == pytest.approx(-math.log(3)) and rlp[1].item() < -1e38
    torch.testing.assert_close(lp[0].double(), rlp[0], rtol=0, atol=1e-6)
    assert lp[1].item() == float("-inf") or abs(lp[1].item() / rlp[1].item() - 1) < 1e-6
    torch.testing.assert_close(en.double(), ren, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- fuzz


@st.composite
def _logits_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    backend = draw(st.sampled_from(_backends("logprobs_from_logits", dtype)))
    n = draw(st.integers(1, 9))
    v = draw(st.integers(1, 13))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    z = _tensor((n, v), dtype, scale=_scale(draw, dtype), layout=draw(LAYOUTS), gen=gen)
    z = _inject(z, draw(INJECT), gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = -100
    bad = draw(st.sampled_from([None, None, None, v, -1, -101, 2**40]))
    if bad is not None:
        labels[int(torch.randint(0, n, (1,), generator=gen))] = bad
    temp = draw(st.sampled_from(TEMPS))
    return backend, z, labels, temp


def _check_logprobs_from_logits(case):
    backend, z, labels, temp = case
    fn = mk.logprobs_from_logits
    zz = z.detach().clone().requires_grad_()
    try:
        lp, en = fn(zz, labels, temperature=temp, return_entropy=True, backend=backend)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        in_range = (labels == -100) | ((labels >= 0) & (labels < z.shape[-1]))
        assert not bool(in_range.all()), f"ValueError on valid input: {e}"
        return
    g = torch.linspace(-1, 1, z.shape[0])
    (lp * g).sum().backward()
    zr = z.detach().double().requires_grad_()
    rlp, ren = R.logprobs_from_logits_ref(zr, labels, temperature=temp, return_entropy=True)
    (rlp * g.double()).sum().backward()
    plp, pen = R.logprobs_from_logits_ref(_low(z), labels, temperature=temp, return_entropy=True)
    what = f"logprobs_from_logits[{backend}, {z.dtype}, T={temp}]"
    _assert_matches(lp, rlp, plp, what + " logp", atol=2e-5)
    _assert_matches(en, ren, pen, what + " entropy", atol=2e-5)
    gscale = 1.0 / temp
    zg = zr.grad.nan_to_num(0.0)
    out_eps = torch.finfo(z.dtype).eps  # the gradient is returned in the logits' dtype
    _assert_matches(zz.grad, zr.grad, zg, what + " grad", atol=4e-5 * gscale, rtol=out_eps)


@_body(st.data())
def _linear_logprobs_body(data):
    backend, h, w, bias, temp, gen, draw = data.draw(_linear_case("linear_logprobs"))
    n, v = h.shape[0], w.shape[0]
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = -100
    fn = mk.linear_logprobs
    hh = h.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    lp, en = fn(hh, ww, labels, bias=bias, temperature=temp, return_entropy=True,
                backend=backend)  # fmt: skip
    g = torch.linspace(-1, 1, n)
    (lp * g).sum().backward()
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    br = None if bias is None else bias.double()
    rlp, ren = R.linear_logprobs_ref(hr, wr, labels, bias=br, temperature=temp,
                                     return_entropy=True)  # fmt: skip
    (rlp * g.double()).sum().backward()
    bl = None if bias is None else _low(bias)
    plp, pen = R.linear_logprobs_ref(_low(h), _low(w), labels, bias=bl, temperature=temp,
                                     return_entropy=True)  # fmt: skip
    what = f"linear_logprobs[{backend}, {h.dtype}, T={temp}]"
    tol = 2e-5 + 2 * _gemm_tol(h, w, temp, _acc(h))
    _assert_matches(lp, rlp, plp, what + " logp", atol=tol)
    _assert_matches(en, ren, pen, what + " entropy", atol=2 * tol)
    g_tol = 4e-5 / temp + tol / temp
    wm = w.double().abs().amax().item()
    hm = h.double().nan_to_num(0.0, 0.0, 0.0).abs().amax().item()
    _assert_matches(hh.grad.float(), hr.grad, hr.grad, what + " dhidden", atol=4 * v * wm * g_tol,
                    rtol=torch.finfo(h.dtype).eps)  # fmt: skip
    _assert_matches(ww.grad.float(), wr.grad, wr.grad, what + " dweight", atol=4 * n * hm * g_tol,
                    rtol=torch.finfo(h.dtype).eps)  # fmt: skip


def _run_logits(case):
    _check_logprobs_from_logits(case)


@_body(_logits_case())
def _logits_body(case):
    _run_logits(case)


FUZZ = {"logprobs_from_logits": _logits_body, "linear_logprobs": _linear_logprobs_body}

test_fuzz, test_fuzz_long = fuzz_tests(FUZZ)


# --------------------------------------------------------------------------- Triton (interpreter)


@interpreted
def test_triton_logprobs_under_interpreter():
    """The groups below (group_*), in one subprocess."""
    run_groups(__file__)


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_backend_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.backends import triton_backend as tb

    h, w = torch.randn(3, 4), torch.randn(5, 4)
    lab = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="hidden"):
        tb.linear_logprobs_fwd(h, w, None, lab, 1.0, -100, False)
    with pytest.raises(ValueError, match="logits"):
        tb.logprobs_from_logits_fwd(torch.randn(3, 5), lab, 1.0, -100, False)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def _triton_linear_case(
    n, v, d, *, bias, temp, entropy, scale=1.0, ignore_every=3, seed=0, tag="",
    dtype=torch.float32,
):  # fmt: skip
    """Forward values and gradients (random upstream) of linear_logprobs vs the reference;
    the inputs are rounded to ``dtype`` once so that every run sees the same values."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) * (scale / d**0.5)).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    lab = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        lab[::ignore_every] = -100
    g_lp = torch.randn(n, generator=g)
    g_en = torch.randn(n, generator=g)
    name = f"linear N={n} V={v} d={d} bias={bias} T={temp} ent={entropy} {dtype}{tag}"
    runs = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww = _leaf(h, dt), _leaf(w, dt)
        bb = _leaf(b, dt) if bias else None
        kw = dict(bias=bb, temperature=temp, return_entropy=entropy)
        if key == "ours":
            out = mk.linear_logprobs(hh, ww, lab, backend="triton", **kw)
        else:
            out = linear_logprobs_ref(hh, ww, lab, **kw)
        lp, en = out if entropy else (out, None)
        loss = (lp * g_lp.to(lp.dtype)).sum()
        if entropy:
            loss = loss + (en * g_en.to(en.dtype)).sum()
        loss.backward()
        runs[key] = (lp, en, hh.grad, ww.grad, bb.grad if bias else None)
    ours, same, ref = runs["ours"], runs["same"], runs["ref"]
    expect(name + " logp dtype", ours[0].dtype == torch.float32, str(ours[0].dtype))
    expect(name + " grad dtype", ours[2].dtype == dtype, str(ours[2].dtype))
    for i, what in enumerate(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias")):
        if ref[i] is None:
            continue
        close(f"{name} {what}", ours[i], ref[i], same[i])
    return ours


# --------------------------------------------------------------------------- groups


def group_backend():
    for op in ("linear_logprobs", "logprobs_from_logits"):
        got = mk.resolve_backend(op, "cpu", torch.float32, "triton")
        expect(f"resolve {op}", got == "triton", f"resolved to {got!r}")


def group_linear_shapes():
    for n in (1, 7, 129):
        for v in (1, 1000, 5003):
            for d in (3, 64):
                _triton_linear_case(n, v, d, bias=(n + v) % 2 == 0, temp=0.7, entropy=True)


def group_linear_flags():
    _triton_linear_case(33, 1000, 64, bias=False, temp=1.0, entropy=False)
    _triton_linear_case(33, 1000, 64, bias=True, temp=2.5, entropy=False, ignore_every=0)
    _triton_linear_case(20, 700, 17, bias=True, temp=0.3, entropy=True, ignore_every=2)
    _triton_linear_case(33, 1000, 64, bias=True, temp=0.9, entropy=True, dtype=torch.bfloat16)
    _triton_linear_case(7, 300, 16, bias=False, temp=1.0, entropy=True, dtype=torch.float16)


def group_linear_chunks():
    """The driver over several chunks (a tiny MRTPO_CHUNK_BYTES): 13 rows per token chunk
    (the low-memory mode's vocabulary chunks: tests/triton_cases/rows_cases.py)."""
    with _harness.env(MRTPO_CHUNK_BYTES=129 * 4 * 512):
        _triton_linear_case(129, 5003, 64, bias=True, temp=0.9, entropy=True, tag=" chunked")


def group_linear_extreme():
    """Logits around +-1e4 (weights scaled by 1e4): finite, within the error budget."""
    _triton_linear_case(7, 1000, 64, bias=False, temp=1.0, entropy=True, scale=1e4, tag=" extreme")
    _triton_linear_case(7, 5003, 3, bias=True, temp=0.5, entropy=True, scale=1e4, tag=" extreme")


def group_all_ignored():
    n, v, d = 9, 1000, 64
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    b = torch.randn(v, requires_grad=True)
    lab = torch.full((n,), -100)
    lp, en = mk.linear_logprobs(h, w, lab, bias=b, return_entropy=True, backend="triton")
    (lp * torch.randn(n) + en * torch.randn(n)).sum().backward()
    for name, t in (("logp", lp), ("entropy", en), ("dh", h.grad), ("dw", w.grad)):
        expect(f"all ignored {name}", bool((t == 0).all()), "expected exact zeros")
    expect("all ignored db", bool((b.grad == 0).all()), "expected exact zeros")
    z = torch.randn(n, v, requires_grad=True)
    lp, en = mk.logprobs_from_logits(z, lab, return_entropy=True, backend="triton")
    (lp + en).sum().backward()
    expect("all ignored logits", bool((lp == 0).all() and (en == 0).all()), "nonzero")
    expect("all ignored dlogits", bool((z.grad == 0).all()), "nonzero")


def _triton_logits_case(n, v, dtype, *, temp, neg_inf=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * 3).to(dtype)
    lab = torch.randint(0, v, (n,), generator=g)
    lab[1::4] = -100
    if neg_inf and v > 2:
        z[:, 1::3] = float("-inf")  # a masked vocabulary
        lab = torch.where(lab % 3 == 1, lab - 1, lab)
    g_lp = torch.randn(n, generator=g)
    g_en = torch.randn(n, generator=g)
    name = f"logits N={n} V={v} {dtype} T={temp}" + (" -inf" if neg_inf else "")
    zz = z.clone().requires_grad_()
    lp, en = mk.logprobs_from_logits(
        zz, lab, temperature=temp, return_entropy=True, backend="triton"
    )
    z64 = z.double().requires_grad_()
    rl, re = logprobs_from_logits_ref(z64, lab, temperature=temp, return_entropy=True)
    # ours upcasts to fp32 in registers: hold it to fp32 accuracy on the same input values
    close(f"{name} logp", lp, rl, atol=1e-5, rtol=1e-6)
    close(f"{name} entropy", en, re, atol=1e-5, rtol=1e-6)
    if neg_inf:  # the reference's entropy gradient is undefined at p = 0: logp only
        (lp * g_lp).sum().backward()
        (rl * g_lp.double()).sum().backward()
    else:
        (lp * g_lp + en * g_en).sum().backward()
        (rl * g_lp.double() + re * g_en.double()).sum().backward()
    expect(f"{name} grad dtype", zz.grad.dtype == dtype, str(zz.grad.dtype))
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is stored in dtype
    close(f"{name} grad_logits", zz.grad, z64.grad, atol=1e-6, rtol=rtol)


def group_logits():
    for n in (1, 7, 129):
        for v in (1, 1000, 5003):
            _triton_logits_case(n, v, torch.float32, temp=1.3)
    _triton_logits_case(7, 1000, torch.bfloat16, temp=0.8)
    _triton_logits_case(7, 1000, torch.float16, temp=1.0)
    _triton_logits_case(7, 1000, torch.float32, temp=1.0, neg_inf=True)
    z = torch.randn(7, 100) * 1e4  # extreme logits
    lab = torch.randint(0, 100, (7,))
    lp, en = mk.logprobs_from_logits(z, lab, return_entropy=True, backend="triton")
    rl, re = logprobs_from_logits_ref(z.double(), lab, return_entropy=True)
    close("logits extreme logp", lp, rl, atol=1e-5, rtol=1e-6)
    close("logits extreme entropy", en, re, atol=1e-5, rtol=1e-6)


def group_float64():
    """float64 inputs: the triton backend hands them to the torch backend (float64 out)."""
    h = torch.randn(5, 8, dtype=torch.float64)
    w = torch.randn(50, 8, dtype=torch.float64)
    lab = torch.randint(0, 50, (5,))
    lp = mk.linear_logprobs(h, w, lab, backend="triton")
    expect("float64 dtype", lp.dtype == torch.float64, str(lp.dtype))
    close("float64 logp", lp, linear_logprobs_ref(h, w, lab), atol=1e-12, rtol=1e-12)


def group_opcheck():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(5, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True)
    lab = torch.randint(0, 40, (5,), generator=g)
    lab[0] = -100
    z = torch.randn(5, 40, generator=g, requires_grad=True)
    cases = [
        ("linear_logprobs_fwd", (h, w, b, lab, 1.3, -100, True, "triton")),
        ("linear_logprobs_fwd no bias", (h, w, None, lab, 1.0, -100, False, "triton")),
        ("logprobs_from_logits_fwd", (z, lab, 0.7, -100, True, "triton")),
    ]
    for name, args in cases:
        opcheck(name, getattr(torch.ops.mrtpo, name.split()[0]).default, args)


GROUPS = {
    name[len("group_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("group_")
}


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


def _gpu_inputs(n, d, dtype, seed=0, v=V_REAL):
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
    h, w, lab = _gpu_inputs(n, d, dtype)
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
    h, w, lab = _gpu_inputs(n, d, dtype, seed=1)
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
    h, w, lab = _gpu_inputs(300, 256, torch.bfloat16, seed=5, v=5003)
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
def test_gpu_overlap_rows_matches_the_serial_driver(monkeypatch):
    """MRTPO_OVERLAP_ROWS=1 (row kernels on a side stream beside the next chunk's GEMM) runs
    the same kernels on the same data as the serial driver: log-probs fwd+bwd and the policy
    loss's gradients are bitwise equal over several chunks (2000 rows: 5 chunks at this V)."""
    h, w, lab = _gpu_inputs(2000, 512, torch.bfloat16, seed=9)
    old = torch.full((2000,), -8.0, device=DEV)
    adv = torch.randn(2000, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))

    def run():
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, en = mk.linear_logprobs(hh, ww, lab, return_entropy=True, backend="triton")
        loss, _ = mk.linear_policy_loss(hh, ww, lab, old, adv, backend="triton")
        (lp.sum() + 0.1 * en.sum() + loss).backward()
        torch.cuda.synchronize()
        return lp.detach(), loss.detach(), hh.grad, ww.grad

    monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "0")
    serial = run()
    monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "1")
    overlapped = run()
    for a, b in zip(serial, overlapped, strict=True):
        assert torch.equal(a, b)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_triton_logit_cap(dtype):
    """The Triton path on the GPU (bf16: the 16-bit GEMMs and the separate 16-bit gradient
    buffer, ``out=``, which the interpreter never takes) with Gemma 2's cap and a scale:
    log-probs, entropy and their gradients within the budget of plain PyTorch in the same
    dtype against float64."""
    n, v, d = 1024, 32003, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    h64 = torch.randn(n, d, generator=g, device="cuda", dtype=torch.float64)
    w64 = torch.randn(v, d, generator=g, device="cuda", dtype=torch.float64) * (8 / d**0.5)
    lab = torch.randint(0, v, (n,), generator=g, device="cuda")
    kw = dict(temperature=0.9, logit_scale=0.5, softcap=30.0)
    up = torch.randn(n, generator=g, device="cuda", dtype=torch.float64)

    def grads(fn, h, w):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        lp, en = fn(h, w)
        ((lp.double() * up).sum() + en.double().sum()).backward()
        return [lp.detach(), en.detach(), h.grad, w.grad]

    got = grads(lambda h, w: mk.linear_logprobs(h, w, lab, return_entropy=True,
                                                backend="triton", **kw), h64.to(dtype),
                w64.to(dtype))  # fmt: skip
    ref = lambda h, w: R.linear_logprobs_ref(h, w, lab, return_entropy=True, **kw)  # noqa: E731
    want = grads(ref, h64, w64)
    same = grads(ref, h64.to(dtype), w64.to(dtype))
    for name, o, wt, sm in zip(("logp", "entropy", "dh", "dw"), got, want, same, strict=True):
        err = (o.double() - wt).abs().max().item()
        budget = 2 * (sm.double() - wt).abs().max().item() + 1e-4 * max(1.0, wt.abs().max().item())
        assert err <= budget, f"{name}: {err:.3e} > {budget:.3e}"


def test_mutated_op_arguments_have_no_default():
    """A mutated custom-op argument with a default broke every traced backward under torch
    2.11 (test_gpu_torch_compile_fullgraph on the H200, IndexError): before 2.12 the
    dispatcher drops a trailing argument equal to its default, and the ADInplaceOrView
    kernel then indexes the mutated arguments by position. The schemas show the cause on
    any torch, this CPU one included."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mrtpo::"))
    mutated = []
    for name in names:
        schema = getattr(torch.ops.mrtpo, name.split("::")[1].split(".")[0]).default._schema
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutated.append(name)
                assert not arg.has_default_value(), f"{name}: {arg.name} has a default"
    assert mutated == ["mrtpo::linear_logprobs_bwd", "mrtpo::logprobs_from_logits_bwd"]


@gpu_test
def test_gpu_no_int32_overflow():
    """N x V > 2^31 for both the logits path (5 GB of bf16 logits) and the LM-head path."""
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
    h, w, lab = _gpu_inputs(n, 64, torch.bfloat16, seed=7)
    lp = mk.linear_logprobs(h, w, lab, backend="triton")
    rl = linear_logprobs_ref(h[tail].double(), w.double(), lab[tail])
    assert _err(lp[tail], rl) < 1e-3
