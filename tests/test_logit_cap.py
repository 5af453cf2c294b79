"""Logit scaling and final-logit softcapping (``logit_scale``, ``softcap``) of the fused ops
that stream over the vocabulary: linear_logprobs (with entropy), linear_js_distance and
linear_policy_loss, against the float64 references (values and gradients).

    r = h W^T + b,  z = softcap tanh(scale r / softcap)  (z = scale r without a cap),
    then softmax(z / temperature);  dz/dr = scale (1 - (z / softcap)^2)

- CPU backends (the ``backend`` fixture: cpu, torch): odd shapes, saturated caps, a
  negative scale, the chunked driver, kept and recomputed logits, float64 gradcheck.
- The identity (scale 1, no cap) is the plain call, bit for bit.
- Argument validation.
- Triton under the interpreter (marker ``triton``): the ``group_*`` functions below, in a
  subprocess (tests/triton_cases/_harness.py), including the low-memory column kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_cases import _harness
from triton_cases._harness import close, expect, interpreted, run_groups

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R

# (logit_scale, softcap): Gemma 2's cap, Cohere's scale, Granite's 1 / logits_scaling with
# a cap, a cap that saturates most logits, and a negative scale (the logits flipped)
CAPS = [(1.0, 30.0), (0.0625, None), (0.125, 3.0), (2.0, 1.5), (-0.5, None)]
CAP_IDS = ["gemma2", "cohere", "granite-capped", "saturated", "negative"]


def _check(comparisons):
    """Apply the interpreter checks' error rule (``close``) in pytest: raise on a failure."""
    before = len(_harness.FAILURES)
    for name, ours, want, same, atol in comparisons:
        close(name, ours, want, same, atol=atol, rtol=1e-5)
    failed = _harness.FAILURES[before:]
    del _harness.FAILURES[before:]
    assert not failed, "\n".join(failed)


def _case(n, v, d, *, seed=0, bias=True, k=0):
    """float64 hidden states (and K Q streams), a head whose logits spread ~ N(0, 9) so that
    caps of a few units saturate, labels with an ignored token."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * (3.0 / math.sqrt(d))
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    lab = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        lab[1] = -100
    hq = torch.randn(k, n, d, generator=g, dtype=torch.float64) if k else None
    return h, w, b, lab, hq


def _grads(fn, *tensors):
    """fn(*leaves) -> (outputs..., scalar); returns the outputs and the leaves' gradients."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    *outs, scalar = fn(*leaves)
    scalar.backward()
    return [o.detach() for o in outs] + [None if t is None else t.grad for t in leaves]


def logprobs_comparisons(backend, n, v, d, scale, cap, *, temp=0.8, dtype=torch.float32,
                         bias=True, entropy=True, seed=0, tag=""):  # fmt: skip
    h, w, b, lab, _ = _case(n, v, d, seed=seed, bias=bias)
    g = torch.Generator().manual_seed(seed + 1)
    g_lp, g_en = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def loss(lp, en):
        return (lp.double() * g_lp.double()).sum() + (
            (en.double() * g_en.double()).sum() if entropy else 0.0
        )

    def ours(h, w, b):
        out = mk.linear_logprobs(
            h, w, lab, bias=b, temperature=temp, return_entropy=entropy, logit_scale=scale,
            softcap=cap, backend=backend,
        )  # fmt: skip
        lp, en = out if entropy else (out, torch.zeros_like(out))
        return lp, en, loss(lp, en)

    def ref(h, w, b):
        out = R.linear_logprobs_ref(
            h, w, lab, bias=b, temperature=temp, return_entropy=entropy, logit_scale=scale,
            softcap=cap,
        )  # fmt: skip
        lp, en = out if entropy else (out, torch.zeros_like(out))
        return lp, en, loss(lp, en)

    low = [None if t is None else t.to(dtype) for t in (h, w, b)]
    got = _grads(ours, *low)
    want = _grads(ref, h, w, b)
    same = _grads(ref, *low)
    names = ("logp", "entropy", "dh", "dw", "db")
    atol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    return [
        (f"{backend} logprobs{tag} n={n} v={v} d={d} cap={scale},{cap} {nm}", o, wnt, s, atol)
        for nm, o, wnt, s in zip(names, got, want, same, strict=True)
        if wnt is not None
    ]


