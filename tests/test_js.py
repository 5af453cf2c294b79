"""js_distance and linear_js_distance: every check of the two ops in one place.

- CPU backends (the ``backend`` fixture: cpu, torch) against the float64 reference and scipy
  (extreme and non-finite inputs shared with the log-prob ops: tests/test_numerics_extreme.py).
- Fuzz (hypothesis; shared machinery in tests/fuzzing.py): ``test_fuzz``, and the
  ``slow``-marked ``test_fuzz_long``.
- Triton under the interpreter (marker ``triton``; ``make test-triton``): TRITON_INTERPRET=1
  must be on before triton is imported, so the ``group_*`` functions below run in
  subprocesses started by tests/triton_cases/_harness.py, one per group (the chunk driver
  with the stacked row kernel, triton_kernels/rows.py): odd shapes N = 1, 7, 129,
  V = 1, 1000, 5003, d = 3, 64, K = 1, 3, 5, temperature, bias, extreme and -inf logits,
  identical -> 0, disjoint -> 1, several token chunks, bf16/fp16; torch.library.opcheck;
  torch.compile(fullgraph=True) with aot_eager. Error rule (README.md, "Numerics"): our
  error against float64 is at most 2x that of the "torch" backend in the same dtype, plus a
  small atol (_harness.close). The kernels' sm_90 build without a GPU: test_triton_rows.py.
- GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): V = 151936, d = 896 and 4096, N up
  to 16384, bf16 and fp32, K = 4, against float64 references computed in row chunks; offsets
  beyond 2^31 elements; torch.compile(fullgraph=True) of a caller.
The advantage kernel is in tests/test_advantages.py.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
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
    _fmax,
    _gemm_tol,
    _inject,
    _linear_case,
    _low,
    _scale,
    _tensor,
    fuzz_tests,
)
from hypothesis import strategies as st
from scipy.spatial.distance import jensenshannon
from triton_cases import _harness
from triton_cases._harness import (
    close,
    compile_check,
    expect,
    interpreted,
    needs_triton,
    opcheck,
    run_groups,
)

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R
from mrtpo_kernels.reference import (
    js_distance_ref,
    linear_js_distance_ref,
)


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


# --------------------------------------------------------------------------- fuzz


@st.composite
def _js_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    backend = draw(st.sampled_from(_backends("js_distance", dtype)))
    n = draw(st.integers(1, 7))
    v = draw(st.integers(1, 11))
    k = draw(st.sampled_from([None, 1, 2, 3]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = _scale(draw, dtype)
    zp = _tensor((n, v), dtype, scale=scale, layout=draw(LAYOUTS), gen=gen)
    qshape = (n, v) if k is None else (k, n, v)
    zq = _tensor(qshape, dtype, scale=scale, layout=draw(LAYOUTS), gen=gen)
    if draw(st.booleans()):  # close distributions: the hard case for JS
        zq = zp.double() + 1e-3 * scale * torch.randn(qshape, generator=gen, dtype=torch.float64)
        zq = zq.clamp(-_fmax(dtype), _fmax(dtype)).to(dtype)
    zp = _inject(zp, draw(INJECT), gen)
    zq = _inject(zq, draw(INJECT), gen)
    return backend, zp, zq, draw(st.sampled_from(TEMPS))


def _check_js(case):
    backend, zp, zq, temp = case
    d = mk.js_distance(zp, zq, temperature=temp, backend=backend)
    rd = R.js_distance_ref(zp.double(), zq.double(), temperature=temp)
    pd = R.js_distance_ref(_low(zp), _low(zq), temperature=temp)
    # compare JSD ~ d^2 (d = sqrt(JSD) amplifies any error near 0)
    what = f"js_distance[{backend}, {zp.dtype}, T={temp}]"
    _assert_matches(d.double() ** 2, rd**2, pd.double() ** 2, what, atol=4e-6, rtol=2e-5)
    assert bool((d[~d.isnan()] >= 0).all() and (d[~d.isnan()] <= 1).all()), what


@_body(st.data())
def _linear_js_body(data):
    backend, hp, w, bias, temp, gen, draw = data.draw(_linear_case("linear_js_distance"))
    k = draw(st.sampled_from([None, 1, 2]))
    qshape = hp.shape if k is None else (k, *hp.shape)
    hq = (hp.double() + 0.1 * torch.randn(qshape, generator=gen, dtype=torch.float64)).to(hp.dtype)
    hq = _inject(hq, draw(INJECT), gen)
    d = mk.linear_js_distance(hp, hq, w, bias=bias, temperature=temp, backend=backend)
    br = None if bias is None else bias.double()
    rd = R.linear_js_distance_ref(hp.double(), hq.double(), w.double(), bias=br, temperature=temp)
    bl = None if bias is None else _low(bias)
    pd = R.linear_js_distance_ref(_low(hp), _low(hq), _low(w), bias=bl, temperature=temp)
    what = f"linear_js_distance[{backend}, {hp.dtype}, T={temp}]"
    tol = 4e-6 + 4 * _gemm_tol(hq, w, temp, _acc(hp))
    _assert_matches(d.double() ** 2, rd**2, pd.double() ** 2, what, atol=tol, rtol=2e-5)


@_body(_js_case())
def _js_body(case):
    _check_js(case)


FUZZ = {"js_distance": _js_body, "linear_js_distance": _linear_js_body}

test_fuzz, test_fuzz_long = fuzz_tests(FUZZ)


# ----------------------------------------------------------- Triton (interpreter, sm_90 build)


ROWS_GROUPS = [  # one subprocess each
    "linear_shapes",
    "linear_chunks_dtypes",
    "linear_special",
    "logits",
    "opcheck",
    "compile",
]


@interpreted
@pytest.mark.parametrize("group", ROWS_GROUPS)
def test_triton_js_under_interpreter(group):
    run_groups(__file__, group)


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_js_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.backends import triton_backend as tb

    with pytest.raises(ValueError, match="hidden_p"):
        tb.linear_js_distance(torch.randn(3, 4), torch.randn(1, 3, 4), torch.randn(5, 4), None, 1.0)
    with pytest.raises(ValueError, match="logits_p"):
        tb.js_distance(torch.randn(3, 5), torch.randn(1, 3, 5), 1.0)


# --------------------------------------------------------------------------- Hopper build
# (the JS row kernels' sm_90 build: test_triton_rows.py; these helpers serve other files)


def _compile_for_hopper(fn, signature, constexprs, div16=(), **options):
    """Compile a kernel for sm_90 without a GPU (as a launch would: pointers and the named
    integers marked divisible by 16); return the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name].startswith("*") or name in div16
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _nvidia_backend_present() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "nvidia" in backends


