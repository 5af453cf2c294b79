"""linear_policy_loss: every check of the op in one place.

- CPU backends (the ``backend`` fixture: cpu, torch) against the float64 reference: value,
  metrics and gradients; non-finite inputs and the k3 KL term's digits.
- Fuzz (hypothesis; shared machinery in tests/fuzzing.py): ``test_fuzz``, and the
  ``slow``-marked ``test_fuzz_long``; the clip-fraction rule on NaN and inf ratios.
- Triton under the interpreter (marker ``triton``; ``make test-triton``): TRITON_INTERPRET=1
  must be switched on before triton is imported, so the ``group_*`` functions below run in a
  subprocess, started by tests/triton_cases/_harness.py (the chunk driver with the row
  kernels, over one and several token chunks): bias, KL term, the three aggregation
  rules, bf16, torch.library.opcheck,
  the k3 KL term's digits. Error rule (README.md, "Numerics"): the kernel's error against
  float64 may be at most 2x that of plain PyTorch in the same dtype, plus atol.
- GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): the real shapes in bf16 and fp32
  against the float64 reference, with and without the low-memory backward.
The clip rule of every backend's token kernels is in tests/test_policy_clip_rule.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_within_budget, max_err
from fuzzing import (
    _acc,
    _assert_matches,
    _backends,
    _body,
    _gemm_tol,
    _linear_case,
    _low,
    _names_an_argument,
    fuzz_tests,
)
from hypothesis import strategies as st
from test_logprobs import DEV, _gpu_inputs, _leaf, _within_budget, gpu_test
from triton_cases import _harness
from triton_cases._harness import close, expect, interpreted, opcheck, run_groups

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R
from mrtpo_kernels.backends import cpu_backend
from mrtpo_kernels.reference import linear_logprobs_ref, linear_policy_loss_ref


def _case(b, t, v, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g)
    w = torch.randn(v, d, generator=g) / d**0.5
    bias = torch.randn(v, generator=g) * 0.1
    lab = torch.randint(0, v, (b, t), generator=g)
    lab[0, -2:] = -100  # padding
    logp = R.linear_logprobs_ref(h.double(), w.double(), lab, bias=bias.double(), temperature=0.9)
    # old log-probs near the current ones so that both clipped and unclipped tokens occur
    old = (logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(b, t, generator=g)
    ref = (logp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    return h.to(dtype), w.to(dtype), bias.to(dtype), lab, old, adv, ref


def _ref_loss(h, w, bias, lab, old, adv, ref, agg, beta, norm_len=None):
    b, t = lab.shape
    seq_ids = torch.arange(b).repeat_interleave(t)
    return R.linear_policy_loss_ref(
        h.reshape(b * t, -1), w, lab.reshape(-1), old.reshape(-1), adv.reshape(-1), bias=bias,
        temperature=0.9, clip_low=0.2, clip_high=0.28, ref_logprobs=ref.reshape(-1), beta=beta,
        aggregation=agg, seq_ids=seq_ids, num_seqs=b, norm_len=norm_len or t,
    )  # fmt: skip


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_policy_loss_value_metrics_and_grads(backend, agg, beta):
    h, w, bias, lab, old, adv, ref = _case(3, 9, 1000, 16)

    def run(fn, dtype):
        hh, ww, bb = (x.detach().to(dtype, copy=True).requires_grad_() for x in (h, w, bias))
        loss, metrics = fn(hh, ww, bb)
        loss.backward()
        return loss, metrics, (hh.grad, ww.grad, bb.grad)

    loss, metrics, grads = run(
        lambda hh, ww, bb: mk.linear_policy_loss(
            hh, ww, lab, old, adv, bias=bb, temperature=0.9, clip_low=0.2, clip_high=0.28,
            aggregation=agg, ref_logprobs=ref, beta=beta, backend=backend,
        ),
        torch.float32,
    )  # fmt: skip

    def reference(hh, ww, bb):
        return _ref_loss(hh, ww, bb, lab, old.to(hh.dtype), adv.to(hh.dtype), ref, agg, beta)

    rloss, rmetrics, rgrads = run(reference, torch.float64)
    ploss, _, pgrads = run(reference, torch.float32)
    assert loss.shape == () and loss.dtype == torch.float32
    assert_within_budget(loss, rloss, ploss, atol=1e-6, name="loss")
    for name, a, r, p in zip(("hidden", "weight", "bias"), grads, rgrads, pgrads):
        assert_within_budget(a, r, p, atol=1e-6, name=f"grad_{name}")
    assert 0.0 < rmetrics["clip_fraction"] < 1.0  # the case exercises both branches
    assert abs(metrics["clip_fraction"].item() - rmetrics["clip_fraction"].item()) < 1e-6
    assert abs(metrics["mean_ratio"].item() - rmetrics["mean_ratio"].item()) < 1e-5
    if beta:
        assert abs(metrics["kl"].item() - rmetrics["kl"].item()) < 1e-6


def test_policy_loss_packed_with_cu_seqlens_equals_padded(backend):
    h, w, bias, lab, old, adv, ref = _case(3, 9, 1000, 16, seed=1)
    padded, _ = mk.linear_policy_loss(
        h, w, lab, old, adv, bias=bias, aggregation="seq-mean-token-mean", backend=backend
    )
    # pack without the padding of row 0 (2 tokens)
    keep = lab.reshape(-1) != -100
    cu = torch.tensor([0, 7, 16, 25])
    packed, _ = mk.linear_policy_loss(
        h.reshape(27, 16)[keep], w, lab.reshape(-1)[keep], old.reshape(-1)[keep],
        adv.reshape(-1)[keep], bias=bias, aggregation="seq-mean-token-mean", cu_seqlens=cu,
        backend=backend,
    )  # fmt: skip
    assert abs(packed.item() - padded.item()) < 1e-6


def test_policy_loss_gradient_computed_in_forward_matches_logprob_path(backend):
    """The fused gradient equals autograd through linear_logprobs + the surrogate."""
    h, w, bias, lab, old, adv, _ = _case(2, 5, 300, 8, seed=2)
    h1 = h.clone().requires_grad_()
    loss, _ = mk.linear_policy_loss(h1, w, lab, old, adv, bias=bias, backend=backend)
    (2.5 * loss).backward()  # a non-unit upstream gradient scales the saved gradient
    h2 = h.clone().requires_grad_()
    logp = mk.linear_logprobs(h2, w, lab, bias=bias, backend=backend)
    l2, _ = R.policy_loss_ref(
        logp.reshape(-1), old.reshape(-1), adv.reshape(-1), lab.reshape(-1) != -100
    )
    (2.5 * l2).backward()
    assert max_err(h1.grad, h2.grad) < 1e-6


def test_policy_loss_gradcheck_float64(backend):
    h, w, bias, lab, old, adv, ref = _case(2, 3, 7, 3, seed=3, dtype=torch.float64)
    old, adv, ref = old.double(), adv.double(), ref.double()
    args = (h.requires_grad_(), w.requires_grad_(), bias.requires_grad_())

    def fn(hh, ww, bb):
        return mk.linear_policy_loss(
            hh, ww, lab, old, adv, bias=bb, ref_logprobs=ref, beta=0.1, backend=backend
        )[0]

    # The gradient is computed in the forward: gradcheck compares it with finite differences.
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def test_policy_loss_no_grad_mode_and_all_ignored(backend):
    h, w, bias, lab, old, adv, _ = _case(2, 4, 50, 4, seed=4)
    with torch.no_grad():
        loss, m = mk.linear_policy_loss(h, w, lab, old, adv, backend=backend)
    assert not loss.requires_grad and torch.isfinite(loss)
    lab_none = torch.full_like(lab, -100)
    hh = h.clone().requires_grad_()
    loss, m = mk.linear_policy_loss(hh, w, lab_none, old, adv, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(hh.grad, torch.zeros_like(h))
    assert m["clip_fraction"].item() == 0.0


def test_policy_loss_bf16_within_budget(backend):
    h, w, bias, lab, old, adv, _ = _case(2, 6, 1000, 32, seed=5, dtype=torch.bfloat16)
    loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, bias=bias, backend=backend)
    b, t = lab.shape
    rl, _ = R.linear_policy_loss_ref(
        h.reshape(b * t, -1).double(), w.double(), lab.reshape(-1), old.reshape(-1),
        adv.reshape(-1), bias=bias.double(),
    )  # fmt: skip
    pl, _ = R.linear_policy_loss_ref(
        h.reshape(b * t, -1), w, lab.reshape(-1), old.reshape(-1).bfloat16(),
        adv.reshape(-1).bfloat16(), bias=bias,
    )  # fmt: skip
    assert_within_budget(loss, rl, pl, atol=1e-4, name="loss bf16")


def test_opcheck_policy_loss(backend):
    h, w, bias, lab, old, adv, ref = _case(1, 5, 11, 3, seed=6)
    n = 5
    args = (
        h.reshape(n, 3).requires_grad_(), w.requires_grad_(), bias, lab.reshape(-1),
        old.reshape(-1), adv.reshape(-1), torch.full((n,), 1.0 / n), ref.reshape(-1), 1.0, 0.2,
        0.2, 0.1, -100, True, 3.0, True, backend,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.mrtpo.linear_policy_loss.default, args)


def test_policy_loss_repeated_backward_and_scaled_upstream(backend):
    h, w, bias, lab, old, adv, _ = _case(1, 4, 30, 4, seed=7)
    hh = h.clone().requires_grad_()
    loss, _ = mk.linear_policy_loss(hh, w, lab, old, adv, backend=backend)
    loss.backward(retain_graph=True)
    first = hh.grad.clone()
    (0.5 * loss).backward()  # a second pass through the same graph, upstream 0.5
    assert torch.allclose(hh.grad, 1.5 * first, atol=1e-7)


def test_policy_loss_hands_its_gradient_buffer_to_autograd(backend):
    # loss.backward(): the weight gradient computed in the forward becomes weight.grad
    # without a copy; a later backward still adds correctly, and one after .grad was
    # written into the shared buffer is refused rather than silently wrong.
    h, w, bias, lab, old, adv, _ = _case(1, 5, 40, 4, seed=8)
    ww = w.clone().requires_grad_()
    loss, _ = mk.linear_policy_loss(h, ww, lab, old, adv, backend=backend)
    loss.backward(retain_graph=True)
    g1 = ww.grad.clone()
    loss.backward(retain_graph=True)  # accumulates in place into the adopted buffer
    assert torch.allclose(ww.grad, 2 * g1, atol=1e-7)
    with pytest.raises(RuntimeError, match="modified"):
        loss.backward()


# --------------------------------------------------------------------------- options:
# dual clip (clip_ratio_c) and the importance-weighted KL term (kl_importance_weight)


def _far_case(b, t, v, d, seed, dtype=torch.float32):
    """Like _case, but old log-probs far below the current ones on half the tokens, so that
    ratios reach e^3 and the dual clip binds on tokens with negative advantages."""
    h, w, bias, lab, old, adv, ref = _case(b, t, v, d, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 100)
    far = torch.rand(b, t, generator=g) < 0.5
    old = torch.where(far, old - 3.0 * torch.rand(b, t, generator=g), old)
    return h, w, bias, lab, old, adv, ref


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("clip_c", "kl_iw"), [(3.0, False), (None, True), (2.0, True)])
def test_policy_loss_dual_clip_and_kl_weight_against_reference(backend, agg, clip_c, kl_iw):
    h, w, bias, lab, old, adv, ref = _far_case(3, 9, 500, 16, seed=11)
    beta = 0.05

    def run(dtype, fn):
        hh, ww, bb = (x.detach().to(dtype, copy=True).requires_grad_() for x in (h, w, bias))
        loss, metrics = fn(hh, ww, bb)
        loss.backward()
        return loss, metrics, (hh.grad, ww.grad, bb.grad)

    def ours(hh, ww, bb):
        return mk.linear_policy_loss(
            hh, ww, lab, old, adv, bias=bb, temperature=0.9, clip_low=0.2, clip_high=0.28,
            aggregation=agg, ref_logprobs=ref, beta=beta, clip_ratio_c=clip_c,
            kl_importance_weight=kl_iw, backend=backend,
        )  # fmt: skip

    def reference(hh, ww, bb):
        b, t = lab.shape
        dt = hh.dtype
        return R.linear_policy_loss_ref(
            hh.reshape(b * t, -1), ww, lab.reshape(-1), old.reshape(-1).to(dt),
            adv.reshape(-1).to(dt), bias=bb, temperature=0.9, clip_low=0.2, clip_high=0.28,
            ref_logprobs=ref.reshape(-1).to(dt), beta=beta, aggregation=agg,
            seq_ids=torch.arange(b).repeat_interleave(t), num_seqs=b, norm_len=t,
            clip_ratio_c=clip_c, kl_importance_weight=kl_iw,
        )  # fmt: skip

    loss, metrics, grads = run(torch.float32, ours)
    rloss, rmetrics, rgrads = run(torch.float64, reference)
    ploss, _, pgrads = run(torch.float32, reference)
    assert_within_budget(loss, rloss, ploss, atol=1e-6, name="loss")
    for name, a, r, p in zip(("hidden", "weight", "bias"), grads, rgrads, pgrads):
        assert_within_budget(a, r, p, atol=1e-6, name=f"grad_{name}")
    keys = {"clip_fraction", "mean_ratio", "kl"} | ({"dual_clip_fraction"} if clip_c else set())
    assert set(metrics) == set(rmetrics) == keys
    for k in keys:
        assert abs(metrics[k].item() - rmetrics[k].item()) < 1e-5 * max(1, abs(rmetrics[k])), k
    if clip_c:
        assert 0.0 < rmetrics["dual_clip_fraction"] < 0.5  # the cap binds on some tokens
    # the option changes the result (the case exercises it)
    plain, _ = mk.linear_policy_loss(
        h, w, lab, old, adv, bias=bias, temperature=0.9, clip_low=0.2, clip_high=0.28,
        aggregation=agg, ref_logprobs=ref, beta=beta, backend=backend,
    )  # fmt: skip
    assert abs(plain.item() - loss.item()) > 1e-4


def test_policy_loss_options_gradcheck_float64(backend):
    h, w, bias, lab, old, adv, ref = _far_case(2, 4, 7, 3, seed=12, dtype=torch.float64)
    old, adv, ref = old.double(), adv.double(), ref.double()
    args = (h.requires_grad_(), w.requires_grad_(), bias.requires_grad_())

    def fn(hh, ww, bb):
        return mk.linear_policy_loss(
            hh,
            ww,
            lab,
            old,
            adv,
            bias=bb,
            ref_logprobs=ref,
            beta=0.1,
            clip_ratio_c=2.0,
            kl_importance_weight=True,
            backend=backend,
        )[0]

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def _verl_vanilla_loss(logp, old, adv, mask, clip_low, clip_high, clip_ratio_c):
    """verl's vanilla compute_policy_loss (token-mean), re-derived: pg1 = -A r,
    pg2 = -A clamp(r), max of the two, then for A < 0 the min with pg3 = -A clip_ratio_c."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -adv * clip_ratio_c
    clip2 = torch.minimum(pg3, clip1)
    per_tok = torch.where(adv < 0, clip2, clip1)
    m = mask.to(per_tok.dtype)
    lower = ((clip1 > pg3) & (adv < 0)).to(m.dtype)
    return (per_tok * m).sum() / m.sum(), (lower * m).sum() / m.sum()


