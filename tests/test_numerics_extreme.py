"""Extreme and non-finite inputs: the contract of README "Numerics" on every CPU backend.

- Scale sweep: |z / T| from 1 to 1e30 and logits near float max, T in {0.3, 0.7, 1, 1.7}
  (non-powers of two included), for log-probs, entropy, their gradients and the JS
  distance, against the float64 reference on the same fp32 logits. Rows with a tied top
  pair make the answer depend on the exact zero of the max entry (the case an FMA-rounded
  max got wrong), and Q shares P's top entries so that JS is 0 at large scale.
- NaN / +inf / -inf injection: NaN or +inf anywhere in a row gives NaN for that row (JS
  too, never 0), -inf entries are masked, ignored rows stay 0; other rows are unaffected.
- Out-of-range labels with value checks off, in a subprocess (a crash fails the test, it
  does not kill pytest): a ValueError naming labels on CPU, memory intact afterwards.
- The Triton kernels under TRITON_INTERPRET=1 (subprocess): NaN log-prob and zero gradient
  for an out-of-range label, NaN JS for a non-finite row.
Here the cases that check several ops on the same inputs; those of one op are in its test
module (tests/test_logprobs.py: a row overflowing both ways; tests/test_policy_loss.py:
non-finite hidden states, the k3 KL term).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from triton_cases._harness import interpreted, run_interpreted

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R
from mrtpo_kernels.backends import cpu_backend

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["torch"] + (["cpu"] if cpu_backend.available() else [])
TEMPS = [0.3, 0.7, 1.0, 1.7]
SCALES = [1.0, 1e3, 1e7, 1e15, 1e30, "max"]
FMAX = torch.finfo(torch.float32).max
N, V = 12, 67


def _logits(scale, temp, seed):
    """fp32 logits with |z / T| ~ scale (or spread up to float max), and a Q sharing P's top
    two entries. Even rows have a tied top pair (p = (1/2, 1/2) at large scale)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, V, generator=g, dtype=torch.float64)
    top = base.argmax(-1)
    second = (top + 1 + torch.arange(N) % (V - 1)) % V
    even = torch.arange(N) % 2 == 0
    base[even, second[even]] = base[even, top[even]]
    other = base - 0.1 * torch.randn(N, V, generator=g, dtype=torch.float64).abs()
    keep = torch.zeros(N, V, dtype=torch.bool)
    keep[torch.arange(N), top] = True
    keep[even, second[even]] = True
    other = torch.where(keep, base, other)  # below P's entries elsewhere: same top
    if scale == "max":
        k = 0.99 * FMAX / base.abs().amax()
        return (base * k).float(), (other * k).clamp(-FMAX, FMAX).float()
    return (base * scale * temp).float(), (other * scale * temp).float()


def _close(got, ref, rtol, atol, what):
    """got within atol + rtol |ref| of ref; where |ref| exceeds the fp32 range the fp32
    answer is the correctly rounded +-inf."""
    got = got.double()
    assert got.shape == ref.shape, what
    beyond = ref.abs() > FMAX
    assert bool((got[beyond] == ref[beyond].sign() * math.inf).all()), f"{what}: beyond fp32"
    got, ref = got[~beyond], ref[~beyond]
    assert not got.isnan().any(), f"{what}: NaN where the reference is {ref[got.isnan()]}"
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temp", TEMPS)
@pytest.mark.parametrize("scale", SCALES, ids=str)
def test_scale_sweep_against_float64(backend, temp, scale):
    z, zq = _logits(scale, temp, seed=10 * TEMPS.index(temp) + SCALES.index(scale))
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    y[1] = -100
    g_lp = torch.randn(N, generator=torch.Generator().manual_seed(4))
    g_en = torch.randn(N, generator=torch.Generator().manual_seed(5))
    what = f"{backend} T={temp} scale={scale}"

    zz = z.clone().requires_grad_()
    lp, en = mk.logprobs_from_logits(zz, y, temperature=temp, return_entropy=True, backend=backend)
    ((lp * g_lp).sum() + (en * g_en).sum()).backward()
    zr = z.double().requires_grad_()
    rlp, ren = R.logprobs_from_logits_ref(zr, y, temperature=temp, return_entropy=True)
    ((rlp * g_lp.double()).sum() + (ren * g_en.double()).sum()).backward()
    _close(lp, rlp, 2e-6, 2e-5, f"{what} logp")
    _close(en, ren, 2e-6, 2e-5, f"{what} entropy")
    gscale = zr.grad.abs().max().item() + 1.0 / temp
    _close(zz.grad, zr.grad, 0.0, 2e-5 * gscale, f"{what} grad")

    d = mk.js_distance(z, zq, temperature=temp, backend=backend)
    rd = R.js_distance_ref(z.double(), zq.double(), temperature=temp)
    # compare JSD = ln2 d^2 (d = sqrt(JSD) amplifies the error near 0)
    _close(d.double() ** 2, rd**2, 1e-5, 2e-6, f"{what} JS")
    if scale not in (1.0, 1e3):  # P, Q share the top entries: JS 0 (one-hot or tied pair)
        assert float(rd.abs().max()) < 1e-6, "test data: Q should share P's top entries"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [FMAX, -FMAX, 1e38, 3.0])
