"""Triton fused policy-loss kernels (mrtpo_kernels/triton_kernels/policy_loss.py) on CPU tensors
under the Triton interpreter, checked through the public API (backend="triton") against
the float64 reference.

Runs as its own process (TRITON_INTERPRET=1 must be set before triton is imported):

    python tests/triton_cases/policy_loss_cases.py [group ...]      (default: every group)

tests/test_triton_policy_loss.py launches it. Exit status 0 when every check passed; 1
with the failed checks listed otherwise. Error rule (README.md, "Numerics"): the kernel's
error against float64 may be at most 2x that of plain PyTorch in the same dtype, plus atol.
"""

from __future__ import annotations

import sys

import _harness
from _harness import close, expect, opcheck

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402
from logprobs_cases import _leaf  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import linear_logprobs_ref, linear_policy_loss_ref  # noqa: E402


def group_backend():
    got = mk.resolve_backend("linear_policy_loss", "cpu", torch.float32, "triton")
    expect("resolve linear_policy_loss", got == "triton", f"resolved to {got!r}")


def _policy_case(
    n,
    v,
    d,
    *,
    bias,
    beta,
    aggregation="token-mean",
    temp=1.0,
    seed=2,
    dtype=torch.float32,
    opts=None,
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
    name = f"policy N={n} V={v} d={d} bias={bias} beta={beta} {aggregation} {dtype} {opts}"
    runs = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww = _leaf(h, dt), _leaf(w, dt)
        bb = _leaf(b, dt) if bias else None
        kw = dict(bias=bb, temperature=temp, clip_low=0.2, clip_high=0.28, **(opts or {}))
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
    if "dual_clip_fraction" in ref[1]:
        dual = ref[1]["dual_clip_fraction"].item()
        expect(f"{name} dual clip binds", 0.0 < dual < 1.0, f"dual_clip_fraction {dual}")


def group_policy():
    _policy_case(37, 1000, 64, bias=True, beta=0.0)
    _policy_case(37, 1000, 64, bias=False, beta=0.1, temp=0.8)
    _policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
    _policy_case(37, 1000, 64, bias=True, beta=0.1, dtype=torch.bfloat16)


def group_policy_options():
    """The dual clip (clip_ratio_c) and the importance-weighted KL term."""
    _policy_case(37, 1000, 64, bias=True, beta=0.1, opts=dict(clip_ratio_c=1.5))
    _policy_case(37, 1000, 64, bias=False, beta=0.1, opts=dict(kl_importance_weight=True))
    _policy_case(
        129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean",
        opts=dict(clip_ratio_c=1.5, kl_importance_weight=True),
    )  # fmt: skip


def group_policy_keep_logits():
    """Variant (a): kept fp32 logits in token chunks (several chunks: a small budget)."""
    with _harness.env(MRTPO_POLICY_KEEP_LOGITS=1, MRTPO_CHUNK_BYTES=4 * 1000 * 32):
        _policy_case(37, 1000, 64, bias=True, beta=0.1)  # 32 rows per chunk
        _policy_case(37, 1000, 64, bias=False, beta=0.0, dtype=torch.bfloat16)
    with _harness.env(MRTPO_POLICY_KEEP_LOGITS=1, MRTPO_CHUNK_BYTES=4 * 5003 * 64):
        _policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
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
    old, adv = torch.randn(5, generator=g) - 4, torch.randn(5, generator=g)
    tw, ref = torch.full((5,), 0.25), torch.randn(5, generator=g) - 4
    # need_grad=True only: with need_grad=False the op returns empty gradients, which its
    # autograd formula (in policy_loss.py) cannot scale for inputs that require grad
    args = (h, w, b, lab, old, adv, tw, ref, 0.9, 0.2, 0.28, 0.1, -100, True, 3.0, True, "triton")
    opcheck("linear_policy_loss", torch.ops.mrtpo.linear_policy_loss.default, args)


GROUPS = {
    name[len("group_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("group_")
}


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