def test_policy_loss_dual_clip_equals_verl_formula(backend):
    h, w, bias, lab, old, adv, _ = _far_case(4, 8, 300, 8, seed=13)
    hh = h.clone().requires_grad_()
    loss, metrics = mk.linear_policy_loss(
        hh, w, lab, old, adv, bias=bias, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0,
        backend=backend,
    )  # fmt: skip
    loss.backward()
    h2 = h.clone().requires_grad_()
    logp = mk.linear_logprobs(h2, w, lab, bias=bias, backend=backend)
    vloss, vlower = _verl_vanilla_loss(logp, old, adv, lab != -100, 0.2, 0.28, 3.0)
    vloss.backward()
    assert abs(loss.item() - vloss.item()) < 1e-6
    assert max_err(hh.grad, h2.grad) < 1e-6
    assert vlower.item() > 0 and abs(metrics["dual_clip_fraction"].item() - vlower.item()) < 1e-6


def test_policy_loss_dual_clip_at_a_large_ratio(backend):
    # one token, A < 0 and a ratio of 13.8: without the dual clip the loss is -A r = 0.864;
    # verl's clip_ratio_c = 3 caps it at -3 A = 0.188 and its gradient is then 0
    g = torch.Generator().manual_seed(14)
    h = torch.randn(1, 6, generator=g, dtype=torch.float64)
    w = torch.randn(20, 6, generator=g, dtype=torch.float64)
    lab = torch.tensor([3])
    logp = R.linear_logprobs_ref(h, w, lab)
    adv = torch.tensor([-0.188 / 3], dtype=torch.float64)
    ratio = 0.864 / 0.188 * 3
    old = logp - torch.log(torch.tensor(ratio, dtype=torch.float64))
    hh = h.clone().requires_grad_()
    free, _ = mk.linear_policy_loss(hh, w, lab, old, adv, backend=backend)
    capped, m = mk.linear_policy_loss(hh, w, lab, old, adv, clip_ratio_c=3.0, backend=backend)
    vfree = (-adv * ratio).item()
    vcap, _ = _verl_vanilla_loss(logp, old, adv, lab != -100, 0.2, 0.2, 3.0)
    assert abs(free.item() - 0.864) < 1e-9 and abs(free.item() - vfree) < 1e-9
    assert abs(capped.item() - 0.188) < 1e-9 and abs(capped.item() - vcap.item()) < 1e-9
    assert m["dual_clip_fraction"].item() == 1.0 and m["clip_fraction"].item() == 0.0
    capped.backward()
    assert torch.equal(hh.grad, torch.zeros_like(h))
    # a positive advantage is never capped
    hh.grad = None
    pos, m = mk.linear_policy_loss(hh, w, lab, old, -adv, clip_ratio_c=3.0, backend=backend)
    assert abs(pos.item() + 0.188 / 3 * 1.2) < 1e-9 and m["dual_clip_fraction"].item() == 0.0


