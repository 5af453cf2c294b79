"""Triton JS-distance kernels (mrtpo_kernels/triton/js.py)
on CPU tensors under the Triton interpreter, checked through the public API
(backend="triton") against the float64 references of mrtpo_kernels.reference.

The interpreter is switched on by TRITON_INTERPRET=1, which must be set before triton is
imported, so this file runs as its own process:

    python tests/triton_cases/js_cases.py [group ...]       (default: every group)

tests/test_triton_js.py runs one process per group. Exit status 0 when every check passed,
1 (with the failures listed) otherwise. Error rule (README.md, "Numerics"): our error against
float64 is at most 2x that of the "torch" backend in the same dtype, plus a small atol.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["MRTPO_STRICT_BACKEND"] = "1"  # a silent fallback to "torch" would be an error
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import (  # noqa: E402
    js_distance_ref,
    linear_js_distance_ref,
)

# Both arms of the kernels' tl.where are evaluated in numpy: masked lanes warn (inf - inf).
warnings.filterwarnings("ignore", category=RuntimeWarning)

FAILED: list[str] = []
COUNT = [0]


def check(name: str, ok: bool, detail: str = "") -> None:
    COUNT[0] += 1
    if not ok:
        FAILED.append(f"{name}: {detail}")


def within_budget(name, ours, ref64, plain, *, atol):
    """max|ours - ref64| <= 2 max|plain - ref64| + atol (plain None: atol), shapes equal,
    all finite."""
    plain = ref64 if plain is None else plain
    ours, ref64, plain = (t.detach().double() for t in (ours, ref64, plain))
    if ours.shape != ref64.shape:
        check(name, False, f"shape {tuple(ours.shape)} != {tuple(ref64.shape)}")
        return
    if not bool(torch.isfinite(ours).all()):
        check(name, False, "non-finite output")
        return
    err = (ours - ref64).abs().max().item() if ours.numel() else 0.0
    base = (plain - ref64).abs().max().item() if ours.numel() else 0.0
    bound = 2.0 * base + atol
    check(name, err <= bound, f"error {err:.3e} > {bound:.3e} (torch backend {base:.3e})")


def in_unit_interval(name, d):
    check(name, bool(((d >= 0) & (d <= 1)).all()), f"values outside [0, 1]: {d.min()}, {d.max()}")


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
    name = f"linear_js n={n} v={v} d={d} k={k} {dtype} bias={bias} t={temp}{tag}"
    ours = mk.linear_js_distance(hp, hq, w, backend="triton", **kw)
    plain = mk.linear_js_distance(hp, hq, w, backend="torch", **kw)
    b64 = None if b is None else b.double()
    ref = linear_js_distance_ref(hp.double(), hq.double(), w.double(), bias=b64, temperature=temp)
    check(name + " dtype", ours.dtype == torch.float32, str(ours.dtype))
    within_budget(name, ours, ref, plain, atol=2e-6)
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
    os.environ["MRTPO_JS_SCRATCH_BYTES"] = str(4 * 4 * 1000 * 40)  # C = 40 tokens at K = 3
    try:
        _linear_case(129, 1000, 64, 3, seed=1, tag=" chunks of 40")
        _linear_case(129, 1000, 3, 1, seed=2, bias=False, tag=" chunks")
    finally:
        del os.environ["MRTPO_JS_SCRATCH_BYTES"]
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
    within_budget("linear_js padded (K, B, T)", ours, ref, plain, atol=2e-6)


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
    check("linear_js identical -> 0", bool((out == 0).all()), f"max {out.abs().max()}")
    # Disjoint supports: P puts all mass on token 0, Q on token 1 -> exactly 1.
    w = torch.zeros(5, 3)
    w[0, 0] = w[1, 1] = w[2, 2] = 1.0
    b = torch.tensor([0.0, 0.0, 0.0, -1e4, -1e4])
    hp = torch.tensor([[0.0, -1e4, -1e4]])
    hq = torch.tensor([[[-1e4, 0.0, -1e4]], [[0.0, -1e4, -1e4]]])
    out = mk.linear_js_distance(hp, hq, w, bias=b, temperature=0.8, backend="triton")
    check("linear_js disjoint -> 1", out[0, 0].item() == 1.0, f"{out[0, 0].item()}")
    check("linear_js same one-hot -> 0", out[1, 0].item() == 0.0, f"{out[1, 0].item()}")
    # float64 inputs go to the torch backend and stay float64.
    hp = torch.randn(5, 8, dtype=torch.float64, generator=g)
    hq = torch.randn(2, 5, 8, dtype=torch.float64, generator=g)
    w = torch.randn(50, 8, dtype=torch.float64, generator=g)
    out = mk.linear_js_distance(hp, hq, w, temperature=1.1, backend="triton")
    ref = linear_js_distance_ref(hp, hq, w, temperature=1.1)
    check("linear_js float64 dtype", out.dtype == torch.float64, str(out.dtype))
    err = (out - ref).abs().max().item()
    check("linear_js float64", err <= 1e-10, f"max error {err:.3e}")


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
    within_budget(name, ours, ref, plain, atol=1e-6)
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
    within_budget("js_distance (V,) input", ours, ref, mk.js_distance(zp, zq), atol=1e-6)
    # -inf logits (a vocabulary mask), in one stream, in both, and in a whole block
    zp = torch.randn(5, 3000, generator=g)
    zq = torch.randn(2, 5, 3000, generator=g)
    zp[:, ::3] = float("-inf")
    zq[0, :, ::2] = float("-inf")
    zq[1, :, 1000:2500] = float("-inf")
    ours = mk.js_distance(zp, zq, backend="triton")
    ref = js_distance_ref(zp.double(), zq.double())
    within_budget("js_distance with -inf logits", ours, ref, None, atol=2e-6)
    # identical -> 0, disjoint -> 1
    zp = torch.randn(6, 777, generator=g) * 5
    out = mk.js_distance(zp, zp.expand(3, 6, 777), temperature=0.6, backend="triton")
    check("js_distance identical -> 0", bool((out == 0).all()), f"max {out.abs().max()}")
    zp = torch.full((2, 40), -1e4)
    zq = torch.full((2, 40), -1e4)
    zp[:, :20] = 0.0
    zq[:, 20:] = 0.0
    out = mk.js_distance(zp, zq, backend="triton")  # 1 up to the fp32 rounding of the sums
    check("js_distance disjoint -> 1", bool(((out - 1).abs() <= 1e-6).all()), f"{out.tolist()}")


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
        ("linear_js", (hp, hq, w, b, 0.8, "triton")),
        ("linear_js", (hp, hq, w, None, 1.0, "triton")),
        ("logits_js", (zp, zq, 1.2, "triton")),
    ]
    for name, args in cases:
        COUNT[0] += 1
        try:
            torch.library.opcheck(getattr(torch.ops.mrtpo, name).default, args)
        except Exception as exc:
            FAILED.append(f"opcheck {name}: {type(exc).__name__}: {str(exc)[:400]}")


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


def compile_check(name, fn, args):
    """torch.compile(fn, fullgraph=True, backend="aot_eager")(*args) equals fn(*args)."""
    COUNT[0] += 1
    try:
        torch._dynamo.reset()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        want = fn(*args)
        if not torch.allclose(got, want, atol=1e-6, rtol=1e-6):
            FAILED.append(f"compile {name}: compiled {got} != eager {want}")
    except Exception as exc:
        FAILED.append(f"compile {name}: {type(exc).__name__}: {str(exc)[:600]}")


GROUPS = {k[len("group_") :]: f for k, f in sorted(globals().items()) if k.startswith("group_")}


def run(groups: dict, names: list[str]) -> int:
    """Run the named groups (default all); print one line each and the failures."""
    names = names or list(groups)
    for name in names:
        if name not in groups:
            print(f"unknown group {name!r}; known: {', '.join(groups)}")
            return 2
    for name in names:
        before, t0 = len(FAILED), time.time()
        try:
            groups[name]()
        except Exception as exc:
            FAILED.append(f"group {name} raised {type(exc).__name__}: {exc}")
        ok = "ok" if len(FAILED) == before else "FAIL"
        print(f"{ok} {name} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{COUNT[0]} checks, {len(FAILED)} failures")
    for line in FAILED:
        print("FAILED", line)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(run(GROUPS, sys.argv[1:]))