def in_unit_interval(name, d):
    expect(name, bool(((d >= 0) & (d <= 1)).all()), f"values outside [0, 1]: {d.min()}, {d.max()}")


# --------------------------------------------------------------------------- JS, linear


def _triton_linear_case(n, v, d, k, *, dtype=torch.float32, bias=True, temp=0.7, noise=0.5, seed=0,
                 squeeze=False, scale=3.0, tag=""):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(n, d, generator=g)
    hq = hp + noise * torch.randn(k, n, d, generator=g)
    w = torch.randn(v, d, generator=g) * (scale / d**0.5)
    b = torch.randn(v, generator=g) if bias else None
    if squeeze:
        hq = hq[0]
    hp, hq, w = hp.to(dtype), hq.to(dtype), w.to(dtype)
    b = None if b is None else b.to(dtype)
    kw = dict(bias=b, temperature=temp)
    name = f"linear_js_distance n={n} v={v} d={d} k={k} {dtype} bias={bias} t={temp}{tag}"
    ours = mk.linear_js_distance(hp, hq, w, backend="triton", **kw)
    plain = mk.linear_js_distance(hp, hq, w, backend="torch", **kw)
    b64 = None if b is None else b.double()
    ref = linear_js_distance_ref(hp.double(), hq.double(), w.double(), bias=b64, temperature=temp)
    expect(name + " dtype", ours.dtype == torch.float32, str(ours.dtype))
    close(name, ours, ref, plain, atol=2e-6, rtol=0)
    in_unit_interval(name, ours)


def group_linear_shapes():
    _triton_linear_case(1, 1, 3, 1)  # one token, one-word vocabulary: P = Q, d = 0
    _triton_linear_case(1, 5003, 64, 3, temp=1.3)
    _triton_linear_case(7, 1000, 3, 3, bias=False)
    _triton_linear_case(7, 5003, 3, 1, temp=0.5, squeeze=True, tag=" hidden_q (N, d)")
    _triton_linear_case(7, 1, 64, 3)
    _triton_linear_case(129, 1000, 64, 3, temp=1.7)
    _triton_linear_case(129, 5003, 3, 1, bias=False)