def _trl_kl_loss(logp, old, adv, ref, mask, beta, eps):
    """TRL 1.16's token-level loss with use_bias_correction_kl, re-derived: the k3 term is
    multiplied by coef_1 = exp(logp - old), which is not detached; bnpo normalization."""
    coef_1 = torch.exp(logp - old)
    per_tok = -torch.minimum(coef_1 * adv, torch.clamp(coef_1, 1 - eps, 1 + eps) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_tok = per_tok + beta * kl * coef_1
    m = mask.to(per_tok.dtype)
    return (per_tok * m).sum() / m.sum()


def test_policy_loss_kl_importance_weight_equals_trl_formula(backend):
    h, w, bias, lab, old, adv, ref = _far_case(3, 6, 200, 8, seed=15)
    hh = h.clone().requires_grad_()
    loss, _ = mk.linear_policy_loss(
        hh, w, lab, old, adv, bias=bias, ref_logprobs=ref, beta=0.2,
        kl_importance_weight=True, backend=backend,
    )  # fmt: skip
    loss.backward()
    h2 = h.clone().requires_grad_()
    logp = mk.linear_logprobs(h2, w, lab, bias=bias, backend=backend)
    tloss = _trl_kl_loss(logp, old, adv, ref, lab != -100, 0.2, 0.2)
    tloss.backward()
    assert abs(loss.item() - tloss.item()) < 1e-5
    assert max_err(hh.grad, h2.grad) < 1e-6


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, float("inf"), float("nan")])
def test_policy_loss_clip_ratio_c_validation(bad):
    h, w, bias, lab, old, adv, _ = _case(1, 3, 10, 4, seed=16)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        mk.linear_policy_loss(h, w, lab, old, adv, clip_ratio_c=bad)


