"""linear_policy_loss: value, metrics and gradients against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_within_budget, max_err

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R


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