def group_linear_chunks_dtypes():
    # A small scratch budget: several token chunks, the last one shorter.
    with _harness.env(MRTPO_JS_SCRATCH_BYTES=4 * 4 * 1000 * 40):  # C = 40 tokens at K = 3
        _triton_linear_case(129, 1000, 64, 3, seed=1, tag=" chunks of 40")
        _triton_linear_case(129, 1000, 3, 1, seed=2, bias=False, tag=" chunks")
    _triton_linear_case(7, 1000, 64, 3, dtype=torch.bfloat16, seed=3)
    _triton_linear_case(7, 1000, 64, 1, dtype=torch.float16, seed=4, temp=1.2)
    # padded (B, T, d) layout
    g = torch.Generator().manual_seed(5)
    hp = torch.randn(2, 5, 16, generator=g)
    hq = hp + torch.randn(3, 2, 5, 16, generator=g)
    w = torch.randn(300, 16, generator=g)
    ours = mk.linear_js_distance(hp, hq, w, temperature=0.9, backend="triton")
    ref = linear_js_distance_ref(
        hp.reshape(10, 16).double(), hq.reshape(3, 10, 16).double(), w.double(), temperature=0.9
    ).reshape(3, 2, 5)
    plain = mk.linear_js_distance(hp, hq, w, temperature=0.9, backend="torch")
    close("linear_js_distance padded (K, B, T)", ours, ref, plain, atol=2e-6, rtol=0)


def group_linear_special():
    # Extreme logits (|z| ~ 1e4): near one-hot distributions.
    _triton_linear_case(37, 1000, 64, 3, scale=1e4, noise=1e-3, seed=6, tag=" extreme")
    # Close distributions: d ~ 1e-3 (the small-|delta| series branch).
    _triton_linear_case(37, 1000, 64, 3, noise=1e-3, seed=7, tag=" close")
    # Identical streams: exactly 0.
    g = torch.Generator().manual_seed(8)
    hp = torch.randn(9, 64, generator=g)
    w = torch.randn(1000, 64, generator=g)
    b = torch.randn(1000, generator=g)
    out = mk.linear_js_distance(hp, hp.expand(3, 9, 64), w, bias=b, backend="triton")
    expect("linear_js_distance identical -> 0", bool((out == 0).all()), f"max {out.abs().max()}")
    # Disjoint supports: P puts all mass on token 0, Q on token 1 -> exactly 1.
    w = torch.zeros(5, 3)
    w[0, 0] = w[1, 1] = w[2, 2] = 1.0
    b = torch.tensor([0.0, 0.0, 0.0, -1e4, -1e4])
    hp = torch.tensor([[0.0, -1e4, -1e4]])
    hq = torch.tensor([[[-1e4, 0.0, -1e4]], [[0.0, -1e4, -1e4]]])
    out = mk.linear_js_distance(hp, hq, w, bias=b, temperature=0.8, backend="triton")
    expect("linear_js_distance disjoint -> 1", out[0, 0].item() == 1.0, f"{out[0, 0].item()}")
    expect("linear_js_distance same one-hot -> 0", out[1, 0].item() == 0.0, f"{out[1, 0].item()}")
    # float64 inputs go to the torch backend and stay float64.
    hp = torch.randn(5, 8, dtype=torch.float64, generator=g)
    hq = torch.randn(2, 5, 8, dtype=torch.float64, generator=g)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g)
    out = mk.linear_js_distance(hp, hq, w, temperature=1.1, backend="triton")
    ref = linear_js_distance_ref(hp, hq, w, temperature=1.1)
    expect("linear_js_distance float64 dtype", out.dtype == torch.float64, str(out.dtype))
    err = (out - ref).abs().max().item()
    expect("linear_js_distance float64", err <= 1e-10, f"max error {err:.3e}")


# --------------------------------------------------------------------------- JS, logits


def _triton_logits_case(n, v, k, *, dtype=torch.float32, temp=1.3, scale=3.0, noise=1.0, seed=0,
                 tag=""):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    zp = torch.randn(n, v, generator=g) * scale
    zq = zp + noise * torch.randn(k, n, v, generator=g)
    zp, zq = zp.to(dtype), zq.to(dtype)
    name = f"js_distance n={n} v={v} k={k} {dtype} t={temp}{tag}"
    ours = mk.js_distance(zp, zq, temperature=temp, backend="triton")
    plain = mk.js_distance(zp, zq, temperature=temp, backend="torch")
    ref = js_distance_ref(zp.double(), zq.double(), temperature=temp)
    close(name, ours, ref, plain, atol=1e-6, rtol=0)
    in_unit_interval(name, ours)


