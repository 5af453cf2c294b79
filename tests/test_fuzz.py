"""Property-based fuzzing of every public op on every available CPU backend (hypothesis).

Each example draws shapes (1 and odd sizes included), a memory layout (contiguous, a
strided view, an expanded view), a dtype (float32, float64, bfloat16, float16), a scale up
to the dtype's float maximum, NaN / +-inf injection and out-of-range values. The op must
either return what the float64 reference (mrtpo_kernels/reference.py) gives on the same
values, within the project's error rule (README "Numerics": at most twice the error of the
reference run in the input's own dtype, plus a small tolerance), with NaN exactly where the
reference has NaN, or raise a ValueError that names one of the op's arguments.

Cases with the value checks off (MRTPO_SKIP_VALUE_CHECKS=1), where a kernel could read out
of bounds, run in a subprocess: a crash (a signal, a non-zero exit) fails the test.

Profiles: the default one (deterministic, ~1 min on 2 cores) and a ``slow``-marked long one
with many more examples per op (``pytest -m slow tests/test_fuzz.py``).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TEMPS = [0.3, 0.7, 1.0, 1.7]
FAST = dict(max_examples=60, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))  # fmt: skip
LONG = dict(FAST, max_examples=400)


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _names_an_argument(err: ValueError, fn) -> bool:
    """The message starts with an argument of fn (or a combination of them)."""
    head = str(err).split(":", 1)[0]
    return any(part in _params(fn) for part in head.split("/"))


def _body(strategy):
    """Marks a fuzz body: the tests wrap it in a fresh given() per profile (hypothesis
    refuses a second settings object on one decorated function)."""

    def mark(fn):
        fn.strategy = strategy
        return fn

    return mark


def _run(body, profile):
    settings(**profile)(given(body.strategy)(body))()


# --------------------------------------------------------------------------- drawing


def _fmax(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _tensor(shape, dtype, *, scale, layout, gen):
    """Values ~ scale * N(0, 1) (clamped into the dtype's range) in the given layout."""
    fmax = _fmax(dtype)
    if layout == "expanded" and len(shape) >= 1 and shape[0] > 1:
        base = torch.randn((1, *shape[1:]), generator=gen, dtype=torch.float64)
        t = (base * scale).clamp(-fmax, fmax).to(dtype).expand(*shape)
        return t
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    t = (base * scale).clamp(-fmax, fmax).to(dtype)
    if layout == "strided" and len(shape) >= 1:
        big = torch.zeros((shape[0] * 2, *shape[1:]), dtype=dtype)
        big[::2] = t
        return big[::2]
    if layout == "transposed" and len(shape) == 2:
        return t.t().contiguous().t()
    return t


def _inject(t: torch.Tensor, kind: str, gen) -> torch.Tensor:
    """A copy of t with one entry set to NaN, +inf or -inf (kind "none": t itself)."""
    if kind == "none" or t.numel() == 0:
        return t
    out = t.clone()
    i = int(torch.randint(0, out.numel(), (1,), generator=gen))
    out[torch.unravel_index(torch.tensor(i), out.shape)] = {
        "nan": math.nan,
        "+inf": math.inf,
        "-inf": -math.inf,
    }[kind]
    return out


LAYOUTS = st.sampled_from(["contiguous", "strided", "transposed", "expanded"])
INJECT = st.sampled_from(["none", "none", "nan", "+inf", "-inf"])


def _scale(draw, dtype, allow_max=True):
    choices = [1.0, 1e3, 1e7, 1e15, 1e30, "max"] if allow_max else [1.0, 10.0, 1e3]
    s = draw(st.sampled_from(choices))
    fmax = _fmax(dtype)
    return 0.25 * fmax if s == "max" else min(float(s), 0.25 * fmax)


# --------------------------------------------------------------------------- comparing


def _assert_matches(got, ref64, plain, what, *, atol, rtol=4e-6):
    """NaN exactly where ref64 is NaN; +-inf where ref64 is +-inf or beyond got's range;
    elsewhere |got - ref64| <= 2 max|plain - ref64| + atol + rtol |ref64| (plain: the
    reference in the input's dtype; its error counts only where it is finite)."""
    # beyond the range of got's own dtype (float32, float64, or a 16-bit gradient)
    out_max = torch.finfo(got.dtype if got.dtype.is_floating_point else torch.float64).max
    got = got.detach().double()
    ref64 = ref64.detach().double()
    assert got.shape == ref64.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    nan_ref = ref64.isnan()
    assert torch.equal(got.isnan(), nan_ref), (
        f"{what}: NaN pattern differs: got {got[got.isnan() != nan_ref]}, "
        f"reference {ref64[got.isnan() != nan_ref]}"
    )
    big = ~nan_ref & (ref64.abs() > out_max)
    assert torch.equal(got[big], ref64[big].sign() * math.inf), f"{what}: beyond the range"
    fin = ~nan_ref & ~big
    g, r = got[fin], ref64[fin]
    if g.numel() == 0:
        return
    p = plain.detach().double()[fin]
    ok = torch.isfinite(p)
    plain_err = (p[ok] - r[ok]).abs().max().item() if bool(ok.any()) else 0.0
    err = (g - r).abs()
    bound = 2.0 * plain_err + atol + rtol * r.abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{what}: error {err[worst].item():.3e} > bound {bound[worst].item():.3e} "
        f"(got {g[worst].item()!r}, reference {r[worst].item()!r})"
    )


