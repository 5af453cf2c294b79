"""The clip rule and the extreme-logit numerics of the Triton kernels, against the
float64 reference under the Triton interpreter (tests/test_triton_clip_extreme.py runs it):

    python tests/triton_cases/clip_extreme_cases.py [clip|extreme ...]   (default: both)

clip: the clipped flag (clip_fraction) is the reference's ratio A > clamp(ratio) A, strictly:
    a tie is not clipped and passes the whole gradient, a NaN is not clipped and gives a NaN
    loss and gradient (reference.policy_loss_ref and its autograd), in every Triton kernel:
    the row kernel and the low-memory token terms (triton_kernels/rows.py, row_cols.py),
    through the public op on both Triton paths (the chunk driver, and its low-memory mode).
extreme: at large |z / tau| (~1e4, one logit dominating, a tiny temperature, |z / tau| past
    float max) the public ops through the chunk driver over several chunks (log-probs,
    policy loss: the row kernels, and the low-memory mode's column kernel) and the column
    kernel alone (rows.grad_cols_ with the (raw max, log s) of rows.stats) keep the row
    kernels' accuracy: log p is formed as
    (z/2 - M/2)(2/tau) - log s, never z / tau - lse from the rounded fp32 lse. Inputs are
    exact in fp32 (powers of two times small integers), so the error budget (2x plain
    PyTorch fp32 against float64, plus atol and rtol x the largest reference value) is tight.
"""

from __future__ import annotations

import functools
import math
import sys

import _harness
from _harness import expect

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import (  # noqa: E402
    linear_logprobs_ref,
    linear_policy_loss_ref,
    logprobs_from_logits_ref,
)
from mrtpo_kernels.triton_kernels import rows  # noqa: E402

II = -100
# exact inputs (powers of two times small integers): a tight default budget
close = functools.partial(_harness.close, atol=1e-6, rtol=1e-6)
MODES = {  # the Triton paths of the public ops: the chunk driver, and its low-memory mode
    "rows": dict(MRTPO_LOW_MEMORY="0"),
    "rows low-memory": dict(MRTPO_LOW_MEMORY="1"),
}


# --------------------------------------------------------------------------- clip


def _token_inputs():
    """Per-token (logp, old, adv, labels) in fp32, exact in float64 too: exact ties
    (logp == old: ratio 1 at the lower bound with clip_low = 0; A = 0), NaN old, NaN A,
    NaN logp, A = 0 with ratio inf and A = inf with ratio 0 (0 * inf), plain clipped and
    unclipped tokens (ratio far from the bounds), an ignored token with NaN inputs. (Not
    here: ratio inf with A != 0, where the reference's autograd forms 0 * inf = NaN through
    exp's backward even for a clipped token, an artifact, not a rule.)"""

    nan, inf = float("nan"), float("inf")
    rows = [  # logp, old, adv
        (-1.0, -1.0, 1.0),  # ratio 1 = 1 - clip_low: tie, not clipped, whole gradient
        (-1.0, -1.0, -1.0),  # the same tie with A < 0
        (-0.5, -0.5, 0.0),  # A = 0: tie
        (-1.0, -3.0, 0.0),  # A = 0, ratio e^2 outside the range: tie
        (-1.0, -3.0, 1.0),  # ratio e^2 > 1 + clip_high, A > 0: clipped
        (-3.0, -1.0, -1.0),  # ratio e^-2 < 1 - clip_low = 1, A < 0: clipped
        (-3.0, -1.0, 1.0),  # ratio e^-2, A > 0: not clipped
        (-1.0, nan, 1.0),  # NaN old: not clipped, NaN loss and gradient
        (-1.0, -1.5, nan),  # NaN A
        (nan, -1.0, 1.0),  # NaN logp (an undefined row)
        (-1.0, -inf, 0.0),  # ratio inf, A = 0: a = 0 * inf = NaN
        (-1.0, inf, inf),  # ratio 0, A = inf: a = 0 * inf = NaN
        (nan, nan, nan),  # ignored: 0, not clipped, no gradient
    ]
    t = torch.tensor(rows, dtype=torch.float32)
    labels = torch.zeros(len(rows), dtype=torch.long)
    labels[-1] = II
    return t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].contiguous(), labels