def group_logits():
    for i, (n, v) in enumerate([(n, v) for n in (1, 7, 129) for v in (1, 1000, 5003)]):
        _triton_logits_case(n, v, 1 if i % 2 else 3, seed=i)
    _triton_logits_case(7, 5003, 3, dtype=torch.bfloat16, seed=20)
    _triton_logits_case(7, 1000, 5, scale=1e4, noise=1.0, seed=21, tag=" extreme")
    _triton_logits_case(7, 1000, 3, noise=1e-3, seed=22, tag=" close")
    _triton_logits_case(7, 1000, 3, noise=0.25, seed=23, tag=" |delta| near 1/2")
    g = torch.Generator().manual_seed(24)
    # (V,) logits, one token
    zp, zq = torch.randn(300, generator=g), torch.randn(2, 300, generator=g)
    ours = mk.js_distance(zp, zq, backend="triton")
    ref = js_distance_ref(zp[None].double(), zq[:, None].double())[:, 0]
    close("js_distance (V,) input", ours, ref, mk.js_distance(zp, zq), atol=1e-6, rtol=0)
    # -inf logits (a vocabulary mask), in one stream, in both, and in a whole block
    zp = torch.randn(5, 3000, generator=g)
    zq = torch.randn(2, 5, 3000, generator=g)
    zp[:, ::3] = float("-inf")
    zq[0, :, ::2] = float("-inf")
    zq[1, :, 1000:2500] = float("-inf")
    ours = mk.js_distance(zp, zq, backend="triton")
    ref = js_distance_ref(zp.double(), zq.double())
    close("js_distance with -inf logits", ours, ref, None, atol=2e-6, rtol=0)
    # identical -> 0, disjoint -> 1
    zp = torch.randn(6, 777, generator=g) * 5
    out = mk.js_distance(zp, zp.expand(3, 6, 777), temperature=0.6, backend="triton")
    expect("js_distance identical -> 0", bool((out == 0).all()), f"max {out.abs().max()}")
    zp = torch.full((2, 40), -1e4)
    zq = torch.full((2, 40), -1e4)
    zp[:, :20] = 0.0
    zq[:, 20:] = 0.0
    out = mk.js_distance(zp, zq, backend="triton")  # 1 up to the fp32 rounding of the sums
    expect("js_distance disjoint -> 1", bool(((out - 1).abs() <= 1e-6).all()), f"{out.tolist()}")


# --------------------------------------------------------------------------- opcheck


def group_opcheck():
    g = torch.Generator().manual_seed(9)
    hp = torch.randn(5, 16, generator=g)
    hq = torch.randn(2, 5, 16, generator=g)
    w = torch.randn(300, 16, generator=g)
    b = torch.randn(300, generator=g)
    zp = torch.randn(5, 300, generator=g)
    zq = torch.randn(2, 5, 300, generator=g)
    cases = [
        ("linear_js_distance", (hp, hq, w, b, 0.8, "triton")),
        ("linear_js_distance", (hp, hq, w, None, 1.0, "triton")),
        ("js_distance", (zp, zq, 1.2, "triton")),
    ]
    for name, args in cases:
        opcheck(name, getattr(torch.ops.mrtpo, name).default, args)


def group_compile():
    """torch.compile(fullgraph=True) of a caller traces the ops without a graph break
    (aot_eager: no C++ code generation needed on this machine)."""
    g = torch.Generator().manual_seed(11)
    hp = torch.randn(6, 16, generator=g)
    hq = torch.randn(2, 6, 16, generator=g)
    w = torch.randn(200, 16, generator=g)
    zp, zq = hp @ w.t(), hq @ w.t()

    def caller(hp, hq, w, zp, zq):
        d_lin = mk.linear_js_distance(hp, hq, w, temperature=0.8, backend="triton")
        d_log = mk.js_distance(zp, zq, temperature=0.8, backend="triton")
        return d_lin.sum() + d_log.sum()

    compile_check("js", caller, (hp, hq, w, zp, zq))


GROUPS = {k[len("group_") :]: f for k, f in sorted(globals().items()) if k.startswith("group_")}


# --------------------------------------------------------------------------- GPU