def _low(t: torch.Tensor) -> torch.Tensor:
    """The input as the reference sees it in its own dtype (fp16/bf16 compute in fp32)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _backends(op, dtype):
    return mk.available_backends(op, "cpu", dtype)


# --------------------------------------------------------------------------- log-probs


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


@st.composite
def _linear_case(draw, op):
    dtype = draw(st.sampled_from(DTYPES))
    backend = draw(st.sampled_from(_backends(op, dtype)))
    n = draw(st.integers(1, 9))
    v = draw(st.integers(1, 13))
    d = draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    # the fp32 GEMM must not overflow where the float64 reference does not: both sides
    # moderate (the scale sweep to float max runs on the logits ops)
    h = (_tensor((n, d), dtype, scale=_scale(draw, dtype, False), layout=draw(LAYOUTS),
                     gen=gen))  # fmt: skip
    h = _inject(h, draw(INJECT), gen)
    w = (_tensor((v, d), dtype, scale=_scale(draw, dtype, False), layout=draw(LAYOUTS),
                     gen=gen))  # fmt: skip
    bias = draw(st.sampled_from([None, "bias"]))
    if bias:
        bias = torch.randn(v, generator=gen).to(dtype)
    temp = draw(st.sampled_from(TEMPS))
    return backend, h, w, bias, temp, gen, draw


def _gemm_tol(h, w, temp, acc):
    """Rounding bound of one logit z / T from the GEMM in the accumulation dtype."""
    eps = torch.finfo(acc).eps
    hm = h.double().nan_to_num(0.0, 0.0, 0.0).abs().amax().item()
    return 4.0 * eps * h.shape[-1] * hm * w.double().abs().amax().item() / temp


def _acc(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


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


# --------------------------------------------------------------------------- JS


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


# --------------------------------------------------------------------------- policy loss


@_body(st.data())
def _policy_body(data):
    backend, h, w, bias, temp, gen, draw = data.draw(_linear_case("linear_policy_loss"))
    n, v = h.shape[0], w.shape[0]
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.25] = -100
    with torch.no_grad():
        lp64 = R.linear_logprobs_ref(h.double(), w.double(), labels, temperature=temp,
                                     bias=None if bias is None else bias.double())  # fmt: skip
    old = (lp64 + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    old = old.nan_to_num(0.0, 0.0, 0.0)
    ignored = labels == -100
    old[ignored] = draw(st.sampled_from([0.0, -math.inf, math.nan]))  # never read
    adv = torch.randn(n, generator=gen)
    beta = draw(st.sampled_from([0.0, 0.04]))
    ref = (old + 0.1 * torch.randn(n, generator=gen)) if beta else None
    if ref is not None:
        ref[ignored] = 0.0
    agg = draw(st.sampled_from(mk.policy_loss.AGGREGATIONS))
    cut = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=3)))
    cu = torch.tensor([0, *cut, n])
    bad = draw(st.sampled_from([None, None, None, "cu", "norm_len", "old", "adv", "label"]))
    norm_len = draw(st.sampled_from([None, 3.0]))
    if bad == "cu":
        # not starting at 0, not monotone, not ending at N (dropping the last boundary is
        # valid when the one before is N too: then end one short)
        short = cu[:-1] if int(cu[-2]) != n else torch.cat([cu[:-1], cu[-1:] - 1])
        cu = draw(st.sampled_from([cu + 1, cu.flip(0), short]))
        agg = "seq-mean-token-mean"
    elif bad == "norm_len":
        norm_len = draw(st.sampled_from([0.0, -2.0, math.inf, math.nan]))
    elif bad == "old" and bool((~ignored).any()):
        old[(~ignored).nonzero()[0]] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    elif bad == "adv" and bool((~ignored).any()):
        adv[(~ignored).nonzero()[0]] = draw(st.sampled_from([math.nan, math.inf]))
    elif bad == "label":
        labels[0] = v
    fn = mk.linear_policy_loss
    kw = dict(bias=bias, temperature=temp, aggregation=agg, cu_seqlens=cu, norm_len=norm_len,
              ref_logprobs=ref, beta=beta, backend=backend)  # fmt: skip
    try:
        loss, metrics = fn(h.detach().clone().requires_grad_(), w, labels, old, adv, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert bad is not None, f"ValueError on valid input: {e}"
        return
    assert bad in (None, "old", "adv"), f"accepted bad {bad}"  # old/adv: only ignored ones
    lens = cu[1:] - cu[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    br = None if bias is None else bias.double()
    # seq-mean-token-sum-norm's default normalizer: the most valid tokens of one sequence
    valid_counts = torch.zeros(len(lens)).index_add_(0, seq_ids, (~ignored).float())
    max_len = max(1.0, float(valid_counts.max()))
    rloss, rmet = R.linear_policy_loss_ref(
        h.double(), w.double(), labels, old.double(), adv.double(), bias=br, temperature=temp,
        ref_logprobs=None if ref is None else ref.double(), beta=beta, aggregation=agg,
        seq_ids=seq_ids, num_seqs=len(lens), norm_len=norm_len,
    )  # fmt: skip
    bl = None if bias is None else _low(bias)
    ploss, pmet = R.linear_policy_loss_ref(
        _low(h), _low(w), labels, old, adv, bias=bl, temperature=temp, ref_logprobs=ref,
        beta=beta, aggregation=agg, seq_ids=seq_ids, num_seqs=len(lens), norm_len=norm_len,
    )  # fmt: skip
    what = f"linear_policy_loss[{backend}, {h.dtype}, {agg}, beta={beta}]"
    # L_t = -min(r A, ...), r = exp(logp - old): an error e in logp moves L_t by ~ r |A| e
    lp_tol = 2e-5 + 2 * _gemm_tol(h, w, temp, _acc(h))
    r_max = torch.exp(lp64 - old.double()).nan_to_num(0.0, 0.0, 0.0)[~ignored]
    scale = (r_max.abs().max().item() if r_max.numel() else 1.0) * adv.abs().max().item() + 1.0
    tol = 4 * lp_tol * scale * max(1.0, n / (norm_len or max_len))
    _assert_matches(loss, rloss, ploss, what + " loss", atol=tol, rtol=1e-5)
    # clip_fraction counts r A > clamp(r) A strictly, as the reference; a token whose
    # reference log-ratio lies within the log-prob error of a clip boundary may fall on
    # the other side in the op: each such token may move the fraction by 1 / (valid tokens)
    log_r = lp64 - old.double()
    bounds = (math.log1p(0.2), math.log1p(-0.2))  # the default clip_low = clip_high = 0.2
    assert "clip_low" not in kw and "clip_high" not in kw
    near = ((log_r - bounds[0]).abs() <= lp_tol) | ((log_r - bounds[1]).abs() <= lp_tol)
    near &= ~ignored
    clip_tol = (int(near.sum()) + 1e-3) / max(1, int((~ignored).sum()))
    for key in ("mean_ratio", "clip_fraction", "kl"):
        if key in rmet:
            assert key in metrics, f"{what}: metric {key} missing"
            m_tol = tol if key != "clip_fraction" else clip_tol
            _assert_matches(metrics[key], rmet[key], pmet[key], f"{what} {key}", atol=m_tol,
                            rtol=1e-5)  # fmt: skip


# --------------------------------------------------------------------------- advantages


@st.composite
def _rewards_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = _scale(draw, dtype)
    # verifier-like scores: a few levels (pass/fail/partial), then scaled
    levels = torch.randint(0, 5, (n, k), generator=gen).double() / 4.0
    rewards = (levels * scale).clamp(-_fmax(dtype), _fmax(dtype)).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    if layout == "strided":
        big = torch.zeros((2 * n, k), dtype=dtype)
        big[::2] = rewards
        rewards = big[::2]
    elif layout == "transposed":
        rewards = rewards.t().contiguous().t()
    gsize = draw(st.integers(1, 4))
    group_ids = torch.arange(n) // gsize
    rewards = _inject(rewards, draw(INJECT), gen)
    weights = draw(st.sampled_from([None, "w", "bad"]))
    if weights == "w":
        weights = torch.rand(k, generator=gen, dtype=torch.float64).to(dtype) + 0.5
    elif weights == "bad":
        weights = torch.ones(k, dtype=dtype)
        weights[-1] = draw(st.sampled_from([math.nan, math.inf]))
    eps = draw(st.sampled_from([0.0, 1e-6]))
    eps_batch = draw(st.sampled_from([None, 0.0, 1e-6]))
    nan = draw(st.sampled_from(["error", "zero"]))
    return rewards, group_ids, weights, eps, eps_batch, nan, gen, draw


def _gdpo_ref_inputs(rewards, weights, nan):
    r = rewards.double()
    if nan == "zero":
        r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    return r, None if weights is None else weights.double()


def _rewards_bad(rewards, weights, nan):
    bad_r = nan == "error" and not bool(torch.isfinite(rewards).all())
    bad_w = weights is not None and not bool(torch.isfinite(weights).all())
    return bad_r or bad_w


def _adv_tol(rewards):
    """float32 (or float64) rounding of normalized quantities: O(n) terms of size O(sqrt n)."""
    eps = torch.finfo(_acc(rewards)).eps
    return 64 * eps * rewards.shape[0]


@_body(st.data())
def _gdpo_body(data):
    rewards, gid, weights, eps, eps_batch, nan, gen, draw = data.draw(_rewards_case())
    batch_norm = draw(st.sampled_from(["sequence", "token"]))
    n = rewards.shape[0]
    lengths = torch.randint(1, 6, (n,), generator=gen) if batch_norm == "token" else None
    bad_len = batch_norm == "token" and draw(st.booleans()) and draw(st.booleans())
    if bad_len:
        lengths = lengths.clone()
        lengths[0] = draw(st.sampled_from([0, -3]))
    fn = mk.gdpo_advantages
    kw = dict(weights=weights, eps=eps, eps_batch=eps_batch, batch_norm=batch_norm,
              lengths=lengths)  # fmt: skip
    try:
        out = fn(rewards, gid, nan=nan, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert _rewards_bad(rewards, weights, nan) or bad_len, f"ValueError on valid input: {e}"
        return
    assert not _rewards_bad(rewards, weights, nan) and not bad_len, "bad input accepted"
    r, w = _gdpo_ref_inputs(rewards, weights, nan)
    ref = R.gdpo_advantages_ref(r, gid, **dict(kw, weights=w))
    tol = _adv_tol(rewards)
    for name, a, b in zip(ref._fields, out, ref):
        assert not bool(a.isnan().any()), f"gdpo {name}: NaN for finite input"
        if name in ("mean", "std"):  # in reward units: relative
            _assert_matches(a, b, b, f"gdpo {name}", atol=tol, rtol=tol)
        else:
            _assert_matches(a, b, b, f"gdpo {name}", atol=tol, rtol=0)


def _relevance_case(draw, gen, n, k, dtype):
    lengths = torch.randint(1, 5, (n,), generator=gen)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(k, int(cu[-1]), generator=gen, dtype=torch.float64)
    if draw(st.booleans()):  # exact zeros: delta / uniform fallbacks
        rel[rel < 0.3] = 0.0
    rel = rel.to(dtype)
    bad = draw(st.sampled_from([None, None, None, "nan", "inf", "neg"]))
    if bad:
        rel = rel.clone()
        rel[0, 0] = {"nan": math.nan, "inf": math.inf, "neg": -0.5}[bad]
    has_info = torch.rand(n, k, generator=gen) < 0.7
    return rel, cu, has_info, bad


@_body(st.data())
def _token_adv_body(data):
    rewards, gid, weights, eps, eps_batch, nan, gen, draw = data.draw(_rewards_case())
    n, k = rewards.shape if rewards.dim() == 2 else (rewards.shape[0], 1)
    rel, cu, has_info, bad_rel = _relevance_case(draw, gen, n, k, rewards.dtype)
    padded = draw(st.booleans())
    alpha = draw(st.sampled_from([0.0, 0.5, 1.0]))
    gamma = draw(st.sampled_from([1.0, 2.0, 0.5]))
    clip = draw(st.sampled_from([None, (0.5, 2.0), (0.5,), (1.5, 2.0)]))
    batch_norm = draw(st.sampled_from(["sequence", "token"]))
    kw = dict(weights=weights, eps=eps, eps_batch=eps_batch, alpha=alpha, gamma=gamma,
              clip=clip, batch_norm=batch_norm)  # fmt: skip
    fn = mk.mrtpo_token_advantages
    lengths = cu[1:] - cu[:-1]
    if padded:
        t = int(lengths.max())
        mask = torch.arange(t)[None, :] < lengths[:, None]
        rel_in = torch.full((k, n, t), math.nan, dtype=rel.dtype)  # padding is never read
        rel_in[:, mask] = rel
        args = dict(response_mask=mask)
    else:
        rel_in, args = rel, dict(cu_seqlens=cu)
    bad_clip = clip is not None and (len(clip) != 2 or clip[0] > 1)
    try:
        out = fn(rewards, gid, rel_in, has_info=has_info, nan=nan, **args, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert _rewards_bad(rewards, weights, nan) or bad_rel or bad_clip, f"valid input: {e}"
        return
    assert not (_rewards_bad(rewards, weights, nan) or bad_rel or bad_clip), "accepted"
    r, w = _gdpo_ref_inputs(rewards, weights, nan)
    rel_list = [rel[:, int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    tok_ref, g_ref = R.mrtpo_token_advantages_ref(r, gid, rel_list, has_info=has_info,
                                                 **dict(kw, weights=w))  # fmt: skip
    tok = out.token[mask] if padded else out.token
    tol = _adv_tol(rewards) * (1 + 4 * k)
    what = f"mrtpo_token_advantages[{rewards.dtype}, padded={padded}]"
    assert not bool(tok.isnan().any()), f"{what}: NaN for finite input"
    # token values are O(per_reward * w_hat): w_hat up to T / (its share of the mass)
    w_max = max(1.0, float(lengths.max()))
    ref_cat = torch.cat(tok_ref)
    _assert_matches(tok, ref_cat, ref_cat, what, atol=tol * w_max * 8, rtol=tol)
    _assert_matches(out.sequence, g_ref.sequence, g_ref.sequence, what + " seq", atol=tol)


@_body(st.data())
def _specific_body(data):
    draw = data.draw
    dtype = draw(st.sampled_from(DTYPES))
    n, k = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    rel, cu, has_info, bad = _relevance_case(draw, gen, n, k, dtype)
    control = None
    if draw(st.booleans()):
        control = torch.rand(rel.shape[1], generator=gen).to(dtype)
    try:
        out = mk.specific_relevance(rel, has_info, control=control, cu_seqlens=cu)
    except ValueError as e:
        assert _names_an_argument(e, mk.specific_relevance), str(e)
        assert bad == "inf", f"ValueError on valid input: {e}"
        return
    assert bad != "inf", "infinite relevance accepted"
    rel_list = [rel[:, int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    ctl = None
    if control is not None:
        ctl = [control[int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    ref = torch.cat(R.specific_relevance_ref(rel_list, has_info, control=ctl), dim=1)
    plain = torch.cat(R.specific_relevance_ref(
        [rel[:, int(cu[i]) : int(cu[i + 1])] for i in range(n)], has_info,
        control=None if control is None else [control[int(cu[i]) : int(cu[i + 1])]
                                              for i in range(n)]), dim=1)  # fmt: skip
    what = f"specific_relevance[{dtype}, bad={bad}]"
    eps = torch.finfo(dtype).eps
    _assert_matches(out, ref, plain, what, atol=4 * eps, rtol=4 * eps)


# --------------------------------------------------------------------------- the tests


def _run_logits(case):
    _check_logprobs_from_logits(case)


@_body(_logits_case())
def _logits_body(case):
    _run_logits(case)


@_body(_js_case())
def _js_body(case):
    _check_js(case)


BODIES = {
    "logprobs_from_logits": _logits_body,
    "linear_logprobs": _linear_logprobs_body,
    "js_distance": _js_body,
    "linear_js_distance": _linear_js_body,
    "linear_policy_loss": _policy_body,
    "gdpo_advantages": _gdpo_body,
    "mrtpo_token_advantages": _token_adv_body,
    "specific_relevance": _specific_body,
}


def test_every_public_op_is_fuzzed():
    assert set(BODIES) == set(mk.OPS)


@pytest.mark.parametrize("op", sorted(BODIES))
def test_fuzz(op):
    _run(BODIES[op], FAST)


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(BODIES))
def test_fuzz_long(op):
    _run(BODIES[op], LONG)


# --------------------------------------------------------------------------- checks off

_CHECKS_OFF_SCRIPT = textwrap.dedent(
    """
    import math, sys
    import torch
    from hypothesis import HealthCheck, given, settings, strategies as st
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    assert not mk._validation.value_checks_enabled()
    EXAMPLES = int(sys.argv[1])
    BAD_LABELS = [-1, -101, 10**12, -(10**12), 2**62]

    def labels_ok(err):
        assert str(err).startswith("labels"), str(err)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        draw = data.draw
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
        n, v, d = draw(st.integers(1, 7)), draw(st.integers(1, 11)), draw(st.integers(1, 5))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        z = torch.randn(n, v, generator=gen).to(dtype)
        h = torch.randn(n, d, generator=gen).to(dtype)
        w = torch.randn(v, d, generator=gen).to(dtype)
        y = torch.randint(0, v, (n,), generator=gen)
        bad = draw(st.sampled_from(BAD_LABELS + [v]))
        y[draw(st.integers(0, n - 1))] = bad
        op = draw(st.sampled_from(["logits", "linear", "policy", "cu", "adv", "rel"]))
        backends = mk.available_backends("linear_logprobs", "cpu", dtype)
        for backend in backends if op in ("logits", "linear", "policy") else ():
            try:
                if op == "logits":
                    zz = z.clone().requires_grad_()
                    mk.logprobs_from_logits(zz, y, backend=backend).sum().backward()
                elif op == "linear":
                    hh = h.clone().requires_grad_()
                    mk.linear_logprobs(hh, w, y, backend=backend).sum().backward()
                else:
                    hh = h.clone().requires_grad_()
                    loss, _ = mk.linear_policy_loss(hh, w, y, torch.zeros(n), torch.ones(n),
                                                    backend=backend)
                    loss.backward()
            except ValueError as e:  # the CPU contract: raised after the pass
                labels_ok(e)
            else:
                raise AssertionError(f"{op}/{backend}: out-of-range label {bad} accepted")
        y_ok = torch.randint(0, v, (n,), generator=gen)
        if op == "cu":  # bad boundaries: on CPU a ValueError naming cu_seqlens, never a crash
            cu = torch.tensor(draw(st.sampled_from(
                [[1, n], [0, n + 5], [0, n + 1, n], [0, -(10**6), n], [0, 10**6, n]])))
            try:
                mk.linear_policy_loss(h, w, y_ok, torch.zeros(n), torch.ones(n),
                                      aggregation="seq-mean-token-mean", cu_seqlens=cu)
            except ValueError as e:
                assert str(e).startswith("cu_seqlens"), str(e)
            else:
                raise AssertionError(f"bad cu_seqlens {cu.tolist()} accepted")
        if op in ("adv", "rel"):
            k = 2
            rewards = torch.rand(n, k, generator=gen).to(dtype)
            rel = torch.rand(k, 3 * n, generator=gen)
            cu = torch.arange(0, 3 * n + 1, 3)
            if op == "adv":
                cu = cu.clone()
                cu[draw(st.integers(0, n))] += draw(st.sampled_from([-5, 1, 10**6, -(10**6)]))
                cu_ok = int(cu[0]) == 0 and int(cu[-1]) == 3 * n and bool((cu.diff() >= 0).all())
            else:
                rel[0, 0] = draw(st.sampled_from([math.nan, math.inf, -1.0]))
            try:
                out = mk.mrtpo_token_advantages(rewards, torch.arange(n) // 2, rel,
                                                has_info=torch.ones(n, k, dtype=torch.bool),
                                                cu_seqlens=cu)
                out.token.sum().item()
            except ValueError as e:
                assert op == "rel" or (not cu_ok and str(e).startswith("cu_seqlens")), str(e)
            else:
                assert op == "rel" or cu_ok, f"bad cu_seqlens {cu.tolist()} accepted"

    run()
    # memory intact: a correct call still matches the reference
    z = torch.randn(5, 9)
    y = torch.tensor([0, 8, -100, 3, 4])
    got = mk.logprobs_from_logits(z, y, temperature=0.7)
    ref = R.logprobs_from_logits_ref(z.double(), y, temperature=0.7)
    assert torch.allclose(got.double(), ref, atol=1e-5), (got, ref)
    print("done")
    """
)


def _checks_off(examples: int, tmp_path: Path):
    script = tmp_path / "checks_off.py"
    script.write_text(_CHECKS_OFF_SCRIPT)
    env = dict(os.environ, MRTPO_SKIP_VALUE_CHECKS="1", OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script), str(examples)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # a crash (a signal: negative return code) or any failure fails the test
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("done"), proc.stdout


def test_fuzz_value_checks_off_in_subprocess(tmp_path):
    _checks_off(60, tmp_path)


# Regression (root cause of the invalid free / segfault with the checks off): the segment
# code behind cu_seqlens (torch.repeat_interleave with output_size in the policy loss's
# sequence rules and in the packed reallocation) trusts the boundaries; [0, 3, 6, 10**6+9,
# 12, ...] (the right total, a negative step) wrote past its output. Eager CPU calls now
# check the boundaries even with the checks off; torch.compile traces (and GPU tensors)
# get sync-free clamped boundaries.
_BAD_CU_SCRIPT = textwrap.dedent(
    """
    import torch
    import mrtpo_kernels as mk

    n, k = 7, 2
    rewards, rel = torch.rand(n, k), torch.rand(k, 3 * n)
    h, w = torch.randn(3 * n, 4, requires_grad=True), torch.randn(9, 4)
    y = torch.randint(0, 9, (3 * n,))

    def adv(cu):
        return mk.mrtpo_token_advantages(rewards, torch.arange(n) // 2, rel, cu_seqlens=cu,
                                         has_info=torch.ones(n, k, dtype=torch.bool)).token

    def loss(cu):
        return mk.linear_policy_loss(h, w, y, torch.zeros(3 * n), torch.ones(3 * n),
                                     aggregation="seq-mean-token-mean", cu_seqlens=cu)[0]

    BAD = [[0, 3, 6, 10**6 + 9, 12, 15, 18, 21], [0, 3, 6, -(10**6), 12, 15, 18, 21],
           [5, 3, 6, 9, 12, 15, 18, 2**40]]
    for fn in (adv, loss):  # eager: named ValueError, as with the checks on
        for bad in BAD:
            try:
                fn(torch.tensor(bad))
            except ValueError as e:
                assert str(e).startswith("cu_seqlens"), str(e)
            else:
                raise AssertionError(f"{fn.__name__}: {bad} accepted")
    for fn in (adv, loss):  # traced: no value check, clamped boundaries, finite results
        compiled = torch.compile(fn, backend="eager")
        for bad in BAD:
            out = compiled(torch.tensor(bad))
            assert bool(out.isfinite().all()), (fn.__name__, bad, out)
            if fn is loss:
                out.backward()
                assert bool(h.grad.isfinite().all())
    print("done")
    """
)


def test_bad_cu_seqlens_with_checks_off_never_corrupt_memory(tmp_path):
    script = tmp_path / "bad_cu.py"
    script.write_text(_BAD_CU_SCRIPT)
    env = dict(os.environ, MRTPO_SKIP_VALUE_CHECKS="1", OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("done"), proc.stdout


@pytest.mark.slow
def test_fuzz_value_checks_off_in_subprocess_long(tmp_path):
    _checks_off(600, tmp_path)


# Regression: clip_fraction counts r A > clamp(r) A strictly, as the reference does, so a
# NaN log-prob (a NaN hidden row) or a NaN product (r = inf with A = 0) is not clipped; the
# C++ row kernel counted every token that was not "unclipped" (NaN included), the torch
# kernel a NaN product.
@pytest.mark.parametrize("backend", _backends("linear_policy_loss", torch.float32))
def test_clip_fraction_strict_rule_on_nan_and_inf_ratio(backend):
    gen = torch.Generator().manual_seed(3)
    n, v, d = 6, 11, 4
    h = torch.randn(n, d, generator=gen)
    h[0, 1] = math.nan  # logp NaN: ratio NaN
    w = torch.randn(v, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    lp = R.linear_logprobs_ref(h.double(), w.double(), y)
    old = (lp + torch.tensor([0.0, -800.0, 0.5, -0.5, 0.01, 0.0])).float()  # token 1: r = inf
    adv = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    old[0] = -1.0  # finite: only the log-prob is NaN
    old[5] = -math.inf  # ignored token: never read
    y[5] = -100
    _, got = mk.linear_policy_loss(h, w, y, old, adv, backend=backend)
    _, ref = R.linear_policy_loss_ref(
        h.double(), w.double(), y, old.double(), adv.double(), seq_ids=None, num_seqs=1
    )
    # of the 5 scored tokens only token 3 (r = e^0.5 > 1.2, A > 0) is clipped; token 2 has
    # r = e^-0.5 with A > 0 (r A is the minimum), token 4 r = e^-0.01 inside the range
    assert float(ref["clip_fraction"]) == pytest.approx(0.2, abs=1e-12)
    assert float(got["clip_fraction"]) == pytest.approx(float(ref["clip_fraction"]), abs=1e-7)