@pytest.mark.parametrize("dynamic", [None, True], ids=["recompile", "dynamic"])
def test_compile_fullgraph_with_float_arguments_that_change(dynamic):
    """torch.compile(fullgraph=True) of the public ops while their float arguments change
    between calls (dynamo then traces them as symbolic floats) or under dynamic=True: the
    argument checks must trace (no math.isfinite on a symbolic float) and the results
    equal eager ones."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 4, generator=g), torch.randn(50, 4, generator=g)
    y = torch.randint(0, 50, (2, 3), generator=g)
    rewards, gid = torch.randn(4, 2, generator=g), torch.tensor([0, 0, 1, 1])
    rel, cu = torch.rand(2, 9, generator=g), torch.tensor([0, 2, 5, 6, 9])
    info = torch.ones(4, 2, dtype=torch.bool)

    def step(h, w, t, c, beta, n, alpha, gamma):
        lp, ent = mk.linear_logprobs(h, w, y, temperature=t, return_entropy=True, backend="torch")
        d = mk.linear_js_distance(h, (h + 0.1)[None], w, temperature=t, backend="torch")
        d2 = mk.js_distance(h @ w.t(), h @ w.t() + 0.2, temperature=t, backend="torch")
        lp2 = mk.logprobs_from_logits(h @ w.t(), y, temperature=t, backend="torch")
        loss, m = mk.linear_policy_loss(
            h, w, y, lp.detach() - 0.1, torch.ones(2, 3), temperature=t, clip_low=c,
            clip_high=c, beta=beta, ref_logprobs=lp.detach(), norm_len=n,
            aggregation="seq-mean-token-sum-norm", clip_ratio_c=3.0 + c, backend="torch",
        )  # fmt: skip
        adv = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=info, cu_seqlens=cu,
                                        alpha=alpha, gamma=gamma, eps=c * 1e-5, delta=c * 1e-8,
                                        backend="torch")  # fmt: skip
        return (lp.sum() + ent.sum() + d.sum() + d2.sum() + lp2.sum() + loss + m["kl"]
                + adv.token.sum())  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend="eager", dynamic=dynamic)
    for t, c, beta, n, alpha, gamma in [(1.0, 0.2, 0.1, 4.0, 1.0, 1.0),
                                        (0.7, 0.3, 0.05, 5.5, 0.5, 2.0),
                                        (1.3, 0.25, 0.2, 3.0, 0.8, 0.5)]:  # fmt: skip
        args = (h, w, t, c, beta, n, alpha, gamma)
        torch.testing.assert_close(compiled(*args), step(*args))


def test_sum_norm_default_is_the_most_valid_tokens_of_a_sequence(backend):
    """seq-mean-token-sum-norm without norm_len: the same tokens give the same loss padded
    (any padded width, ignored prompt tokens included) and packed; the normalizer is the
    most valid tokens of one sequence (7 here), as in the reference."""
    h, w, bias, lab, old, adv, ref = _case(3, 9, 300, 16, seed=7)
    lab[1, :2] = -100  # prompt tokens of row 1 (ignored), padding of row 0 as in _case
    lab[2, -2:] = -100
    kw = dict(bias=bias, aggregation="seq-mean-token-sum-norm", backend=backend)
    padded, _ = mk.linear_policy_loss(h, w, lab, old, adv, **kw)

    def widen(t, fill):  # 4 more padding columns: a padded width of 13
        return torch.cat([t, torch.full((3, 4, *t.shape[2:]), fill, dtype=t.dtype)], 1)

    wide = (widen(h, 0.0), widen(lab, -100), widen(old, 0.0), widen(adv, 0.0))
    padded_wide, _ = mk.linear_policy_loss(wide[0], w, *wide[1:], **kw)
    keep = lab.reshape(-1) != -100
    lengths = (lab != -100).sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    packed, _ = mk.linear_policy_loss(
        h.reshape(27, 16)[keep], w, lab.reshape(-1)[keep], old.reshape(-1)[keep],
        adv.reshape(-1)[keep], cu_seqlens=cu, **kw,
    )  # fmt: skip
    # packed with the ignored tokens kept inside each sequence's span
    packed_spans, _ = mk.linear_policy_loss(
        h.reshape(27, 16), w, lab.reshape(-1), old.reshape(-1), adv.reshape(-1),
        cu_seqlens=torch.tensor([0, 9, 18, 27]), **kw,
    )  # fmt: skip
    want, _ = R.linear_policy_loss_ref(
        h.reshape(27, 16).double(), w.double(), lab.reshape(-1), old.reshape(-1),
        adv.reshape(-1), bias=bias.double(), aggregation="seq-mean-token-sum-norm",
        seq_ids=torch.arange(3).repeat_interleave(9), num_seqs=3,
    )  # fmt: skip
    explicit, _ = R.linear_policy_loss_ref(
        h.reshape(27, 16).double(), w.double(), lab.reshape(-1), old.reshape(-1),
        adv.reshape(-1), bias=bias.double(), aggregation="seq-mean-token-sum-norm",
        seq_ids=torch.arange(3).repeat_interleave(9), num_seqs=3, norm_len=7.0,
    )  # fmt: skip
    assert int(lengths.max()) == 7 and want.item() == explicit.item()
    for name, got in (("padded", padded), ("padded wide", padded_wide), ("packed", packed),
                      ("packed spans", packed_spans)):  # fmt: skip
        assert abs(got.item() - want.item()) < 1e-5, (name, got.item(), want.item())


# ------------------------------------------------------------ extreme inputs, the k3 KL term


BACKENDS = ["torch"] + (["cpu"] if cpu_backend.available() else [])
V = 67


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_policy_loss_is_nan(backend):
    h = torch.randn(6, 8)
    h[2, 0] = float("nan")
    w = torch.randn(V, 8)
    y = torch.tensor([1, 2, 3, 4, 5, 6])
    hh = h.clone().requires_grad_()
    loss, _ = mk.linear_policy_loss(
        hh, w, y, torch.full((6,), -4.0), torch.ones(6), backend=backend
    )
    assert loss.isnan(), loss
    h[2, 0] = 0.0
    loss, _ = mk.linear_policy_loss(h, w, y, torch.full((6,), -4.0), torch.ones(6), backend=backend)
    assert loss.isfinite(), loss


# d = ref - logp: from far below float32's resolution of exp(d) - 1 to well past the series
KL_DIFFS = [1e-12, -1e-12, 1e-7, -1e-7, 3e-6, -3e-6, 1e-5, -1e-5, 1e-3, -1e-3, 0.1, -0.1,
            0.49, -0.49, 0.5, -0.5, 0.7, -0.7, 3.0, -3.0, 20.0, -20.0]  # fmt: skip


def _k3_exact(d: float) -> float:
    """exp(d) - d - 1 at 60 significant digits (decimal), rounded to float64."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.prec = 60
        x = decimal.Decimal(d)
        return float(x.exp() - x - 1)