def check_clip_token_kernels():
    """The low-memory token terms (rows.policy_terms) on every token kind, with and without
    the dual clip / KL (the row kernel's: check_clip_public_op)."""

    logp, old, adv, labels = _token_inputs()
    n = logp.shape[0]
    ref_lp = torch.full((n,), -1.25)
    for cl, ch, clip_c, beta in ((0.0, 0.2, math.inf, 0.0), (0.0, 0.2, 3.0, 0.1)):
        want_l, want_c, want_g = _harness.policy_token_reference(
            logp, old, adv, labels, cl, ch, None if math.isinf(clip_c) else clip_c, beta, ref_lp
        )
        tag = f"clip_low={cl} clip_high={ch} clip_c={clip_c} beta={beta}"
        tw = torch.ones(n)
        cfg = mk.PolicyLossSettings(
            clip_low=cl, clip_high=ch, beta=beta, ignore_index=II, clip_ratio_c=clip_c
        )
        loss, clipped, g = rows.policy_terms(
            logp, labels, old, adv, tw, ref_lp if beta else None, 5, cfg
        )
        close(f"rows.policy_terms loss {tag}", loss, want_l)
        close(f"rows.policy_terms dloss/dlogp {tag}", g, want_g)
        expect(f"rows.policy_terms clipped {tag}", torch.equal(clipped.double(), want_c),
               f"{clipped.tolist()} != {want_c.tolist()}")  # fmt: skip


def _clip_head(nan_cases: bool):
    """(hidden, weight, labels, old, adv) of 8 tokens, d = 2, V = 40, logits exact in fp32.
    Tokens 0-3 have a label logit 300 above the others, so log p = 0 exactly in fp32 and in
    float64 and old = 0 makes ratio = 1 exactly: a tie at 1 - clip_low with clip_low = 0.
    nan_cases: token 1 gets a NaN old log-prob, token 2 a NaN advantage, token 4 a NaN
    hidden row (every logit NaN); token 5 is ignored."""

    g = torch.Generator().manual_seed(11)
    v = 40
    w = torch.zeros(v, 2)
    w[:, 1] = torch.randint(-1024, 1024, (v,), generator=g).float() / 256.0
    w[3, 1] = 300.0
    w[:, 0] = torch.randint(-512, 512, (v,), generator=g).float() / 256.0
    h = torch.ones(8, 2)
    h[4:, 0] = torch.tensor([0.5, 2.0, -1.0, 1.0])
    lab = torch.tensor([3, 3, 3, 3, 7, II, 11, 20])
    with torch.no_grad():
        cur = linear_logprobs_ref(h.double(), w.double(), lab).float()
    old = cur.clone()
    old[6] += 0.75  # ratio e^-0.75 < 1: clipped for A < 0 at lo = 1
    old[7] -= 0.75  # ratio e^0.75 > 1.2: clipped for A > 0
    adv = torch.tensor([1.0, -1.0, 0.0, 2.0, 1.0, 1.0, -1.0, 1.0])
    if nan_cases:
        old[1] = float("nan")
        adv[2] = float("nan")
        h[4, 1] = float("nan")
    old[5] = float("nan")  # ignored: never read
    return h, w, lab, old, adv


def check_clip_public_op():
    """clip_fraction, loss and gradients of mk.linear_policy_loss on both Triton paths
    against linear_policy_loss_ref: exact ties (finite inputs: every value compared), then
    NaN inputs with the value checks off (the reference's clip_fraction, NaN loss, and its
    gradient's NaN pattern: the token's row of d hidden, all of d weight)."""

    for nan_cases in (False, True):
        h, w, lab, old, adv = _clip_head(nan_cases)
        kw = dict(clip_low=0.0, clip_high=0.2)
        h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
        rl, rm = linear_policy_loss_ref(h64, w64, lab, old.double(), adv.double(), **kw)
        rl.backward()
        for name, env in MODES.items():
            tag = f"{name} nan_cases={nan_cases}"
            with _harness.env(
                MRTPO_SKIP_VALUE_CHECKS="1", MRTPO_CHUNK_BYTES=str(4 * 40 * 3), **env
            ):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                loss, met = mk.linear_policy_loss(hh, ww, lab, old, adv, backend="triton", **kw)
                loss.backward()
            close(f"clip_fraction {tag}", met["clip_fraction"], rm["clip_fraction"], atol=0)
            close(f"loss {tag}", loss, rl)
            close(f"mean_ratio {tag}", met["mean_ratio"], rm["mean_ratio"])
            close(f"grad hidden {tag}", hh.grad, h64.grad, atol=1e-5, rtol=1e-6)
            close(f"grad weight {tag}", ww.grad, w64.grad, atol=1e-5, rtol=1e-6)
            if not nan_cases:
                frac = rm["clip_fraction"].item()
                expect(f"both branches {tag}", 0.0 < frac < 1.0, f"clip_fraction {frac}")


