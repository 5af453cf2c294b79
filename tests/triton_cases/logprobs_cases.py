"""Triton log-prob kernels on CPU tensors under the Triton interpreter,
checked through the public API (backend="triton") against the float64 references.

TRITON_INTERPRET=1 must be set before triton is imported, so this runs as its own process:

    python tests/triton_cases/logprobs_cases.py [group ...]      (default: every group)

tests/test_triton_logprobs.py launches it. Exit status 0 when every check passed; 1 with
the failed checks listed otherwise. Error rule (README.md, "Numerics"; _harness.close): the
kernel's error against float64 may be at most 2x that of plain PyTorch in the same dtype,
plus atol, and a NaN of the reference must be a NaN.
"""

from __future__ import annotations

import sys

import _harness
from _harness import close, expect, opcheck

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import (  # noqa: E402
    linear_logprobs_ref,
    logprobs_from_logits_ref,
)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def _linear_case(
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
                _linear_case(n, v, d, bias=(n + v) % 2 == 0, temp=0.7, entropy=True)


def group_linear_flags():
    _linear_case(33, 1000, 64, bias=False, temp=1.0, entropy=False)
    _linear_case(33, 1000, 64, bias=True, temp=2.5, entropy=False, ignore_every=0)
    _linear_case(20, 700, 17, bias=True, temp=0.3, entropy=True, ignore_every=2)
    _linear_case(33, 1000, 64, bias=True, temp=0.9, entropy=True, dtype=torch.bfloat16)
    _linear_case(7, 300, 16, bias=False, temp=1.0, entropy=True, dtype=torch.float16)


def group_linear_chunks():
    """Backward over several vocabulary chunks (a tiny MRTPO_CHUNK_BYTES)."""
    # 512 columns per vocabulary chunk (fused variant), 13 rows per token chunk (rows)
    with _harness.env(MRTPO_CHUNK_BYTES=129 * 4 * 512):
        _linear_case(129, 5003, 64, bias=True, temp=0.9, entropy=True, tag=" chunked")


def group_linear_extreme():
    """Logits around +-1e4 (weights scaled by 1e4): finite, within the error budget."""
    _linear_case(7, 1000, 64, bias=False, temp=1.0, entropy=True, scale=1e4, tag=" extreme")
    _linear_case(7, 5003, 3, bias=True, temp=0.5, entropy=True, scale=1e4, tag=" extreme")


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


def _logits_case(n, v, dtype, *, temp, neg_inf=False, seed=1):
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
            _logits_case(n, v, torch.float32, temp=1.3)
    _logits_case(7, 1000, torch.bfloat16, temp=0.8)
    _logits_case(7, 1000, torch.float16, temp=1.0)
    _logits_case(7, 1000, torch.float32, temp=1.0, neg_inf=True)
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


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