def test_kl_k3_reference_and_torch_form_keep_their_digits():
    d = torch.tensor(KL_DIFFS, dtype=torch.float64)
    exact = torch.tensor([_k3_exact(v) for v in KL_DIFFS], dtype=torch.float64)
    assert bool(((R.kl_k3_ref(d) - exact).abs() <= 4e-16 * exact).all()), R.kl_k3_ref(d) / exact
    from mrtpo_kernels._token_terms import kl_k3

    d32 = d.float()
    exact32 = torch.tensor([_k3_exact(float(v)) for v in d32], dtype=torch.float64)
    got = kl_k3(d32).double()
    assert bool(((got - exact32).abs() <= 4e-7 * exact32).all()), got / exact32
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0])
    out = kl_k3(special)
    assert out[0].isnan() and out[1].isnan() and out[2] == math.inf and out[3] == 0.0
    assert torch.equal(R.kl_k3_ref(special.double()).isnan(), out.isnan())


def _kl_loss_case(d: float, backend: str):
    """A one-entry vocabulary: logp = 0 exactly on every backend, so ref - logp is d itself;
    adv = 0: the loss is beta times the mean k3 term, as is metrics["kl"]."""
    n = 6
    h = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    w = torch.randn(1, 3, generator=torch.Generator().manual_seed(1))
    y = torch.zeros(n, dtype=torch.long)
    ref = torch.full((n,), d, dtype=torch.float32)
    loss, m = mk.linear_policy_loss(h, w, y, torch.zeros(n), torch.zeros(n), ref_logprobs=ref,
                                    beta=1.0, backend=backend)  # fmt: skip
    return loss, m["kl"], _k3_exact(float(ref[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_term_keeps_its_digits_in_loss_and_metric(backend):
    """The k3 KL exp(d) - d - 1 for ref and policy log-probs a hair apart (d ~ 1e-12 ..
    1e-5): the plain form cancels to 0 or noise in float32 (and in double at 1e-7); every
    backend's loss and the kl metric hold it to float32 precision."""
    for d in KL_DIFFS:
        loss, kl, want = _kl_loss_case(d, backend)
        for what, got in (("loss", loss), ("kl metric", kl)):
            assert abs(got.item() - want) <= 2e-6 * want, f"d={d}: {what} {got.item()!r} {want!r}"


# --------------------------------------------------------------------------- fuzz


@_body(st.data())
def _policy_body(data):
    backend, h, w, bias, temp, gen, draw = data.draw(_linear_case("linear_policy_loss"))
    n, v = h.shape[0], w.shape[0]
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.25] = -100
    with torch.no_grad():
        lp64 = R.linear_logprobs_ref(h.double(), w.double(), labels, temperature=temp,
                                     bias=None if bias is None else bias.double())  # fmt: skip
    old = (lp64 + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).float()
    old = old.nan_to_num(0.0, 0.0, 0.0)
    ignored = labels == -100
    old[ignored] = draw(st.sampled_from([0.0, -math.inf, math.nan]))  # never read
    adv = torch.randn(n, generator=gen)
    beta = draw(st.sampled_from([0.0, 0.04]))
    ref = (old + 0.1 * torch.randn(n, generator=gen)) if beta else None
    if ref is not None:
        ref[ignored] = 0.0
    agg = draw(st.sampled_from(mk.policy_loss.AGGREGATIONS))
    cut = sorted(draw(st.lists(st.integers(0, n), min_size=0, max_size=3)))
    cu = torch.tensor([0, *cut, n])
    bad = draw(st.sampled_from([None, None, None, "cu", "norm_len", "old", "adv", "label"]))
    norm_len = draw(st.sampled_from([None, 3.0]))
    if bad == "cu":
        # not starting at 0, not monotone, not ending at N (dropping the last boundary is
        # valid when the one before is N too: then end one short)
        short = cu[:-1] if int(cu[-2]) != n else torch.cat([cu[:-1], cu[-1:] - 1])
        cu = draw(st.sampled_from([cu + 1, cu.flip(0), short]))
        agg = "seq-mean-token-mean"
    elif bad == "norm_len":
        norm_len = draw(st.sampled_from([0.0, -2.0, math.inf, math.nan]))
    elif bad == "old" and bool((~ignored).any()):
        old[(~ignored).nonzero()[0]] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    elif bad == "adv" and bool((~ignored).any()):
        adv[(~ignored).nonzero()[0]] = draw(st.sampled_from([math.nan, math.inf]))
    elif bad == "label":
        labels[0] = v
    fn = mk.linear_policy_loss
    kw = dict(bias=bias, temperature=temp, aggregation=agg, cu_seqlens=cu, norm_len=norm_len,
              ref_logprobs=ref, beta=beta, backend=backend)  # fmt: skip
    try:
        loss, metrics = fn(h.detach().clone().requires_grad_(), w, labels, old, adv, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert bad is not None, f"ValueError on valid input: {e}"
        return
    assert bad in (None, "old", "adv"), f"accepted bad {bad}"  # old/adv: only ignored ones
    lens = cu[1:] - cu[:-1]
    seq_ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
    br = None if bias is None else bias.double()
    # seq-mean-token-sum-norm's default normalizer: the most valid tokens of one sequence
    valid_counts = torch.zeros(len(lens)).index_add_(0, seq_ids, (~ignored).float())
    max_len = max(1.0, float(valid_counts.max()))
    rloss, rmet = R.linear_policy_loss_ref(
        h.double(), w.double(), labels, old.double(), adv.double(), bias=br, temperature=temp,
        ref_logprobs=None if ref is None else ref.double(), beta=beta, aggregation=agg,
        seq_ids=seq_ids, num_seqs=len(lens), norm_len=norm_len,
    )  # fmt: skip
    bl = None if bias is None else _low(bias)
    ploss, pmet = R.linear_policy_loss_ref(
        _low(h), _low(w), labels, old, adv, bias=bl, temperature=temp, ref_logprobs=ref,
        beta=beta, aggregation=agg, seq_ids=seq_ids, num_seqs=len(lens), norm_len=norm_len,
    )  # fmt: skip
    what = f"linear_policy_loss[{backend}, {h.dtype}, {agg}, beta={beta}]"
    # L_t = -min(r A, ...), r = exp(logp - old): an error e in logp moves L_t by ~ r |A| e
    lp_tol = 2e-5 + 2 * _gemm_tol(h, w, temp, _acc(h))
    r_max = torch.exp(lp64 - old.double()).nan_to_num(0.0, 0.0, 0.0)[~ignored]
    scale = (r_max.abs().max().item() if r_max.numel() else 1.0) * adv.abs().max().item() + 1.0
    tol = 4 * lp_tol * scale * max(1.0, n / (norm_len or max_len))
    _assert_matches(loss, rloss, ploss, what + " loss", atol=tol, rtol=1e-5)
    # clip_fraction counts r A > clamp(r) A strictly, as the reference; a token whose
    # reference log-ratio lies within the log-prob error of a clip boundary may fall on
    # the other side in the op: each such token may move the fraction by 1 / (valid tokens)
    log_r = lp64 - old.double()
    bounds = (math.log1p(0.2), math.log1p(-0.2))  # the default clip_low = clip_high = 0.2
    assert "clip_low" not in kw and "clip_high" not in kw
    near = ((log_r - bounds[0]).abs() <= lp_tol) | ((log_r - bounds[1]).abs() <= lp_tol)
    near &= ~ignored
    clip_tol = (int(near.sum()) + 1e-3) / max(1, int((~ignored).sum()))
    for key in ("mean_ratio", "clip_fraction", "kl"):
        if key in rmet:
            assert key in metrics, f"{what}: metric {key} missing"
            m_tol = tol if key != "clip_fraction" else clip_tol
            _assert_matches(metrics[key], rmet[key], pmet[key], f"{what} {key}", atol=m_tol,
                            rtol=1e-5)  # fmt: skip


FUZZ = {"linear_policy_loss": _policy_body}

test_fuzz, test_fuzz_long = fuzz_tests(FUZZ)


# Regression: clip_fraction counts r A > clamp(r) A strictly, as the reference does, so a
# NaN log-prob (a NaN hidden row) or a NaN product (r = inf with A = 0) is not clipped; the
# C++ row kernel counted every token that was not "unclipped" (NaN included), the torch
# kernel a NaN product.
@pytest.mark.parametrize("backend", _backends("linear_policy_loss", torch.float32))
def test_clip_fraction_strict_rule_on_nan_and_inf_ratio(backend):
    gen = torch.Generator().manual_seed(3)
    n, v, d = 6, 11, 4
    h = torch.randn(n, d, generator=gen)
    h[0, 1] = math.nan  # logp NaN: ratio NaN
    w = torch.randn(v, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    lp = R.linear_logprobs_ref(h.double(), w.double(), y)
    old = (lp + torch.tensor([0.0, -800.0, 0.5, -0.5, 0.01, 0.0])).float()  # token 1: r = inf
    adv = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    old[0] = -1.0  # finite: only the log-prob is NaN
    old[5] = -math.inf  # ignored token: never read
    y[5] = -100
    _, got = mk.linear_policy_loss(h, w, y, old, adv, backend=backend)
    _, ref = R.linear_policy_loss_ref(
        h.double(), w.double(), y, old.double(), adv.double(), seq_ids=None, num_seqs=1
    )
    # of the 5 scored tokens only token 3 (r = e^0.5 > 1.2, A > 0) is clipped; token 2 has
    # r = e^-0.5 with A > 0 (r A is the minimum), token 4 r = e^-0.01 inside the range
    assert float(ref["clip_fraction"]) == pytest.approx(0.2, abs=1e-12)
    assert float(got["clip_fraction"]) == pytest.approx(float(ref["clip_fraction"]), abs=1e-7)


# --------------------------------------------------------------------------- Triton (interpreter)


@interpreted
def test_triton_policy_loss_under_interpreter():
    """The groups below (group_*), in one subprocess."""
    run_groups(__file__)


def group_backend():
    got = mk.resolve_backend("linear_policy_loss", "cpu", torch.float32, "triton")
    expect("resolve linear_policy_loss", got == "triton", f"resolved to {got!r}")


def _triton_policy_case(
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
    _triton_policy_case(37, 1000, 64, bias=True, beta=0.0)
    _triton_policy_case(37, 1000, 64, bias=False, beta=0.1, temp=0.8)
    _triton_policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
    _triton_policy_case(37, 1000, 64, bias=True, beta=0.1, dtype=torch.bfloat16)


def group_policy_options():
    """The dual clip (clip_ratio_c) and the importance-weighted KL term."""
    _triton_policy_case(37, 1000, 64, bias=True, beta=0.1, opts=dict(clip_ratio_c=1.5))
    _triton_policy_case(37, 1000, 64, bias=False, beta=0.1, opts=dict(kl_importance_weight=True))
    _triton_policy_case(
        129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean",
        opts=dict(clip_ratio_c=1.5, kl_importance_weight=True),
    )  # fmt: skip


def group_policy_chunks():
    """Several token chunks of fp32 logits (a small budget), then no gradient wanted, then
    every token ignored."""
    with _harness.env(MRTPO_CHUNK_BYTES=4 * 1000 * 32):
        _triton_policy_case(37, 1000, 64, bias=True, beta=0.1)  # 32 rows per chunk
        _triton_policy_case(37, 1000, 64, bias=False, beta=0.0, dtype=torch.bfloat16)
    with _harness.env(MRTPO_CHUNK_BYTES=4 * 5003 * 64):
        _triton_policy_case(129, 5003, 3, bias=True, beta=0.05, aggregation="seq-mean-token-mean")
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


def group_kl_digits():
    """The k3 KL term keeps its digits on the Triton policy kernels, as
    test_kl_term_keeps_its_digits_in_loss_and_metric on the CPU backends."""
    for d in KL_DIFFS:
        loss, kl, want = _kl_loss_case(d, "triton")
        for what, got in (("loss", loss), ("kl", kl)):
            expect(f"kl d={d} {what}", abs(got.item() - want) <= 2e-6 * want,
                   f"{got.item()!r} want {want!r}")  # fmt: skip


GROUPS = {
    name[len("group_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("group_")
}


# --------------------------------------------------------------------------- GPU


@gpu_test
@pytest.mark.parametrize("low_memory", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_linear_policy_loss_real_shape(dtype, low_memory, monkeypatch):
    """The chunk driver at the real shape, with the fp32 dW accumulator and with the
    low-memory backward (vocabulary chunks, dW written once)."""
    monkeypatch.setenv("MRTPO_LOW_MEMORY", low_memory)
    n, d = 2048, 4096
    h, w, lab = _gpu_inputs(n, d, dtype, seed=3)
    with torch.no_grad():
        cur = mk.linear_logprobs(h, w, lab, backend="triton")
    g = torch.Generator(device=DEV).manual_seed(4)
    # rounded to dtype once, so that every run sees the same input values
    old = (cur + 0.3 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    adv = torch.randn(n, device=DEV, generator=g).to(dtype)
    ref_lp = (cur + 0.3 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    out = {}
    for key, dt in (("ours", dtype), ("same", dtype), ("ref", torch.float64)):
        hh, ww = (t.detach().to(dt).requires_grad_() for t in (h, w))
        args = (hh, ww, lab, old.to(dt), adv.to(dt))
        kw = dict(ref_logprobs=ref_lp.to(dt), beta=0.05, clip_high=0.28)
        if key == "ours":
            loss, met = mk.linear_policy_loss(*args, backend="triton", **kw)
        else:
            loss, met = linear_policy_loss_ref(*args, **kw)
        loss.backward()
        out[key] = (loss, met, hh.grad, ww.grad)
    _within_budget(out["ours"][0], out["ref"][0], out["same"][0], atol=1e-5)
    for k in out["ref"][1]:
        _within_budget(out["ours"][1][k], out["ref"][1][k], out["same"][1][k], atol=1e-5)
    _within_budget(out["ours"][2], out["ref"][2], out["same"][2], atol=1e-6)
    _within_budget(out["ours"][3], out["ref"][3], out["same"][3], atol=1e-6)