# --------------------------------------------------------------------------- extreme


def _extreme_head(kind: str, n: int = 12, v: int = 700, seed: int = 0):
    """(hidden, weight, labels, temperature) with logits exact in fp32: hidden = [1, s]
    with s a power of two, weight = [offset, small multiples of 2^-8], so every logit is
    offset + s x small. big: offset 1e4, T = 1 (|z / T| ~ 1e4); tiny_t: offset 1, T = 1e-4;
    dominant: offset -12000 and one column 40 above the rest, T = 0.5. Every 4th token is
    ignored; columns 0-19 sit 3e4 below the rest (masked: p = 0)."""

    g = torch.Generator().manual_seed(seed)
    s = torch.tensor([1.0, 0.5, 2.0, -1.0])[torch.randint(0, 4, (n,), generator=g)]
    h = torch.stack([torch.ones(n), s], 1)
    small = torch.randint(-2048, 2048, (v,), generator=g).float() / 256.0
    if kind == "big":
        off, temp = 1.0e4, 1.0
    elif kind == "tiny_t":
        off, temp, small = 1.0, 1.0e-4, small / 64.0
    elif kind == "dominant":
        off, temp = -12000.0, 0.5
        small[5] += 40.0
    else:
        raise ValueError(kind)
    col = torch.full((v,), off)
    col[:20] -= 3.0e4
    w = torch.stack([col, small], 1)
    lab = torch.randint(20, v, (n,), generator=g)
    lab[::4] = II
    return h, w, lab, temp


def _ref_logprobs(h, w, lab, temp, g, ge, dtype):
    """linear_logprobs_ref in dtype: (logp, entropy, d hidden, d weight) for upstream g, ge."""

    hh = h.detach().clone().to(dtype).requires_grad_()
    ww = w.detach().clone().to(dtype).requires_grad_()
    lp, en = linear_logprobs_ref(hh, ww, lab, temperature=temp, return_entropy=True)
    ((lp * g.to(dtype)).sum() + (en * ge.to(dtype)).sum()).backward()
    return lp, en, hh.grad, ww.grad


def check_linear_logprobs():
    """linear_logprobs forward and backward through the chunk driver (2-row token chunks,
    kept rows and recomputed ones; in low-memory mode 128-column vocabulary chunks) at
    |z / T| ~ 1e4: values and gradients against float64."""

    for kind in ("big", "tiny_t", "dominant"):
        h, w, lab, temp = _extreme_head(kind)
        gen = torch.Generator().manual_seed(5)
        g, ge = torch.randn(h.shape[0], generator=gen), torch.randn(h.shape[0], generator=gen)
        want = _ref_logprobs(h, w, lab, temp, g, ge, torch.float64)
        same = _ref_logprobs(h, w, lab, temp, g, ge, torch.float32)
        for mode, env in MODES.items():
            with _harness.env(
                MRTPO_CHUNK_BYTES=str(12 * 2 * 256),
                MRTPO_KEEP_LOGITS_BYTES=str(4 * 700 * 3),
                **env,
            ):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                lp, en = mk.linear_logprobs(
                    hh, ww, lab, temperature=temp, return_entropy=True, backend="triton"
                )
                ((lp * g).sum() + (en * ge).sum()).backward()
            for i, (what, got) in enumerate(
                (("logp", lp), ("entropy", en), ("grad hidden", hh.grad), ("grad weight", ww.grad))
            ):
                close(f"{mode} linear_logprobs {kind} {what}", got, want[i], same[i], rtol=1e-5)


def _extreme_logits():
    """(16, 300) fp32 logits rows, exact: ~1e4 with fractional spread, -12000 with one
    dominant entry, 3e38 ties (|z / T| past float max at T < 1), -inf masked entries, a
    label on a masked entry (log p = -inf), a NaN row, an ignored row; labels (16,)."""

    g = torch.Generator().manual_seed(3)
    v = 300
    small = torch.randint(-2048, 2048, (16, v), generator=g).float() / 256.0
    z = small.clone()
    z[0:3] += 1.0e4
    z[3:5] -= 12000.0
    z[3, 7] += 40.0
    z[4, 9] += 25.0
    z[5] = torch.where(small[5] > 0, 3.0e38, -3.0e38)  # ties at 3e38
    z[6] = torch.where(small[6] > 2, 3.0e38, small[6])
    z[7:10] += 1.0e4
    z[7:10, :100] = float("-inf")
    z[10, 5] = float("nan")
    z[11] = small[11] * 1000.0  # an order-1e4 spread
    lab = torch.randint(100, v, (16,), generator=g)
    lab[8] = 50  # on a masked entry
    lab[12] = II
    lab[5] = int((z[5] > 0).nonzero()[0])
    lab[6] = int((z[6] > 1e30).nonzero()[0])
    return z, lab