def js_comparisons(backend, n, v, d, k, scale, cap, *, temp=0.7, dtype=torch.float32, tag=""):
    h, w, b, _, hq = _case(n, v, d, k=k)
    low = [t.to(dtype) for t in (h, hq, w, b)]
    got = mk.linear_js_distance(
        low[0], low[1], low[2], bias=low[3], temperature=temp, logit_scale=scale, softcap=cap,
        backend=backend,
    )  # fmt: skip
    want = R.linear_js_distance_ref(h, hq, w, bias=b, temperature=temp, logit_scale=scale,
                                    softcap=cap)  # fmt: skip
    same = R.linear_js_distance_ref(low[0], low[1], low[2], bias=low[3], temperature=temp,
                                    logit_scale=scale, softcap=cap)  # fmt: skip
    # the distance is a square root: near 0 its error is sqrt of the divergence's
    atol = 2e-3 if dtype in (torch.float32, torch.float64) else 3e-2
    return [(f"{backend} js{tag} n={n} v={v} k={k} cap={scale},{cap}", got, want, same, atol)]


def policy_comparisons(backend, n, v, d, scale, cap, *, temp=0.9, dtype=torch.float32,
                       beta=0.0, tag=""):  # fmt: skip
    h, w, b, lab, _ = _case(n, v, d, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lp = R.linear_logprobs_ref(h, w, lab, bias=b, temperature=temp, logit_scale=scale,
                                   softcap=cap)  # fmt: skip
    old = (lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(n, generator=g)
    ref_lp = (lp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    kw = dict(temperature=temp, ref_logprobs=ref_lp if beta else None, beta=beta,
              logit_scale=scale, softcap=cap)  # fmt: skip

    def ours(h, w, b):
        loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, bias=b, backend=backend, **kw)
        return loss, loss

    def ref(h, w, b):
        loss, _ = R.linear_policy_loss_ref(h, w, lab, old, adv, bias=b, **kw)
        return loss, loss

    low = [t.to(dtype) for t in (h, w, b)]
    got = _grads(ours, *low)
    want = _grads(ref, h, w, b)
    same = _grads(ref, *low)
    atol = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2
    return [
        (f"{backend} policy{tag} n={n} v={v} cap={scale},{cap} {nm}", o, wnt, s, atol)
        for nm, o, wnt, s in zip(("loss", "dh", "dw", "db"), got, want, same, strict=True)
    ]


# --------------------------------------------------------------------------- CPU backends


@pytest.mark.parametrize("scale,cap", CAPS, ids=CAP_IDS)
@pytest.mark.parametrize("n,v,d", [(1, 1, 3), (7, 1000, 64), (129, 5003, 3), (33, 2, 17)])
def test_linear_logprobs_matches_reference(backend, n, v, d, scale, cap):
    _check(logprobs_comparisons(backend, n, v, d, scale, cap))


@pytest.mark.parametrize("scale,cap", [(1.0, 30.0), (0.125, 3.0)], ids=["gemma2", "granite"])
def test_linear_logprobs_bf16_within_budget(backend, scale, cap):
    _check(logprobs_comparisons(backend, 33, 1000, 64, scale, cap, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "env",
    [
        {"MRTPO_CHUNK_BYTES": str(5 * 4 * 1000)},  # 5 rows per chunk
        {"MRTPO_KEEP_LOGITS_BYTES": "0"},  # the backward recomputes every row's logits
        {"MRTPO_KEEP_LOGITS_BYTES": str(4 * 4 * 1000)},  # 4 rows kept, the rest recomputed
    ],
    ids=["chunked", "recomputed", "partly-kept"],
)
def test_linear_logprobs_driver_paths(backend, env, monkeypatch):
    """The transform on every chunk, on the logits the forward keeps (stored transformed,
    read as such) and on the backward's recomputed logits."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _check(logprobs_comparisons(backend, 29, 1000, 16, 1.0, 2.0, entropy=True))
    _check(logprobs_comparisons(backend, 29, 1000, 16, 0.5, None, entropy=False, tag=" lp"))


@pytest.mark.parametrize("scale,cap", CAPS, ids=CAP_IDS)
def test_linear_js_distance_matches_reference(backend, scale, cap):
    _check(js_comparisons(backend, 9, 1000, 16, 3, scale, cap))
    _check(js_comparisons(backend, 1, 5003, 3, 1, scale, cap, tag=" one"))


@pytest.mark.parametrize("scale,cap", CAPS, ids=CAP_IDS)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_linear_policy_loss_matches_reference(backend, scale, cap, beta):
    _check(policy_comparisons(backend, 31, 1000, 16, scale, cap, beta=beta))


def test_linear_policy_loss_chunked(backend, monkeypatch):
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * 4 * 1000))
    _check(policy_comparisons(backend, 31, 1000, 16, 1.0, 2.0, tag=" chunked"))


@pytest.mark.parametrize("scale,cap", [(1.0, 2.0), (-0.7, None), (0.5, 4.0)])
def test_gradcheck_float64(backend, scale, cap):
    h, w, b, lab, _ = _case(5, 11, 3, seed=7)
    h, w, b = (t.clone().requires_grad_() for t in (h, w, b))

    def f(h, w, b):
        lp, en = mk.linear_logprobs(h, w, lab, bias=b, temperature=0.7, return_entropy=True,
                                    logit_scale=scale, softcap=cap, backend=backend)  # fmt: skip
        return lp, en

    assert torch.autograd.gradcheck(f, (h, w, b))
    old, adv = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)

    def g(h, w, b):
        kw = dict(temperature=0.7, logit_scale=scale, softcap=cap, backend=backend)
        return mk.linear_policy_loss(h, w, lab, old, adv, bias=b, **kw)[0]

    assert torch.autograd.gradcheck(g, (h, w, b))


def test_identity_is_the_plain_call_bit_for_bit(backend):
    """logit_scale=1.0 and softcap=None (the defaults) take the plain path: the results are
    those of a call that does not name them, bit for bit, and no transform runs."""
    h, w, b, lab, hq = _case(17, 1000, 16, k=2)
    h, w, b, hq = (t.float() for t in (h, w, b, hq))
    out = []
    for kw in ({}, {"logit_scale": 1.0, "softcap": None}, {"logit_scale": 1}):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, en = mk.linear_logprobs(hh, ww, lab, bias=b, return_entropy=True, backend=backend,
                                    **kw)  # fmt: skip
        (lp.sum() + en.sum()).backward()
        js = mk.linear_js_distance(h, hq, w, bias=b, backend=backend, **kw)
        loss, _ = mk.linear_policy_loss(
            h.clone().requires_grad_(), w, lab, lp.detach(), torch.ones(17), backend=backend, **kw
        )
        out.append((lp, en, hh.grad, ww.grad, js, loss))
    for other in out[1:]:
        for a, c in zip(out[0], other, strict=True):
            assert torch.equal(a, c)


def test_identity_never_transforms(backend, monkeypatch):
    from mrtpo_kernels.backends import _lm_head

    calls = []
    real = _lm_head.apply_logit_cap_

    def spy(z, cap):
        calls.append(cap.active)
        return real(z, cap)

    monkeypatch.setattr(_lm_head, "apply_logit_cap_", spy)
    h, w, b, lab, _ = _case(5, 100, 8)
    h, w = h.float().requires_grad_(), w.float()
    mk.linear_logprobs(h, w, lab, backend=backend).sum().backward()
    assert calls and not any(calls)
    calls.clear()
    mk.linear_logprobs(h, w, lab, softcap=5.0, backend=backend).sum().backward()
    assert calls and all(calls)


def test_padded_layout(backend):
    h, w, b, lab, _ = _case(12, 300, 8)
    got = mk.linear_logprobs(h.float().view(3, 4, 8), w.float(), lab.view(3, 4), bias=b.float(),
                             softcap=2.0, logit_scale=0.5, backend=backend)  # fmt: skip
    want = R.linear_logprobs_ref(h, w, lab, bias=b, softcap=2.0, logit_scale=0.5)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got.view(-1).double(), want, atol=1e-5, rtol=1e-5)


def test_op_table_names_the_ops_that_take_the_transform():
    """The op table's ``logit_cap`` is exactly the ops whose public function (and float64
    reference) take logit_scale and softcap."""
    import inspect

    for op in mk.OPS.values():
        params = inspect.signature(getattr(mk, op.name)).parameters
        ref = inspect.signature(getattr(R, op.reference)).parameters
        takes = "softcap" in params and "logit_scale" in params
        assert takes == op.logit_cap, op.name
        assert takes == ("softcap" in ref and "logit_scale" in ref), op.reference


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": -30.0}, "softcap"),
        ({"softcap": math.inf}, "softcap"),
        ({"softcap": math.nan}, "softcap"),
        ({"softcap": "30"}, "softcap"),
        ({"softcap": 1e-300}, "softcap"),
        ({"logit_scale": 0.0}, "logit_scale"),
        ({"logit_scale": math.inf}, "logit_scale"),
        ({"logit_scale": -math.inf}, "logit_scale"),
        ({"logit_scale": math.nan}, "logit_scale"),
        ({"logit_scale": None}, "logit_scale"),
        ({"logit_scale": True}, "logit_scale"),
        ({"logit_scale": 1e300}, "logit_scale"),
    ],
)
def test_invalid_arguments_name_themselves(kw, match):
    h, w, b, lab, hq = _case(3, 10, 4, k=1)
    h, w, hq = h.float(), w.float(), hq.float()
    with pytest.raises(ValueError, match=match):
        mk.linear_logprobs(h, w, lab, **kw)
    with pytest.raises(ValueError, match=match):
        mk.linear_js_distance(h, hq, w, **kw)
    with pytest.raises(ValueError, match=match):
        mk.linear_policy_loss(h, w, lab, torch.zeros(3), torch.ones(3), **kw)


def test_process_group_with_a_transform_checks_the_group():
    """A transform reaches the vocabulary-parallel path (tests/test_process_group.py checks
    its results): a group that cannot be one is refused there, naming process_group."""
    h, w, _, lab, _ = _case(3, 10, 4)
    with pytest.raises(ValueError, match="process_group"):
        mk.linear_logprobs(h.float(), w.float(), lab, softcap=30.0, process_group=object())


# --------------------------------------------------------------------------- Triton (interpreter)


@interpreted
def test_triton_logit_cap_under_interpreter():
    """The groups below (group_*), in one subprocess."""
    run_groups(__file__)


def _run(comparisons):
    for name, ours, want, same, atol in comparisons:
        close(name, ours, want, same, atol=atol, rtol=1e-5)


def group_logprobs():
    for (n, v, d), (scale, cap) in zip(
        [(1, 1, 3), (7, 1000, 16), (33, 2, 17), (9, 5003, 3), (5, 700, 8)], CAPS, strict=True
    ):
        _run(logprobs_comparisons("triton", n, v, d, scale, cap))
    _run(logprobs_comparisons("triton", 9, 700, 16, 1.0, 30.0, dtype=torch.bfloat16, tag=" bf16"))
    _run(logprobs_comparisons("triton", 9, 700, 16, 0.5, 2.0, entropy=False, tag=" no-ent"))


def group_logprobs_driver_paths():
    with _harness.env(MRTPO_CHUNK_BYTES=5 * 4 * 1000):
        _run(logprobs_comparisons("triton", 17, 1000, 16, 1.0, 2.0, tag=" chunked"))
    with _harness.env(MRTPO_KEEP_LOGITS_BYTES=0):
        _run(logprobs_comparisons("triton", 17, 1000, 16, 1.0, 2.0, tag=" recomputed"))


def group_low_memory():
    """The low-memory mode: the column kernel (grad_cols_) applies the slope, its logits
    transformed per vocabulary chunk; the (raw max, log s) norm is of the transformed row."""
    with _harness.env(MRTPO_LOW_MEMORY=1, MRTPO_CHUNK_BYTES=17 * 4 * 300):
        _run(logprobs_comparisons("triton", 17, 1000, 16, 1.0, 2.0, tag=" low-memory"))
        _run(logprobs_comparisons("triton", 17, 1000, 16, -0.5, None, tag=" low-memory"))
        _run(policy_comparisons("triton", 17, 1000, 16, 0.25, 3.0, tag=" low-memory"))


def group_js():
    _run(js_comparisons("triton", 9, 1000, 16, 3, 1.0, 30.0))
    _run(js_comparisons("triton", 5, 700, 8, 2, 2.0, 1.5))
    _run(js_comparisons("triton", 1, 5003, 3, 1, -0.5, None))


def group_policy():
    for scale, cap in CAPS:
        _run(policy_comparisons("triton", 13, 700, 16, scale, cap))
    _run(policy_comparisons("triton", 13, 700, 16, 1.0, 2.0, beta=0.1, tag=" kl"))


def group_identity():
    h, w, b, lab, _ = _case(9, 500, 8)
    h, w, b = h.float(), w.float(), b.float()
    a = mk.linear_logprobs(h, w, lab, bias=b, return_entropy=True, backend="triton")
    c = mk.linear_logprobs(h, w, lab, bias=b, return_entropy=True, logit_scale=1.0,
                           softcap=None, backend="triton")  # fmt: skip
    expect("identity bit for bit", all(torch.equal(x, y) for x, y in zip(a, c, strict=True)))


GROUPS = {
    name[len("group_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("group_")
}
