"""Triton log-prob and policy-loss kernels on CPU tensors under the Triton interpreter,
checked through the public API (backend="triton") against the float64 references.

TRITON_INTERPRET=1 must be set before triton is imported, so this runs as its own process:

    python tests/triton_cases/logprobs_cases.py [group ...]      (default: every group)

tests/test_triton_logprobs.py launches it. Exit status 0 when every check passed; 1 with
the failed checks listed otherwise. Error rule (ARCHITECTURE.md): the kernel's error
against float64 may be at most 2x that of plain PyTorch in the same dtype, plus atol.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["MRTPO_STRICT_BACKEND"] = "1"  # a fallback to "torch" would be an error
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels import _dispatch  # noqa: E402
from mrtpo_kernels.reference import (  # noqa: E402
    linear_logprobs_ref,
    linear_policy_loss_ref,
    logprobs_from_logits_ref,
)

# masked tail rows make the interpreter's numpy emit harmless inf/nan warnings
warnings.filterwarnings("ignore", category=RuntimeWarning)

FAILURES: list[str] = []
CHECKS = [0]


def close(name, ours, ref64, same=None, *, atol=1e-5, rtol=1e-5):
    """max |ours - ref64| <= 2 max |same - ref64| + atol + rtol max |ref64|, with the
    non-finite entries of ref64 matched exactly and no non-finite entries of our own."""
    CHECKS[0] += 1
    ours = ours.detach().double()
    ref64 = ref64.detach().double()
    if ours.shape != ref64.shape:
        FAILURES.append(f"{name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}")
        return
    if ours.numel() == 0:
        return
    fin = torch.isfinite(ref64)
    if not torch.equal(ours[~fin].nan_to_num(), ref64[~fin].nan_to_num()):
        FAILURES.append(f"{name}: non-finite entries differ from the reference")
        return
    if not torch.isfinite(ours[fin]).all():
        FAILURES.append(f"{name}: non-finite values where the reference is finite")
        return
    err = (ours[fin] - ref64[fin]).abs().max().item() if fin.any() else 0.0
    base = 0.0
    if same is not None and fin.any():
        base = (same.detach().double()[fin] - ref64[fin]).abs().max().item()
    scale = ref64[fin].abs().max().item() if fin.any() else 0.0
    bound = 2.0 * base + atol + rtol * scale
    if not err <= bound:
        FAILURES.append(f"{name}: max error {err:.3e} > bound {bound:.3e} (torch {base:.3e})")


def expect(name, cond, detail=""):
    CHECKS[0] += 1
    if not cond:
        FAILURES.append(f"{name}: {detail}")


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
    dev = torch.device("cpu")
    for op in ("linear_logprobs_fwd", "logits_logprobs_fwd", "linear_policy_loss"):
        got = _dispatch.resolve(op, dev, "triton")
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
    old = os.environ.get("MRTPO_CHUNK_BYTES")
    os.environ["MRTPO_CHUNK_BYTES"] = str(129 * 4 * 512)  # 512 columns per chunk
    try:
        _linear_case(129, 5003, 64, bias=True, temp=0.9, entropy=True, tag=" chunked")
    finally:
        if old is None:
            del os.environ["MRTPO_CHUNK_BYTES"]
        else:
            os.environ["MRTPO_CHUNK_BYTES"] = old


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


def _policy_case(
    n, v, d, *, bias, beta, aggregation="token-mean", temp=1.0, seed=2, dtype=torch.float32
):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).float()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(dtype).float()
    b = torch.randn(v, generator=g).to(dtype).float() if bias else None
    lab = torch.randint(0, v, (n,), generator=g)
    lab[::4] = -100
    # old log-probs near the current ones so that both clip branches occur
    with torch.no_grad():
        cur = linear_logprobs_ref(h, w, lab, bias=b, temperature=temp)
    old = (cur + 0.4 * torch.randn(n, generator=g)).to(dtype).float()
    adv = torch.randn(n, generator=g).to(dtype).float()
    ref_lp = (cur + 0.3 * torch.randn(n, generator=g)).to(dtype).float()
    lengths = [n // 3, n // 3, n - 2 * (n // 3)]
    cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1], n])
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    name = f"policy N={n} V={v} d={d} bias={bias} beta={beta} {aggregation} {dtype}"
    runs = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww = _leaf(h, dt), _leaf(w, dt)
        bb = _leaf(b, dt) if bias else None
        kw = dict(bias=bb, temperature=temp, clip_low=0.2, clip_high=0.28)
        if beta:
            kw.update(ref_logprobs=ref_lp.to(dt), beta=beta)
        if key == "ours":
            extra = {} if aggregation == "token-mean" else {"cu_seqlens": cu}
            loss, met = mk.linear_policy_loss(
                hh, ww, lab, old.to(dt), adv.to(dt), aggregation=aggregation,
                backend="triton", **kw, **extra,
            )  # fmt: skip
        else:
            loss, met = linear_policy_loss_ref(
                hh, ww, lab, old.to(dt), adv.to(dt), aggregation=aggregation,
                seq_ids=seq_ids, num_seqs=3, **kw,
            )  # fmt: skip
        loss.backward()
        runs[key] = (loss, met, hh.grad, ww.grad, bb.grad if bias else None)
    ours, same, ref = runs["ours"], runs["same"], runs["ref"]
    close(f"{name} loss", ours[0], ref[0], same[0], atol=1e-6)
    expect(f"{name} metric keys", set(ours[1]) == set(ref[1]), f"{set(ours[1])}")
    for k in ref[1]:
        close(f"{name} {k}", ours[1][k], ref[1][k], same[1][k], atol=1e-6)
    for i, what in ((2, "grad_hidden"), (3, "grad_weight"), (4, "grad_bias")):
        if ref[i] is not None:
            close(f"{name} {what}", ours[i], ref[i], same[i], atol=1e-7)
    clip = ours[1]["clip_fraction"].item()
    expect(f"{name} both branches", 0.0 < clip < 1.0, f"clip_fraction {clip}")


def group_policy():
    _policy_case(37, 1000, 64, bias=True, beta=0.0)
    _policy_case(37, 1000, 64, bias=False, beta=0.1, temp=0.8)
    _policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
    _policy_case(37, 1000, 64, bias=True, beta=0.1, dtype=torch.bfloat16)


def group_policy_keep_logits():
    """Variant (a): kept fp32 logits in token chunks (several chunks: a small budget)."""
    saved = {k: os.environ.get(k) for k in ("MRTPO_POLICY_KEEP_LOGITS", "MRTPO_CHUNK_BYTES")}
    os.environ["MRTPO_POLICY_KEEP_LOGITS"] = "1"
    try:
        os.environ["MRTPO_CHUNK_BYTES"] = str(4 * 1000 * 32)  # 32 rows per chunk
        _policy_case(37, 1000, 64, bias=True, beta=0.1)
        _policy_case(37, 1000, 64, bias=False, beta=0.0, dtype=torch.bfloat16)
        os.environ["MRTPO_CHUNK_BYTES"] = str(4 * 5003 * 64)  # 64 rows per chunk
        _policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
    # no gradient wanted: loss and metrics only
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(7, 16, generator=g), torch.randn(300, 16, generator=g)
    lab = torch.randint(0, 300, (7,), generator=g)
    old, adv = torch.randn(7, generator=g) - 5, torch.randn(7, generator=g)
    with torch.no_grad():
        loss, met = mk.linear_policy_loss(h, w, lab, old, adv, backend="triton")
    rl, rm = linear_policy_loss_ref(h.double(), w.double(), lab, old.double(), adv.double())
    close("policy no-grad loss", loss, rl, atol=1e-6)
    close("policy no-grad mean_ratio", met["mean_ratio"], rm["mean_ratio"], atol=1e-6)
    # every token ignored: zero loss and zero gradients
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, met = mk.linear_policy_loss(hh, ww, torch.full((7,), -100), old, adv, backend="triton")
    loss.backward()
    expect("policy all ignored", loss.item() == 0.0 and bool((hh.grad == 0).all()), "nonzero")
    expect("policy all ignored dw", bool((ww.grad == 0).all()), "nonzero")


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
        ("logits_logprobs_fwd", (z, lab, 0.7, -100, True, "triton")),
    ]
    old, adv = torch.randn(5, generator=g) - 4, torch.randn(5, generator=g)
    tw, ref = torch.full((5,), 0.25), torch.randn(5, generator=g) - 4
    # need_grad=True only: with need_grad=False the op returns empty gradients, which its
    # autograd formula (in _ops.py) cannot scale for inputs that require grad
    args = (h, w, b, lab, old, adv, tw, ref, 0.9, 0.2, 0.28, 0.1, -100, True, "triton")
    cases.append(("linear_policy_loss", args))
    for name, args in cases:
        op = getattr(torch.ops.mrtpo, name.split()[0]).default
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:  # report which opcheck test failed
            FAILURES.append(f"opcheck {name}: {type(exc).__name__}: {str(exc)[:400]}")
        CHECKS[0] += 1


GROUPS = {
    name[len("group_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("group_")
}


def main(argv):
    names = argv or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        print(f"unknown groups {unknown}; known: {list(GROUPS)}")
        return 2
    for name in names:
        t0 = time.time()
        before = len(FAILURES)
        try:
            GROUPS[name]()
        except Exception as exc:
            FAILURES.append(f"group {name} raised {type(exc).__name__}: {exc}")
        status = "ok" if len(FAILURES) == before else "FAIL"
        print(f"{status} {name} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{CHECKS[0]} checks, {len(FAILURES)} failures")
    for f in FAILURES:
        print("FAILED", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