def _ref_from_logits(z, lab, temp, g, ge, dtype):
    """logprobs_from_logits_ref in dtype, and the gradient of the rows it defines (-inf
    entries as a value 1e39 below the row max in float64: p = 0 either way; autograd through
    -inf gives NaN in the entropy's gradient); undefined rows: NaN, ignored rows: 0."""

    zz = z.to(dtype)
    lp, en = logprobs_from_logits_ref(zz, lab, temperature=temp, return_entropy=True)
    fin_max = torch.where(torch.isfinite(zz), zz, torch.zeros_like(zz)).abs().amax(-1, True)
    zg = torch.where(zz == float("-inf"), -4.0 * fin_max - 1e6, zz).requires_grad_()
    lpg, eng = logprobs_from_logits_ref(zg, lab, temperature=temp, return_entropy=True)
    defined = ~torch.isnan(lp) & ~torch.isnan(en) & (lab != II)
    gl = (torch.where(defined, lpg, 0) * g.to(dtype)).sum()
    ge_ = (torch.where(defined, eng, 0) * ge.to(dtype)).sum()
    (dz,) = torch.autograd.grad(gl + ge_, zg)
    undefined = (lab != II) & ~defined  # a NaN row: a NaN gradient row
    dz = torch.where(undefined[:, None], float("nan"), dz)
    # a label at a masked entry: log p = -inf; its gradient (g (onehot - p)) is finite
    return lp, en, dz


def check_from_logits():
    """logprobs_from_logits (the row kernels over 3-row chunks) on the extreme rows at
    T = 1, 0.5 and 1e-3: values and gradients against float64."""

    z, lab = _extreme_logits()
    gen = torch.Generator().manual_seed(8)
    g, ge = torch.randn(z.shape[0], generator=gen), torch.randn(z.shape[0], generator=gen)
    for temp in (1.0, 0.5, 1e-3):
        want = _ref_from_logits(z, lab, temp, g, ge, torch.float64)
        same = _ref_from_logits(z, lab, temp, g, ge, torch.float32)
        with _harness.env(MRTPO_SKIP_VALUE_CHECKS="1", MRTPO_CHUNK_BYTES=str(3 * 4 * 300)):
            zz = z.clone().requires_grad_()
            lp, en = mk.logprobs_from_logits(
                zz, lab, temperature=temp, return_entropy=True, backend="triton"
            )
            defined = ~torch.isnan(lp) & ~torch.isnan(en)
            (
                (torch.where(defined, lp, 0) * g).sum() + (torch.where(defined, en, 0) * ge).sum()
            ).backward()
        tag = f"logprobs_from_logits T={temp}"
        close(f"{tag} logp", lp, want[0], same[0], rtol=1e-6)
        close(f"{tag} entropy", en, want[1], same[1], rtol=1e-6)
        close(f"{tag} grad (defined rows)", zz.grad[~torch.isnan(want[2][:, 0])],
              want[2][~torch.isnan(want[2][:, 0])], same[2][~torch.isnan(want[2][:, 0])],
              rtol=1e-6)  # fmt: skip


def policy_refs(h, w, lab, temp, seed):
    """(old, adv, runs) for a policy-loss check: old log-probs 0.3 N(0, 1) off the current
    ones (both clip branches), A ~ N(0, 1), and linear_policy_loss_ref in fp32 ("same") and
    float64 ("ref"): runs[key] = (loss, metrics, d hidden, d weight)."""
    n = h.shape[0]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cur = linear_logprobs_ref(h.double(), w.double(), lab, temperature=temp).float()
    old = cur + 0.3 * torch.randn(n, generator=gen)
    adv = torch.randn(n, generator=gen)
    runs = {}
    for key, dt in (("same", torch.float32), ("ref", torch.float64)):
        hh = h.detach().clone().to(dt).requires_grad_()
        ww = w.detach().clone().to(dt).requires_grad_()
        loss, met = linear_policy_loss_ref(hh, ww, lab, old.to(dt), adv.to(dt), temperature=temp)
        loss.backward()
        runs[key] = (loss, met, hh.grad, ww.grad)
    return old, adv, runs