def gpu_test(fn):
    """Marked ``gpu`` (deselected by default) and skipped where CUDA is absent."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


V_REAL = 151936


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _within_budget(ours, ref64, same, atol):
    e, base = _err(ours, ref64), _err(same, ref64)
    assert e <= 2 * base + atol, f"error {e:.3e} > 2 x {base:.3e} + {atol:g}"


def _linear_ref_rows(hp, hq, w, dtype, rows=256, **kw):
    """linear_js_distance_ref in ``dtype``, row chunk by row chunk (rows are independent)."""
    wd = w.to(dtype)
    outs = [
        linear_js_distance_ref(hp[s : s + rows].to(dtype), hq[:, s : s + rows].to(dtype), wd, **kw)
        for s in range(0, hp.shape[0], rows)
    ]
    return torch.cat(outs, dim=-1)


def _streams(n, d, k, dtype, v=V_REAL, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hp = torch.randn(n, d, device="cuda", generator=g)
    hq = hp + 0.3 * torch.randn(k, n, d, device="cuda", generator=g)
    w = torch.randn(v, d, device="cuda", generator=g) * (2.0 / d**0.5)
    return hp.to(dtype), hq.to(dtype), w.to(dtype)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,d", [(16384, 896), (2048, 4096)])
def test_gpu_linear_js_real_shapes(n, d, dtype):
    hp, hq, w = _streams(n, d, 4, dtype)
    out = mk.linear_js_distance(hp, hq, w, temperature=0.9, backend="triton")
    assert out.shape == (4, n) and out.dtype == torch.float32
    # float64 reference on a strided subset of rows (all rows would take minutes)
    idx = torch.arange(0, n, max(1, n // 512), device="cuda")
    with torch.no_grad():
        ref = _linear_ref_rows(hp[idx], hq[:, idx], w, torch.float64, temperature=0.9)
        same = mk.linear_js_distance(hp[idx], hq[:, idx], w, temperature=0.9, backend="torch")
    _within_budget(out[:, idx], ref, same, atol=1e-4)
    assert _err(out[:, idx], ref) <= 1e-3


@gpu_test
def test_gpu_linear_js_bias_identical_and_chunks(monkeypatch):
    hp, hq, w = _streams(1000, 896, 4, torch.bfloat16, seed=1)
    b = torch.randn(V_REAL, device="cuda").to(torch.bfloat16)
    hq[2] = hp  # one stream identical to P: exactly 0
    monkeypatch.setenv("MRTPO_JS_SCRATCH_BYTES", str(64 << 20))  # several chunks
    out = mk.linear_js_distance(hp, hq, w, bias=b, temperature=0.7, backend="triton")
    assert bool((out[2] == 0).all())
    with torch.no_grad():
        ref = _linear_ref_rows(hp, hq, w, torch.float64, bias=b.double(), temperature=0.7)
    assert _err(out, ref) <= 1e-3


@gpu_test
def test_gpu_logits_js_offsets_beyond_int32():
    # K x N x V = 4 x 16384 x 151936 ~ 1.0e10 elements: every int32 offset would wrap.
    n, k = 16384, 4
    g = torch.Generator(device="cuda").manual_seed(2)
    zp = (3 * torch.randn(n, V_REAL, device="cuda", generator=g)).to(torch.bfloat16)
    zq = torch.empty((k, n, V_REAL), device="cuda", dtype=torch.bfloat16)
    for j in range(k):
        zq[j] = zp + torch.randn(n, V_REAL, device="cuda", generator=g).to(torch.bfloat16)
    out = mk.js_distance(zp, zq, temperature=1.1, backend="triton")
    rows = torch.cat([torch.arange(0, 64), torch.arange(n - 64, n)]).cuda()
    with torch.no_grad():
        ref = js_distance_ref(zp[rows].double(), zq[:, rows].double(), temperature=1.1)
    assert _err(out[:, rows], ref) <= 1e-4


@gpu_test
def test_gpu_compile_fullgraph_caller():
    hp, hq, w = _streams(300, 896, 2, torch.bfloat16, v=32000, seed=4)
    zp, zq = (hp.float() @ w.float().t()), (hq.float() @ w.float().t())

    def caller(hp, hq, w, zp, zq):
        d_lin = mk.linear_js_distance(hp, hq, w, temperature=0.8, backend="triton")
        d_log = mk.js_distance(zp, zq, temperature=0.8, backend="triton")
        return d_lin.mean(0) + d_log.mean(0)

    compiled = torch.compile(caller, fullgraph=True)
    torch.testing.assert_close(compiled(hp, hq, w, zp, zq), caller(hp, hq, w, zp, zq))
