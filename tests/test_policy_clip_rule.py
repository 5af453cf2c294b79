"""The clip rule of the policy loss on the CPU backends ("cpu": the C++ row kernel of
csrc/cpu/row_kernels.h; "torch": policy_token_terms of mrtpo_kernels/_token_terms.py, which
the torch backend and the vocabulary-parallel path share) against reference.policy_loss_ref
and its autograd:

    clipped = ratio A > clamp(ratio) A, strictly: a tie (every ratio inside the clip range,
        A = 0) or a NaN is not clipped;
    loss = -min(ratio A, clamp(ratio) A), NaN in, NaN out (torch.minimum);
    dL/dlogp = -A ratio unless clipped: a tie passes the whole gradient, a NaN passes NaN.

The Triton kernels have the same checks under the interpreter in
tests/test_triton_clip_extreme.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CPU_BACKENDS
from triton_cases._harness import policy_token_reference

import mrtpo_kernels as mk
from mrtpo_kernels import chunk_plan
from mrtpo_kernels.reference import linear_policy_loss_ref

II = -100
V = 4  # rows of equal logits: p = 1/4 exactly, so dL/dz = dL/dlogp (onehot - 1/4) / tau
NAN, INF = float("nan"), float("inf")

# (shift of old from the row's log p, or an absolute old; A); logp = -log 4 unless the row
# is NaN. Ratios stay far from the clip bounds (the kernels form log p in fp32 or float64).
TOKENS = [  # (kind, old, adv)
    ("tie A>0", ("rel", 0.0), 1.0),  # ratio 1, inside the range: a == b, whole gradient
    ("tie A<0", ("rel", 0.0), -1.0),
    ("tie A=0", ("rel", 0.0), 0.0),
    ("A=0 out of range", ("rel", -2.0), 0.0),  # ratio e^2, a = b = 0: a tie
    ("clipped A>0", ("rel", -2.0), 1.0),  # ratio e^2 > 1 + clip_high
    ("clipped A<0", ("rel", 2.0), -1.0),  # ratio e^-2 < 1 - clip_low
    ("unclipped A>0", ("rel", 2.0), 1.0),
    ("NaN old", ("abs", NAN), 1.0),  # not clipped, NaN loss and gradient
    ("NaN A", ("rel", 0.5), NAN),
    ("NaN logp", ("rel", 0.0), 1.0),  # a NaN logit row
    ("ratio inf, A=0", ("abs", -INF), 0.0),  # a = 0 * inf = NaN: NaN loss (not -b = 0)
    ("ratio 0, A=inf", ("abs", INF), INF),  # a = 0 * inf = NaN
    ("ignored", ("abs", NAN), NAN),  # 0, not clipped, no gradient
]
NAN_ROW = [k for k, _, _ in TOKENS].index("NaN logp")


def _inputs():
    """(z, labels, old, adv) of len(TOKENS) rows of V equal logits (one NaN row)."""
    n = len(TOKENS)
    z = torch.zeros(n, V)
    z[NAN_ROW] = NAN
    labels = torch.arange(n) % V
    labels[-1] = II
    logp = torch.full((n,), -math.log(V))
    old = torch.tensor(
        [(logp[i].item() + x if how == "rel" else x) for i, (_, (how, x), _) in enumerate(TOKENS)]
    )
    adv = torch.tensor([a for _, _, a in TOKENS])
    return z, labels, old, adv


def _same(name, ours, want, *, tol=1e-5):
    """NaN exactly where the reference has NaN (never a 0 or a finite value for a NaN),
    equal infinities, and |ours - want| <= tol (1 + |want|) elsewhere."""
    ours, want = ours.detach().double(), want.detach().double()
    assert ours.shape == want.shape, name
    nan = want.isnan()
    got = ours.isnan()
    assert torch.equal(got, nan), f"{name}: NaN at {got.tolist()}, want {nan.tolist()}"
    o, w = ours[~nan], want[~nan]
    inf = ~w.isfinite()
    assert torch.equal(o[inf], w[inf]), f"{name}: {o.tolist()} != {w.tolist()}"
    ok = (o[~inf] - w[~inf]).abs() <= tol * (1 + w[~inf].abs())
    assert bool(ok.all()), f"{name}: {o.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("clip_c,beta", [(math.inf, 0.0), (3.0, 0.1)], ids=["plain", "dual+kl"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_row_kernel_clip_rule_matches_reference(backend, clip_c, beta):
    """The row kernel's policy_ on every token kind: per-token loss, clipped flag and the
    logit gradient w dL/dlogp (onehot - p) / tau it writes over the row."""
    kern = chunk_plan.row_kernel(backend)
    z, labels, old, adv = _inputs()
    n = z.shape[0]
    ref_lp = torch.full((n,), -1.25)
    tw = torch.ones(n)
    cfg = mk.PolicyLossSettings(beta=beta, ignore_index=II, clip_ratio_c=clip_c)
    loss, logp, clipped = kern.policy_(
        z, labels, old, adv, tw, ref_lp if beta else None, cfg, True
    )  # fmt: skip
    want_l, want_c, want_g = policy_token_reference(  # from the kernel's own log p
        logp, old, adv, labels, 0.2, 0.2, None if math.isinf(clip_c) else clip_c, beta, ref_lp
    )
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), V).double()
    want_z = want_g[:, None] * (onehot - 1.0 / V)
    want_z[NAN_ROW] = NAN  # an undefined row: NaN gradient whatever dL/dlogp is
    tag = f"{backend} clip_c={clip_c} beta={beta}"
    _same(f"loss {tag}", loss, want_l)
    _same(f"clipped {tag}", clipped, want_c, tol=0)
    _same(f"dL/dz {tag}", z, want_z)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_public_op_nan_and_tie_cases_match_reference(backend, monkeypatch):
    """mk.linear_policy_loss with NaN inputs (value checks off): NaN loss, the reference's
    clip_fraction, and the NaN pattern and values of both gradients."""
    monkeypatch.setenv("MRTPO_SKIP_VALUE_CHECKS", "1")
    g = torch.Generator().manual_seed(3)
    n, d, v = 8, 6, 11
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / d**0.5
    lab = torch.randint(0, v, (n,), generator=g)
    lab[5] = II
    with torch.no_grad():
        cur = mk.linear_logprobs(h, w, lab, backend=backend)
    old = cur.clone()  # ratio 1 (to the last bit of fp32 or better): ties
    old[6] += 2.0  # clipped for A < 0
    old[7] -= 2.0  # clipped for A > 0
    old[1] = NAN
    old[3] = -INF  # ratio inf with A = 0: a NaN surrogate
    adv = torch.tensor([1.0, -1.0, NAN, 0.0, 1.0, NAN, -1.0, 1.0])
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    rl, rm = linear_policy_loss_ref(h64, w64, lab, old.double(), adv.double())
    rl.backward()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, met = mk.linear_policy_loss(hh, ww, lab, old, adv, backend=backend)
    loss.backward()
    _same(f"{backend} loss", loss, rl)
    _same(f"{backend} clip_fraction", met["clip_fraction"], rm["clip_fraction"], tol=1e-6)
    _same(f"{backend} grad hidden", hh.grad, h64.grad)
    _same(f"{backend} grad weight", ww.grad, w64.grad)
    # and without the NaN tokens: every value (ties, both branches) against the reference
    keep = torch.tensor([0, 4, 5, 6, 7])
    h64, w64 = h[keep].double().requires_grad_(), w.double().requires_grad_()
    rl, rm = linear_policy_loss_ref(h64, w64, lab[keep], old[keep].double(), adv[keep].double())
    rl.backward()
    hh, ww = h[keep].clone().requires_grad_(), w.clone().requires_grad_()
    loss, met = mk.linear_policy_loss(hh, ww, lab[keep], old[keep], adv[keep], backend=backend)
    loss.backward()
    assert 0.0 < rm["clip_fraction"].item() < 1.0
    _same(f"{backend} finite loss", loss, rl)
    _same(f"{backend} finite clip_fraction", met["clip_fraction"], rm["clip_fraction"], tol=1e-6)
    _same(f"{backend} finite grad hidden", hh.grad, h64.grad)
    _same(f"{backend} finite grad weight", ww.grad, w64.grad)