def close_policy(tag, ours, runs, **tol):
    """close() on the loss, every metric and both gradients of ours = (loss, metrics,
    d hidden, d weight) against runs["ref"], budget from runs["same"]."""
    (loss, met, dh, dw), ref, same = ours, runs["ref"], runs["same"]
    _harness.close(f"{tag} loss", loss, ref[0], same[0], **tol)
    for k in ref[1]:
        _harness.close(f"{tag} {k}", met[k], ref[1][k], same[1][k], **tol)
    _harness.close(f"{tag} grad hidden", dh, ref[2], same[2], **tol)
    _harness.close(f"{tag} grad weight", dw, ref[3], same[3], **tol)


def check_policy():
    """linear_policy_loss through the chunk driver (32-row token chunks; in low-memory mode
    2 vocabulary chunks of 560 columns) at |z / T| ~ 1e4: loss, metrics and gradients against
    float64."""
    for kind in ("big", "tiny_t", "dominant"):
        h, w, lab, temp = _extreme_head(kind, n=40)
        old, adv, runs = policy_refs(h, w, lab, temp, seed=6)
        for mode, env in MODES.items():
            with _harness.env(MRTPO_CHUNK_BYTES=str(4 * w.shape[0] * 32), **env):
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                loss, met = mk.linear_policy_loss(
                    hh, ww, lab, old, adv, temperature=temp, backend="triton"
                )
                loss.backward()
            tag = f"{mode} policy {kind}"
            close_policy(tag, (loss, met, hh.grad, ww.grad), runs, atol=1e-6, rtol=1e-5)


def check_low_memory_columns():
    """The low-memory backward's column kernel: rows.stats(..., norm=) then
    rows.grad_cols_(..., norm=) over three vocabulary chunks of the extreme rows, against
    float64 (the chunk driver's low-memory mode can pass the norm instead of the lse alone)."""

    z, lab = _extreme_logits()
    c, v = z.shape
    k = rows.TritonRowKernel
    gen = torch.Generator().manual_seed(9)
    g, ge = torch.randn(c, generator=gen), torch.randn(c, generator=gen)
    for temp in (1.0, 0.5, 1e-3):
        want = _ref_from_logits(z, lab, temp, g, ge, torch.float64)
        same = _ref_from_logits(z, lab, temp, g, ge, torch.float32)
        # stats by row chunks into column slices of one (2, C) buffer, as a driver would
        norm = torch.full((2, c), float("nan"))
        logp, ent, lse = (torch.empty(c) for _ in range(3))
        for a, b in ((0, 7), (7, c)):
            logp[a:b], ent[a:b], lse[a:b] = k.stats(
                z[a:b], lab[a:b], 1.0 / temp, II, True, norm=norm[:, a:b]
            )
        tag = f"low-memory columns T={temp}"
        close(f"{tag} logp", logp, want[0], same[0])
        close(f"{tag} entropy", ent, want[1], same[1])
        defined = ~torch.isnan(logp) & ~torch.isnan(ent)
        gd, ged = torch.where(defined, g, 0.0), torch.where(defined, ge, 0.0)
        dz = torch.empty_like(z)
        for v0, v1 in ((0, 128), (128, 256), (256, v)):
            cols = z[:, v0:v1].contiguous()
            k.grad_cols_(cols, lab, lse, ent, gd, ged, 1.0 / temp, II, v0, v, norm=norm)
            dz[:, v0:v1] = cols
        ok = ~torch.isnan(want[2][:, 0])
        close(f"{tag} grad (defined rows)", dz[ok], want[2][ok], same[2][ok])
        bad = torch.isnan(lse) & (lab != II)
        expect(f"{tag} NaN rows give a NaN gradient", bool(torch.isnan(dz[bad]).all()), "")
        expect(f"{tag} ignored rows give 0", bool((dz[lab == II] == 0).all()), "")
    for bad_norm in (torch.empty(3, c), torch.empty(c, 2).t()):
        try:
            k.stats(z, lab, 1.0, II, False, norm=bad_norm)
            expect("norm layout checked", False, f"no error for {bad_norm.shape}")
        except ValueError as exc:
            expect("norm layout checked", str(exc).startswith("norm:"), str(exc))


GROUPS = {
    "clip": (check_clip_token_kernels, check_clip_public_op),
    "extreme": (
        check_linear_logprobs,
        check_from_logits,
        check_policy,
        check_low_memory_columns,
    ),
}


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
