"""Shared machinery of the property-based fuzz tests (hypothesis) of the public ops; each
op's fuzz bodies and tests are in its test module (tests/test_<op>.py: ``FUZZ``,
``test_fuzz``, ``test_fuzz_long``), the cross-op ones in tests/test_fuzz.py.

Each example draws shapes (1 and odd sizes included), a memory layout (contiguous, a
strided view, an expanded view), a dtype (float32, float64, bfloat16, float16), a scale up
to the dtype's float maximum, NaN / +-inf injection and out-of-range values. The op must
either return what the float64 reference (mrtpo_kernels/reference.py) gives on the same
values, within the project's error rule (README "Numerics": at most twice the error of the
reference run in the input's own dtype, plus a small tolerance), with NaN exactly where the
reference has NaN, or raise a ValueError that names one of the op's arguments.

Profiles: FAST (deterministic, ~1 min on 2 cores for all ops) and LONG, many more examples
per op (the ``slow``-marked ``test_fuzz_long`` of each op module).
"""

from __future__ import annotations

import inspect
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mrtpo_kernels as mk

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


def fuzz_tests(fuzz: dict):
    """An op module's two fuzz tests over its ``FUZZ`` (op name -> body): ``test_fuzz``
    (the FAST profile) and ``test_fuzz_long`` (LONG, marked slow). Bind both at module level:
    ``test_fuzz, test_fuzz_long = fuzz_tests(FUZZ)``."""
    import pytest

    @pytest.mark.parametrize("op", sorted(fuzz))
    def test_fuzz(op):
        _run(fuzz[op], FAST)

    @pytest.mark.slow
    @pytest.mark.parametrize("op", sorted(fuzz))
    def test_fuzz_long(op):
        _run(fuzz[op], LONG)

    return test_fuzz, test_fuzz_long


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