def test_equal_rows_give_minus_log_v(backend, value):
    z = torch.full((3, V), value, dtype=torch.float32)
    y = torch.tensor([0, V - 1, 5])
    for temp in (0.3, 0.7, 1.7):
        zz = z.clone().requires_grad_()
        lp, en = mk.logprobs_from_logits(
            zz, y, temperature=temp, return_entropy=True, backend=backend
        )
        lp.sum().backward()
        torch.testing.assert_close(lp, torch.full((3,), -math.log(V)), rtol=0, atol=1e-5)
        torch.testing.assert_close(en, torch.full((3,), math.log(V)), rtol=0, atol=1e-5)
        want = -torch.full((3, V), 1.0 / V)
        want[torch.arange(3), y] += 1.0
        torch.testing.assert_close(zz.grad, want / temp, rtol=1e-5, atol=1e-6)
        d = mk.js_distance(z, z, temperature=temp, backend=backend)
        assert bool((d == 0).all()), d


def _nonfinite_rows():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(7, V, generator=g)
    z[0, 5] = float("nan")  # NaN
    z[1, 9] = float("inf")  # +inf
    z[2] = float("-inf")  # nothing but -inf
    z[3, :20] = float("-inf")  # masked entries: a defined row
    z[4, 2] = float("nan")  # NaN in an ignored row
    # rows 5, 6 finite
    y = torch.tensor([1, 2, 3, 30, -100, 0, V - 1])
    return z, y


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_logits_rows(backend):
    z, y = _nonfinite_rows()
    zz = z.clone().requires_grad_()
    lp, en = mk.logprobs_from_logits(zz, y, temperature=0.7, return_entropy=True, backend=backend)
    (lp.sum() + en.sum()).backward()
    rlp, ren = R.logprobs_from_logits_ref(z.double(), y, temperature=0.7, return_entropy=True)
    for got, ref in ((lp, rlp), (en, ren)):
        assert bool(got[:3].isnan().all()) and bool(ref[:3].isnan().all()), (got, ref)
        assert got[4].item() == 0.0 and ref[4].item() == 0.0
        torch.testing.assert_close(got[[3, 5, 6]].double(), ref[[3, 5, 6]], rtol=1e-5, atol=1e-5)
    assert bool(zz.grad[:3].isnan().all()), "a NaN row's gradient must be NaN"
    assert bool((zz.grad[4] == 0).all()), "an ignored row's gradient is 0 whatever its logits"
    assert bool(zz.grad[3, :20].eq(0).all()) and bool(zz.grad[[3, 5, 6]].isfinite().all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_js_is_nan_never_zero(backend):
    z, _ = _nonfinite_rows()
    d = mk.js_distance(z, z.clone(), backend=backend)  # identical inputs
    rd = R.js_distance_ref(z.double(), z.double())
    for got in (d, rd):
        assert bool(got[[0, 1, 2, 4]].isnan().all()), got
        assert bool((got[[3, 5, 6]] == 0).all()), got
    # NaN on one side only, and one-vs-K
    q = torch.randn(2, 7, V)
    q[1, 5, 0] = float("nan")
    d = mk.js_distance(z[5:], q[:, 5:], backend=backend)
    assert d[1, 0].isnan() and bool(d[0].isfinite().all()) and d[1, 1].isfinite()
    # through the LM head: a NaN hidden state
    h = torch.randn(4, 8)
    hq = h.clone()
    hq[2, 3] = float("nan")
    w = torch.randn(V, 8)
    d = mk.linear_js_distance(h, hq, w, backend=backend)
    assert d[2].isnan() and bool(d[[0, 1, 3]].eq(0).all()), d


_LABELS_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    os.environ["MRTPO_SKIP_VALUE_CHECKS"] = "1"
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R
    from mrtpo_kernels.backends import cpu_backend, torch_backend
    backend = sys.argv[1]
    be = cpu_backend if backend == "cpu" else torch_backend
    N, V, D = 6, 50, 8
    z = torch.randn(N, V)
    h, w = torch.randn(N, D), torch.randn(V, D)
    lse = torch.zeros(N)
    calls = {
        "logits_fwd": lambda y: mk.logprobs_from_logits(z, y, backend=backend),
        "linear_fwd": lambda y: mk.linear_logprobs(h, w, y, backend=backend),
        "logits_bwd": lambda y: be.logprobs_from_logits_bwd(
            z, y, lse, None, torch.ones(N), None, 1.0, -100),
        "linear_bwd": lambda y: be.linear_logprobs_bwd(
            h, w, None, y, lse, None, torch.ones(N), None, 1.0, -100),
        "policy": lambda y: mk.linear_policy_loss(
            h.clone().requires_grad_(), w, y, torch.zeros(N), torch.ones(N), backend=backend),
    }
    bad_sets = [V, -5, 10**12, -(10**12), 2**62]
    for name, fn in calls.items():
        for bad in bad_sets:
            y = torch.tensor([0, 1, bad, -100, 3, V - 1])
            try:
                fn(y)
            except ValueError as e:
                assert "labels" in str(e), (name, str(e))
                print("raised", name, bad)
            else:
                print("NO ERROR", name, bad)
    # memory intact: a correct call still matches the reference
    y = torch.tensor([0, 1, 2, -100, 3, V - 1])
    got = mk.logprobs_from_logits(z, y, temperature=0.7, backend=backend)
    ref = R.logprobs_from_logits_ref(z.double(), y, temperature=0.7)
    assert torch.allclose(got.double(), ref, atol=1e-5), (got, ref)
    print("intact")
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_labels_with_checks_off(backend):
    env = dict(os.environ, MRTPO_SKIP_VALUE_CHECKS="1", OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _LABELS_SCRIPT, backend],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "NO ERROR" not in proc.stdout, proc.stdout
    assert proc.stdout.count("raised") == 25, proc.stdout
    assert "intact" in proc.stdout


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R
    from mrtpo_kernels.backends import triton_backend as TL  # the backend's entry points
    torch.manual_seed(0)
    N, V, D = 5, 37, 8
    fails = 0
    def check(name, ok):
        global fails
        print(("ok   " if ok else "FAIL ") + name)
        fails += 0 if ok else 1
    z = torch.randn(N, V)
    y = torch.tensor([3, V, -7, -100, 10**12])  # in range, V, negative, ignored, huge
    lp, ent, lse, _ = TL.logprobs_from_logits_fwd(z, y, 1.3, -100, True)
    ref = R.logprobs_from_logits_ref(z.double(), y, temperature=1.3)
    check("logp in range", abs(lp[0].item() - ref[0].item()) < 1e-5)
    check("logp NaN for out-of-range labels", bool(lp[[1, 2, 4]].isnan().all()))
    check("reference agrees", bool(ref[[1, 2, 4]].isnan().all()))
    check("ignored row 0", lp[3].item() == 0.0)
    g = torch.ones(N)
    dz = TL.logprobs_from_logits_bwd(z, y, lse, ent, g, torch.zeros(N), 1.3, -100)
    zr = z.double().requires_grad_()
    R.logprobs_from_logits_ref(zr[:1], y[:1], temperature=1.3).sum().backward()
    check("grad of the in-range row", torch.allclose(dz[0].double(), zr.grad[0], atol=1e-5))
    check("zero grad for out-of-range / ignored labels", bool((dz[1:] == 0).all()))
    h, w = torch.randn(N, D), torch.randn(V, D)
    lp2, _, lse2, _ = TL.linear_logprobs_fwd(h, w, None, y, 0.7, -100, False)
    check("linear logp NaN for out-of-range labels", bool(lp2[[1, 2, 4]].isnan().all()))
    dh, dw, db = TL.linear_logprobs_bwd(
        h, w, None, y, lse2, torch.empty(0), g, torch.empty(0), 0.7, -100)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    R.linear_logprobs_ref(hr[:1], wr, y[:1], temperature=0.7).sum().backward()
    check("linear dW only from the in-range row", torch.allclose(dw.double(), wr.grad, atol=1e-4))
    check("linear dh zero for bad rows", bool((dh[1:] == 0).all()))
    p = torch.randn(4, V)
    p[0, 5] = float("nan")
    p[1, 2] = float("inf")
    p[2] = float("-inf")
    d = mk.js_distance(p, p.clone(), backend="triton")
    check("JS NaN for NaN / +inf / all -inf rows", bool(d[:3].isnan().all()))
    check("JS 0 for an identical finite row", d[3].item() == 0.0)
    print(f"{fails} failures")
    """
)


@interpreted
def test_triton_label_bound_and_nonfinite_under_interpreter():
    run_interpreted("-c", _TRITON_SCRIPT, timeout=600)


_TRITON_SWEEP = textwrap.dedent(
    """
    import sys, traceback
    import torch
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R
    import test_numerics_extreme as T

    fails = 0
    def case(name, fn):
        global fails
        try:
            fn()
            print("ok   " + name)
        except AssertionError as exc:
            fails += 1
            print("FAIL " + name + ": " + str(exc)[:300])

    def sweep(temp, scale):
        z, zq = T._logits(scale, temp, seed=10 * T.TEMPS.index(temp) + T.SCALES.index(scale))
        y = torch.randint(0, T.V, (T.N,), generator=torch.Generator().manual_seed(3))
        y[1] = -100
        g_lp = torch.randn(T.N, generator=torch.Generator().manual_seed(4))
        g_en = torch.randn(T.N, generator=torch.Generator().manual_seed(5))
        what = f"triton T={temp} scale={scale}"
        zz = z.clone().requires_grad_()
        lp, en = mk.logprobs_from_logits(zz, y, temperature=temp, return_entropy=True,
                                         backend="triton")
        ((lp * g_lp).sum() + (en * g_en).sum()).backward()
        zr = z.double().requires_grad_()
        rlp, ren = R.logprobs_from_logits_ref(zr, y, temperature=temp, return_entropy=True)
        ((rlp * g_lp.double()).sum() + (ren * g_en.double()).sum()).backward()
        T._close(lp, rlp, 2e-6, 2e-5, f"{what} logp")
        T._close(en, ren, 2e-6, 2e-5, f"{what} entropy")
        gscale = zr.grad.abs().max().item() + 1.0 / temp
        T._close(zz.grad, zr.grad, 0.0, 2e-5 * gscale, f"{what} grad")
        d = mk.js_distance(z, zq, temperature=temp, backend="triton")
        rd = R.js_distance_ref(z.double(), zq.double(), temperature=temp)
        T._close(d.double() ** 2, rd**2, 1e-5, 2e-6, f"{what} JS")
        # the policy row kernel: logits = z @ I (exact), so dh is dL/dz; labels on each row's
        # top entry (log-probs of order 1 at every scale: a well-conditioned ratio)
        eye = torch.eye(T.V)
        h = z.clone().requires_grad_()
        y = z.argmax(-1)
        y[1] = -100
        top = R.logprobs_from_logits_ref(z.double(), y, temperature=temp)
        old = (top - 0.05).float()
        adv = torch.randn(T.N, generator=torch.Generator().manual_seed(6))
        loss, m = mk.linear_policy_loss(h, eye, y, old, adv, temperature=temp,
                                        backend="triton")
        loss.backward()
        h64 = z.double().requires_grad_()
        rloss, rm = mk.linear_policy_loss(h64, eye.double(), y, old.double(), adv.double(),
                                          temperature=temp, backend="torch")
        rloss.backward()
        T._close(loss.reshape(1), rloss.reshape(1), 1e-5, 1e-5, f"{what} policy loss")
        pscale = h64.grad.abs().max().item() + 1.0 / temp
        T._close(h.grad, h64.grad, 0.0, 2e-5 * pscale, f"{what} policy grad")

    def spread():
        # -float max in the first column block, +float max in a later one: the online max
        # rescales a sum whose old entries underflow (entropy 0 * -inf would be NaN)
        z = torch.zeros(2, 1500)
        z[:, :3] = -T.FMAX
        z[:, 1200:1203] = T.FMAX
        y = torch.tensor([1201, 1])
        for temp in (0.3, 1.0):
            zz = z.clone().requires_grad_()
            lp, en = mk.logprobs_from_logits(zz, y, temperature=temp, return_entropy=True,
                                             backend="triton")
            lp[0].backward()
            assert abs(lp[0].item() + math.log(3)) < 1e-6, lp
            assert lp[1].item() == -math.inf or lp[1].item() < -1e38, lp
            assert bool((en - math.log(3)).abs().max() < 1e-6), en
            want = torch.zeros(1500)
            want[1200:1203] = -1 / 3
            want[1201] += 1
            assert torch.allclose(zz.grad[0], want / temp, atol=1e-6), zz.grad[0, 1199:1204]

    def close_js():
        # d ~ 1e-4: delta = log p - log q from the raw differences keeps its digits
        g = torch.Generator().manual_seed(8)
        z = 3 * torch.randn(6, 300, generator=g)
        zq = (z + 1e-4 * torch.randn(3, 6, 300, generator=g)).float()
        for temp in (0.7, 1.3):
            d = mk.js_distance(z, zq, temperature=temp, backend="triton").double()
            rd = R.js_distance_ref(z.double(), zq.double(), temperature=temp)
            assert bool(((d - rd).abs() <= 2e-3 * rd + 1e-9).all()), (d - rd).abs().max()

    import math
    case("spread row across column blocks", spread)
    case("JS of close rows", close_js)
    for temp in T.TEMPS:
        for scale in T.SCALES:
            case(f"T={temp} scale={scale}", lambda: sweep(temp, scale))
    print(f"{fails} failures")
    """
)


@interpreted
def test_triton_row_kernels_scale_sweep_under_interpreter():
    """The scale sweep of test_scale_sweep_against_float64 on the Triton row kernels (the
    chunk driver + triton_kernels/rows.py) under TRITON_INTERPRET=1:
    log-probs, entropy and their gradient, JS (js_many), the policy loss and its gradient
    (through linear_policy_loss with an identity head, so the logits are exactly z)."""
    run_interpreted("-c", _TRITON_SWEEP)


@pytest.mark.parametrize("backend", BACKENDS)
def test_smallest_temperature_against_float64(backend):
    """At the smallest temperature taken (2^-126; below it a ValueError names temperature)
    log-probs, entropy and JS are float64's: a one-hot softmax on each row's max (1/2 on a
    tied pair), JS 1 between rows with different maxima and 0 between equal ones."""
    temp = 2.0**-126
    z, zq = _logits(1.0, 1.0, seed=40)
    zq[1::3] = z[1::3].flip(-1)  # other maxima: disjoint supports
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    y[::4] = z[::4].argmax(-1)
    lp, en = mk.logprobs_from_logits(z, y, temperature=temp, return_entropy=True,
                                     backend=backend)  # fmt: skip
    rlp, ren = R.logprobs_from_logits_ref(z.double(), y, temperature=temp, return_entropy=True)
    _close(lp, rlp, 1e-6, 1e-6, "logp")
    _close(en, ren, 1e-6, 1e-6, "entropy")
    d = mk.js_distance(z, zq, temperature=temp, backend=backend)
    rd = R.js_distance_ref(z.double(), zq.double(), temperature=temp)
    _close(d, rd, 1e-6, 1e-6, "JS")
    assert bool((rd[1::3] > 0.7).all()) and bool((rd == 1).any()) and bool((rd[0::3] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_largest_temperature_with_masked_entries(backend):
    """At the largest temperature taken (2^126) the distribution is uniform over the finite
    entries and a -inf entry stays masked (p = 0), as in float64; above it 2 / T would be 0
    in float32 and -inf * 0 = NaN (refused: tests/test_validation.py)."""
    temp = 2.0**126
    z, zq = _logits(1.0, 1.0, seed=41)
    z[:, 5] = -math.inf
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    y[0] = 5
    lp, en = mk.logprobs_from_logits(z, y, temperature=temp, return_entropy=True,
                                     backend=backend)  # fmt: skip
    rlp, ren = R.logprobs_from_logits_ref(z.double(), y, temperature=temp, return_entropy=True)
    _close(lp, rlp, 1e-6, 1e-6, "logp")
    _close(en, ren, 1e-6, 1e-6, "entropy")
    assert lp[0].item() == -math.inf and abs(lp[1].item() + math.log(V - 1)) < 1e-6
    d = mk.js_distance(z, zq, temperature=temp, backend=backend)
    rd = R.js_distance_ref(z.double(), zq.double(), temperature=temp)
    _close(d, rd, 1e-6, 1e-6, "JS")
