"""The Triton row kernels (mrtpo_kernels/triton_kernels/rows.py) and the chunk driver
(backends/_chunked.py) on CPU tensors under the Triton interpreter, against the float64
references of mrtpo_kernels/reference.py.

TRITON_INTERPRET=1 must be set before triton is imported, so this runs as its own process
(tests/test_chunk_driver.py launches it):

    python tests/triton_cases/rows_cases.py [group ...]      (default: every group)

Exit status 0 when every check passed; 1 with the failed checks listed (_harness.run).
"""

from __future__ import annotations

import functools
import math
import os
import sys

import _harness
from _harness import CHECKS, FAILURES, expect

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mrtpo_kernels import PolicyLossSettings as _cfg  # noqa: E402
from mrtpo_kernels import reference as ref  # noqa: E402
from mrtpo_kernels.backends import _chunked, _lm_head, cpu_backend, torch_backend  # noqa: E402
from mrtpo_kernels.triton_kernels import row_math, rows  # noqa: E402

II = -100
# the row kernels against float64: atol + rtol max |want| (no plain-PyTorch term)
close = functools.partial(_harness.close, atol=2e-5, rtol=2e-5)


def _logits(c, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(c, v, generator=g) * scale
    labels = torch.randint(0, v, (c,), generator=g)
    labels[::4] = II
    return z, labels


def _extreme(z):
    """Rows with a huge finite logit, masked (-inf) entries, a NaN, an all -inf row."""
    z = z.clone()
    z[1, 3] = 3.0e38
    z[1, 7] = -3.0e38
    z[2, : z.shape[1] // 2] = float("-inf")
    if z.shape[0] > 6:
        z[5, 1] = float("nan")
        z[6] = float("-inf")
    return z


# --------------------------------------------------------------------------- row kernels


def check_stats_and_grad(c, v, temp, seed, extreme):
    z, lab = _logits(c, v, seed)
    if extreme:
        z = _extreme(z)
    # a label on a finite column of the half-masked row
    lab[2] = v - 1
    tag = f"C={c} V={v} T={temp} extreme={extreme}"
    k = rows.TritonRowKernel
    logp, ent, lse = k.stats(z, lab, 1.0 / temp, II, True)
    z64 = z.double().requires_grad_()
    rl, re = ref.logprobs_from_logits_ref(
        z64, lab, temperature=temp, ignore_index=II, return_entropy=True
    )
    close(f"stats logp {tag}", logp, rl)
    close(f"stats entropy {tag}", ent, re)
    ok = torch.isfinite(rl) | (lab == II)
    g = torch.randn(c, generator=torch.Generator().manual_seed(seed + 1))
    ge = torch.randn(c, generator=torch.Generator().manual_seed(seed + 2))
    gz = z.clone()
    k.grad_(gz, lab, lse, ent, g, ge, 1.0 / temp, II)
    # float64 gradient of the defined rows (the reference's autograd through NaN rows is
    # NaN everywhere, also on ignored ones, so those rows are compared to the contract)
    mask = ok & torch.isfinite(re)
    # the float64 gradient with -inf entries as -1e4 (p = 0 either way; autograd through
    # -inf gives NaN)
    zg = torch.where(z64.detach() == float("-inf"), -1.0e4, z64.detach()).requires_grad_()
    gl, ge64 = ref.logprobs_from_logits_ref(
        zg, lab, temperature=temp, ignore_index=II, return_entropy=True
    )
    (want,) = torch.autograd.grad(
        (torch.where(mask, gl, 0) * g.double()).sum()
        + (torch.where(mask, ge64, 0) * ge.double()).sum(),
        zg,
    )
    close(f"grad defined rows {tag}", gz[mask], want[mask])
    bad = ~mask
    if bad.any():
        want_bad = torch.where((lab[bad] == II)[:, None], 0.0, float("nan")).expand(-1, v)
        close(f"grad undefined rows {tag}", gz[bad], want_bad)
    # the same gradient written into a separate bf16 buffer; the logits stay as they were
    zz = z.clone()
    out = torch.empty(c, v, dtype=torch.bfloat16)
    k.grad_(zz, lab, lse, ent, g, ge, 1.0 / temp, II, out=out)
    close(f"grad into a bf16 buffer {tag}", out[mask], want[mask], atol=1e-6, rtol=1e-2)
    _harness.expect(f"grad out= leaves z {tag}", torch.equal(zz.nan_to_num(), z.nan_to_num()))
    # a 16-bit view of z's own storage (a race on a GPU) is refused, naming the argument
    try:
        k.grad_(zz, lab, lse, ent, g, ge, 1.0 / temp, II, out=zz.view(torch.bfloat16)[:, :v])
        _harness.expect(f"grad out= over z refused {tag}", False, "no error")
    except ValueError as exc:
        _harness.expect(f"grad out= over z refused {tag}", str(exc).startswith("out:"), str(exc))


def check_all_ignored():
    z, _ = _logits(5, 300, 9)
    lab = torch.full((5,), II)
    logp, ent, lse = rows.TritonRowKernel.stats(z, lab, 1.0, II, True)
    close("all ignored logp", logp, torch.zeros(5))
    close("all ignored entropy", ent, torch.zeros(5))
    close("all ignored lse", lse, torch.logsumexp(z.double(), -1))
    gz = z.clone()
    rows.TritonRowKernel.grad_(gz, lab, lse, ent, torch.ones(5), torch.ones(5), 1.0, II)
    close("all ignored grad", gz, torch.zeros(5, 300))
    loss, lp, cl = rows.TritonRowKernel.policy_(
        z.clone(), lab, lse, torch.ones(5), torch.ones(5), None, _cfg(ignore_index=II), True
    )
    close("all ignored policy loss", loss, torch.zeros(5))
    close("all ignored policy clipped", cl, torch.zeros(5))


def check_policy(c, v, temp, seed, beta, clip_c, kl_iw, extreme):
    z, lab = _logits(c, v, seed, scale=2.0)
    if extreme:
        z = _extreme(z)
    gen = torch.Generator().manual_seed(seed + 5)
    z64 = z.double().requires_grad_()
    rl = ref.logprobs_from_logits_ref(z64, lab, temperature=temp, ignore_index=II)
    old = (rl.detach() + 0.4 * torch.randn(c, generator=gen, dtype=torch.float64)).float()
    old = torch.where(torch.isfinite(old), old, torch.zeros_like(old))
    adv = torch.randn(c, generator=gen)
    refl = (rl.detach() + 0.3 * torch.randn(c, generator=gen, dtype=torch.float64)).float()
    refl = torch.where(torch.isfinite(refl), refl, torch.zeros_like(refl))
    valid = lab != II
    defined = valid & torch.isfinite(rl)
    tw = valid.float() / valid.sum()
    tag = f"C={c} V={v} T={temp} beta={beta} clip_c={clip_c} kl_iw={kl_iw} extreme={extreme}"
    gz = z.clone()
    cfg = _cfg(temperature=temp, clip_low=0.2, clip_high=0.28, beta=beta, ignore_index=II,
               clip_ratio_c=clip_c, kl_importance_weight=kl_iw)  # fmt: skip
    loss, logp, clipped = rows.TritonRowKernel.policy_(gz, lab, old, adv, tw, refl, cfg, True)
    close(f"policy logp {tag}", logp, rl)
    # float64 reference on the defined rows: token-mean loss and its gradient by autograd
    keep = defined
    ref_loss, _ = ref.policy_loss_ref(
        torch.where(keep, rl, 0.0),
        old.double(),
        adv.double(),
        keep,
        clip_low=0.2,
        clip_high=0.28,
        ref_logprobs=refl.double(),
        beta=beta,
        clip_ratio_c=None if math.isinf(clip_c) else clip_c,
        kl_importance_weight=kl_iw,
    )
    scale = keep.sum() / valid.sum()  # the reference averages over its own mask
    (want,) = torch.autograd.grad(ref_loss * scale, z64)
    close(f"policy loss sum {tag}", (loss * tw)[keep].sum(), ref_loss.detach() * scale)
    close(f"policy grad {tag}", gz[keep], want[keep])
    if (valid & ~defined).any():
        close(
            f"policy undefined rows {tag}",
            loss[valid & ~defined],
            torch.full((int((valid & ~defined).sum()),), float("nan")),
        )
    # the low-memory pieces: token terms from the log-probs, column-chunked gradient
    per_tok, cl2, g = rows.policy_terms(logp, lab, old, adv, tw, refl, v, cfg)
    close(f"policy_terms loss {tag}", per_tok, loss)
    close(f"policy_terms clipped {tag}", cl2, clipped)
    _, _, lse = rows.TritonRowKernel.stats(z, lab, 1.0 / temp, II, False)
    gc = torch.empty_like(z)
    for v0 in range(0, v, 700):
        part = z[:, v0 : v0 + 700].contiguous()
        rows.grad_cols_(part, lab, lse, None, g, None, 1.0 / temp, II, v0, v)
        gc[:, v0 : v0 + 700] = part
    close(f"grad_cols_ {tag}", gc[keep], want[keep])


def check_js(k, c, v, temp, seed, extreme):
    gen = torch.Generator().manual_seed(seed)
    zp = torch.randn(c, v, generator=gen) * 2
    zs = torch.stack([zp] + [zp + 0.5 * torch.randn(c, v, generator=gen) for _ in range(k)])
    zs[min(k, 1), 0] = torch.randn(v, generator=gen) * 4  # a far row
    if extreme:
        zs[0] = _extreme(zs[0])
        zs[k, 3] = zs[0, 3]  # identical rows: exactly 0
    d = rows.TritonRowKernel.js_many(zs, 1.0 / temp)
    want = ref.js_distance_ref(zs[0].double(), zs[1:].double(), temperature=temp)
    close(f"js_many K={k} C={c} V={v} T={temp} extreme={extreme}", d, want, atol=3e-5)
    d1, _ = rows.TritonRowKernel.js(zs[0], zs[1], 1.0 / temp, None)
    close(f"js K=1 form C={c} V={v}", d1, want[0], atol=3e-5)


@triton.jit
def _offset_probe(out_ptr, rows_ptr, stride):
    i = tl.program_id(0)
    tl.store(out_ptr + i, row_math._row_offset(tl.load(rows_ptr + i), stride))


def check_offsets():
    """Row offsets are int64: C x V past 2^31 (no allocation, only the arithmetic)."""
    r = torch.tensor([0, 14134, 70000, 2**31 // 151936 + 1], dtype=torch.int32)
    out = torch.empty(4, dtype=torch.int64)
    _offset_probe[(4,)](out, r, 151936)
    close("int64 row offsets", out.double(), r.double() * 151936, atol=0, rtol=0)
    CHECKS[0] += 1
    if not (out[2] > 2**31):
        FAILURES.append("int64 row offsets: the probe did not pass 2^31")


# --------------------------------------------------------------------------- the driver


KERNELS = {"torch": torch_backend._K, "triton": rows.TritonRowKernel()}
if cpu_backend.available():
    KERNELS["cpu"] = cpu_backend._K


def _emulate_f32_out():
    """On CPU torch has no out_dtype GEMMs: emulate them so the driver's 16-bit path
    (16-bit gradient views, no fp32 weight copy) runs here as it will on CUDA."""
    _lm_head._F32_OUT.clear()
    _lm_head.f32_out_supported = lambda device, dtype: True
    _lm_head.mm_f32 = lambda a, b, out: torch.mm(a.float(), b.float(), out=out)
    _lm_head.addmm_f32 = lambda c, a, b: c.addmm_(a.float(), b.float())


def check_driver(name, kern, n, v, d, dtype, chunk_rows_, low_memory, bias):
    os.environ["MRTPO_CHUNK_BYTES"] = str(4 * v * chunk_rows_)
    # 16-bit path: gradient buffers of 2 chunks + 1 row (dh, dW once per buffer)
    os.environ["MRTPO_GRAD_BUFFER_BYTES"] = str(2 * v * (2 * chunk_rows_ + 1))
    os.environ["MRTPO_KEEP_LOGITS_BYTES"] = str(4 * v * 3)  # 3 kept rows, the rest recomputed
    os.environ["MRTPO_JS_SCRATCH_BYTES"] = str(4 * v * chunk_rows_ * 3)
    os.environ["MRTPO_LOW_MEMORY"] = "1" if low_memory else "0"
    gen = torch.Generator().manual_seed(n + v)
    h = torch.randn(n, d, generator=gen).to(dtype)
    w = (torch.randn(v, d, generator=gen) * d**-0.5).to(dtype)
    b = (torch.randn(v, generator=gen) * 0.1).to(dtype) if bias else None
    lab = torch.randint(0, v, (n,), generator=gen)
    lab[::5] = II
    tag = f"{name} {dtype} n={n} V={v} chunk={chunk_rows_} low_memory={low_memory} bias={bias}"
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    rl, re = ref.linear_logprobs_ref(
        h64, w64, lab, bias=b64, temperature=0.9, ignore_index=II, return_entropy=True
    )
    logp, ent, lse, saved = _chunked.linear_logprobs_fwd(kern, h, w, b, lab, 0.9, II, True)
    saved_before = saved.clone()
    close(f"driver logp {tag}", logp, rl, **tol)
    close(f"driver entropy {tag}", ent, re, **tol)
    g = torch.randn(n, generator=gen)
    ge = torch.randn(n, generator=gen)
    dh, dw, db = _chunked.linear_logprobs_bwd(kern, h, w, b, lab, lse, ent, g, ge, 0.9, II, saved)
    expect(f"driver saved state read only {tag}", torch.equal(saved, saved_before))
    wants = torch.autograd.grad(
        (rl * g.double()).sum() + (re * ge.double()).sum(),
        [t for t in (h64, w64, b64) if t is not None],
    )
    close(f"driver dh {tag}", dh, wants[0], **tol)
    close(f"driver dw {tag}", dw, wants[1], **tol)
    if bias:
        close(f"driver db {tag}", db, wants[2], **tol)
    hq = h.double()[None] + 0.3 * torch.randn(3, n, d, generator=gen, dtype=torch.float64)
    hq = hq.to(dtype)
    d_js = _chunked.linear_js_distance(kern, h, hq, w, b, 0.9)
    want_js = ref.linear_js_distance_ref(
        h.double(), hq.double(), w.double(), bias=None if b is None else b.double(), temperature=0.9
    )
    close(f"driver js {tag}", d_js, want_js, atol=tol["atol"] * 5, rtol=0)
    old = torch.full((n,), -6.0)
    adv = torch.randn(n, generator=gen)
    tw = (lab != II).float() / (lab != II).sum()
    loss, _, _, dh2, dw2, db2 = _chunked.linear_policy_loss(
        kern, h, w, b, lab, old, adv, tw, tw[:0], _cfg(temperature=0.9, ignore_index=II), True
    )
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    rloss, _ = ref.linear_policy_loss_ref(
        h64, w64, lab, old.double(), adv.double(), bias=b64, temperature=0.9, ignore_index=II
    )
    wants = torch.autograd.grad(rloss, [t for t in (h64, w64, b64) if t is not None])
    close(f"driver policy loss {tag}", loss, rloss, **tol)
    close(f"driver policy dh {tag}", dh2, wants[0], **tol)
    close(f"driver policy dw {tag}", dw2, wants[1], **tol)
    if bias:
        close(f"driver policy db {tag}", db2, wants[2], **tol)


def check_low_memory_extreme():
    """The driver's low-memory mode (vocabulary-chunked backward, 3 chunks) with the Triton
    row kernels at |z / T| ~ 1e4, T = 1e-4 and one dominant logit (clip_extreme_cases'
    exact inputs), through the public ops: log-probs, entropy and both gradients, the
    policy loss, its metrics and gradients, against float64 within 2x plain fp32 PyTorch
    (+ 1e-6 + 1e-5 max |ref|). The column kernel gets each row's (raw max, log s) from the
    forward (filed under lse for the log-probs, passed on by the policy loss); from the
    rounded fp32 lse alone its log p would be ulp(lse) / 2 off."""
    from clip_extreme_cases import _extreme_head, _ref_logprobs, close_policy, policy_refs

    import mrtpo_kernels as mk

    for kind in ("big", "tiny_t", "dominant"):
        h, w, lab, temp = _extreme_head(kind, n=24)
        n = h.shape[0]
        gen = torch.Generator().manual_seed(7)
        g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        want = _ref_logprobs(h, w, lab, temp, g, ge, torch.float64)
        same = _ref_logprobs(h, w, lab, temp, g, ge, torch.float32)
        env = dict(MRTPO_LOW_MEMORY=1)
        with _harness.env(MRTPO_CHUNK_BYTES=4 * n * 256, **env):  # 256 columns a chunk
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, en = mk.linear_logprobs(
                hh, ww, lab, temperature=temp, return_entropy=True, backend="triton"
            )
            ((lp * g).sum() + (en * ge).sum()).backward()
        tag = f"low-memory driver {kind}"
        for i, (what, got) in enumerate(
            (("logp", lp), ("entropy", en), ("grad hidden", hh.grad), ("grad weight", ww.grad))
        ):
            _harness.close(f"{tag} {what}", got, want[i], same[i], atol=1e-6, rtol=1e-5)
        old, adv, runs = policy_refs(h, w, lab, temp, seed=8)
        with _harness.env(MRTPO_CHUNK_BYTES=4 * n * 256, **env):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss, met = mk.linear_policy_loss(
                hh, ww, lab, old, adv, temperature=temp, backend="triton"
            )
            loss.backward()
        close_policy(f"{tag} policy", (loss, met, hh.grad, ww.grad), runs, atol=1e-6, rtol=1e-5)


def group_row_kernels():
    for c, v, temp, extreme in (
        (7, 300, 1.0, True),
        (9, 1500, 0.7, False),
        (9, 1500, 1.3, True),
        (3, 2049, 1.0, False),
    ):
        check_stats_and_grad(c, v, temp, seed=c, extreme=extreme)
    check_all_ignored()
    for beta, clip_c, kl_iw in ((0.0, math.inf, False), (0.1, 3.0, False), (0.05, math.inf, True)):
        check_policy(9, 1500, 0.8, 3, beta, clip_c, kl_iw, extreme=False)
    check_policy(8, 700, 1.0, 4, 0.1, 3.0, True, extreme=True)
    for k in (1, 3, 5):
        check_js(k, 8, 1100, 0.9, seed=k, extreme=(k == 3))
    check_offsets()


def check_split_stats(c, v, temp, seed, extreme, splits):
    """TritonRowKernel.stats_split (split-row statistics, issue 35 item 4) against float64:
    log-probs, entropy and lse of every row (NaN rows, -inf columns, a 3e38 logit, ignored
    and out-of-range labels), the (M, log s) norm it writes into a column slice of a (2, N)
    buffer, and agreement with the one-program-per-row kernel; ``splits`` from 1 (one
    split) to more splits than column steps (clamped)."""
    z, lab = _logits(c, v, seed)
    if extreme:
        z = _extreme(z)
    lab[2] = v - 1
    lab[-1] = v + 3  # out of range (value checks off): NaN log-prob
    tag = f"split C={c} V={v} T={temp} extreme={extreme} splits={splits}"
    k = rows.TritonRowKernel
    norm_buf = torch.full((2, c + 3), 7.0)
    norm = norm_buf[:, 2 : 2 + c]
    logp, ent, lse = k.stats_split(z, lab, 1.0 / temp, II, True, norm=norm, splits=splits)
    z64 = z.double()
    rl, re = ref.logprobs_from_logits_ref(
        z64, lab, temperature=temp, ignore_index=II, return_entropy=True
    )
    close(f"{tag} logp", logp, rl)
    close(f"{tag} entropy", ent, re)
    want_lse = torch.logsumexp(z64 / temp, -1)
    bad_row = torch.isnan(z64).any(-1) | (z64 == float("inf")).any(-1)
    want_lse = torch.where(bad_row, float("nan"), want_lse)
    want_lse = torch.where(torch.isinf(want_lse) & (want_lse < 0), float("nan"), want_lse)
    close(f"{tag} lse", lse, want_lse)
    p_logp, p_ent, p_lse = k.stats(z, lab, 1.0 / temp, II, True)
    close(f"{tag} = per-row logp", logp, p_logp.double(), atol=1e-5, rtol=1e-6)
    close(f"{tag} = per-row entropy", ent, p_ent.double(), atol=1e-5, rtol=1e-6)
    # the norm: raw max M and log s, log p = (z/2 - M/2)(2/tau) - log s at the label
    mx = torch.where(torch.isnan(z64), float("-inf"), z64).amax(-1)  # the finite part's
    good = ~bad_row & torch.isfinite(mx)
    empty = mx == float("-inf")
    _harness.expect(f"{tag} norm M of an all -inf row", bool((norm[0][empty] == mx[empty]).all()))
    close(f"{tag} norm M (defined rows)", norm[0][good], mx[good], atol=0, rtol=0)
    want_ls = want_lse - mx / temp
    close(f"{tag} norm log s (defined rows)", norm[1][good], want_ls[good])
    _harness.expect(f"{tag} norm written only in its slice",
                    bool((norm_buf[:, :2] == 7.0).all() and (norm_buf[:, 2 + c :] == 7.0).all()),
                    "")  # fmt: skip
    lp2, none, lse2 = k.stats_split(z, lab, 1.0 / temp, II, False, splits=splits)
    _harness.expect(f"{tag} no entropy asked", none is None, "")
    close(f"{tag} logp without entropy", lp2, rl)


def group_split_stats():
    for c, v, temp, extreme, splits in (
        (7, 300, 1.0, True, 3),
        (9, 1500, 0.7, False, 2),
        (9, 1500, 1.3, True, 40),  # more than its column steps: clamped
        (3, 2049, 1.0, False, 1),
        (5, 5003, 0.5, False, None),  # the default split count
    ):
        check_split_stats(c, v, temp, seed=c + 10, extreme=extreme, splits=splits)
    empty = rows.TritonRowKernel.stats_split(torch.empty(0, 50), torch.empty(0, dtype=torch.long),
                                             1.0, II, True)  # fmt: skip
    _harness.expect("split stats of no rows", all(t.numel() == 0 for t in empty), "")


def group_driver():
    for name, kern in KERNELS.items():
        for low in (False, True) if name == "triton" else (False,):
            check_driver(name, kern, 23, 1100, 16, torch.float32, 6, low, bias=True)
            check_driver(name, kern, 13, 700, 16, torch.bfloat16, 4, low, bias=False)
    saved = (_lm_head.f32_out_supported, _lm_head.mm_f32, _lm_head.addmm_f32)
    _emulate_f32_out()
    try:
        for low in (False, True):
            check_driver(
                "triton 16-bit GEMMs", KERNELS["triton"], 17, 900, 16, torch.bfloat16, 5, low,
                bias=True,
            )  # fmt: skip
    finally:
        _lm_head.f32_out_supported, _lm_head.mm_f32, _lm_head.addmm_f32 = saved
    check_low_memory_extreme()


GROUPS = {k[len("group_") :]: f for k, f in globals().items() if k.startswith("group_")}


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
