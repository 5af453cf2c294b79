"""Triton JS-distance kernels (mrtpo_kernels/triton_kernels/js.py)
on CPU tensors under the Triton interpreter, checked through the public API
(backend="triton") against the float64 references of mrtpo_kernels.reference.

The interpreter is switched on by TRITON_INTERPRET=1, which must be set before triton is
imported, so this file runs as its own process:

    python tests/triton_cases/js_cases.py [group ...]       (default: every group)

tests/test_triton_js.py runs one process per group. Exit status 0 when every check passed,
1 (with the failures listed) otherwise. Error rule (README.md, "Numerics"): our error against
float64 is at most 2x that of the "torch" backend in the same dtype, plus a small atol
(tests/triton_cases/_harness.py: close).
"""

from __future__ import annotations

import sys

import _harness
from _harness import close, compile_check, expect, opcheck

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import (  # noqa: E402
    js_distance_ref,
    linear_js_distance_ref,
)


def in_unit_interval(name, d):
    expect(name, bool(((d >= 0) & (d <= 1)).all()), f"values outside [0, 1]: {d.min()}, {d.max()}")


# --------------------------------------------------------------------------- JS, linear


def _linear_case(n, v, d, k, *, dtype=torch.float32, bias=True, temp=0.7, noise=0.5, seed=0,
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
    _linear_case(1, 1, 3, 1)  # one token, one-word vocabulary: P = Q, d = 0
    _linear_case(1, 5003, 64, 3, temp=1.3)
    _linear_case(7, 1000, 3, 3, bias=False)
    _linear_case(7, 5003, 3, 1, temp=0.5, squeeze=True, tag=" hidden_q (N, d)")
    _linear_case(7, 1, 64, 3)
    _linear_case(129, 1000, 64, 3, temp=1.7)
    _linear_case(129, 5003, 3, 1, bias=False)


def group_linear_chunks_dtypes():
    # A small scratch budget: several token chunks, the last one shorter.
    with _harness.env(MRTPO_JS_SCRATCH_BYTES=4 * 4 * 1000 * 40):  # C = 40 tokens at K = 3
        _linear_case(129, 1000, 64, 3, seed=1, tag=" chunks of 40")
        _linear_case(129, 1000, 3, 1, seed=2, bias=False, tag=" chunks")
    _linear_case(7, 1000, 64, 3, dtype=torch.bfloat16, seed=3)
    _linear_case(7, 1000, 64, 1, dtype=torch.float16, seed=4, temp=1.2)
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
    _linear_case(37, 1000, 64, 3, scale=1e4, noise=1e-3, seed=6, tag=" extreme")
    # Close distributions: d ~ 1e-3 (the small-|delta| series branch).
    _linear_case(37, 1000, 64, 3, noise=1e-3, seed=7, tag=" close")
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


def _logits_case(n, v, k, *, dtype=torch.float32, temp=1.3, scale=3.0, noise=1.0, seed=0,
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
        _logits_case(n, v, 1 if i % 2 else 3, seed=i)
    _logits_case(7, 5003, 3, dtype=torch.bfloat16, seed=20)
    _logits_case(7, 1000, 5, scale=1e4, noise=1.0, seed=21, tag=" extreme")
    _logits_case(7, 1000, 3, noise=1e-3, seed=22, tag=" close")
    _logits_case(7, 1000, 3, noise=0.25, seed=23, tag=" |delta| near 1/2")
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


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
