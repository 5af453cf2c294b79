"""GDPO and MRTPO token advantages: METHOD.md section 5 invariants and the reference."""

from __future__ import annotations

import math

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import advantages
from mrtpo_kernels import reference as R


def _batch(n_groups=4, g=4, k=3, seed=0, max_len=9):
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * g
    rewards = torch.randint(0, 2, (n, k), generator=gen).double()
    rewards[:, -1] = torch.rand(n, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(n_groups).repeat_interleave(g) * 7 + 3  # arbitrary ids
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(k, int(cu[-1]), generator=gen, dtype=torch.float64)
    has_info = torch.rand(n, k, generator=gen) > 0.3
    has_info[:, 0] = False  # reward 0 reads no span (overall correctness)
    return rewards, group_ids, rel, cu, has_info


def _split(x, cu):
    return [x[..., cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def test_gdpo_hand_computed_example():
    # one group of 3 with rewards (r1, r2): r1 = 1, 0, 0 ; r2 = 0.5, 0.5, 0.5 (zero variance)
    rewards = torch.tensor([[1.0, 0.5], [0.0, 0.5], [0.0, 0.5]], dtype=torch.float64)
    out = mk.gdpo_advantages(rewards, torch.tensor([0, 0, 0]), eps=0.0)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of (1, 0, 0)
    expect = torch.tensor([2 / 3, -1 / 3, -1 / 3], dtype=torch.float64) / std
    assert torch.allclose(out.per_reward[:, 0], expect, atol=1e-12)
    assert torch.equal(out.per_reward[:, 1], torch.zeros(3, dtype=torch.float64))
    # batch statistics of S = A_1 + A_2
    s = expect
    assert torch.allclose(out.mean, s.mean()) and torch.allclose(out.std, s.std())
    assert torch.allclose(out.sequence, (s - s.mean()) / s.std(), atol=1e-12)


@pytest.mark.parametrize("batch_norm", ["sequence", "token"])
def test_gdpo_matches_reference(batch_norm):
    rewards, gid, _, cu, _ = _batch(seed=1)
    lengths = cu[1:] - cu[:-1]
    w = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    out = mk.gdpo_advantages(rewards, gid, weights=w, batch_norm=batch_norm, lengths=lengths)
    ref = R.gdpo_advantages_ref(rewards, gid, weights=w, batch_norm=batch_norm, lengths=lengths)
    for a, b in zip(out, ref):
        assert torch.allclose(a, b, atol=1e-12)


def test_gdpo_group_of_one_and_zero_variance_give_zero():
    rewards = torch.tensor([[1.0], [0.3], [0.3], [0.3]], dtype=torch.float64)
    out = mk.gdpo_advantages(rewards, torch.tensor([5, 9, 9, 9]))
    assert torch.equal(out.per_reward, torch.zeros(4, 1, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_batch_flat_s_is_precision_consistent(dtype):
    # rewards whose two per-reward advantages cancel exactly in exact arithmetic: every S
    # is 0, but the two standardizations round differently (the old float32 op gave
    # sequence +-0.71 on 698 of 1682 such batches; the reference gave 0)
    g = torch.tensor([0, 0])
    for s in range(1, 30):
        for t in range(1, 30):
            r = torch.tensor([[0.0, s * 0.1], [t * 0.37, 0.0]]).to(dtype)
            out = mk.gdpo_advantages(r, g, eps=0.0)
            ref = R.gdpo_advantages_ref(r.double(), g, eps=0.0)
            assert torch.equal(ref.sequence, torch.zeros(2, dtype=torch.float64)), (s, t)
            assert torch.equal(out.sequence, torch.zeros_like(out.sequence)), (s, t, dtype)
            assert float(out.std) == 0.0 and float(ref.std) == 0.0


def test_batch_norm_decided_on_float64_statistics():
    # S = +-1.4e-9 (eps = 1e-9 breaks the symmetry): a spread far above the flat threshold
    # (2^-40 of the terms) but below float32 rounding of the terms (~0.71): the float32 op
    # must decide and normalize as the float64 reference does, not on rounded S
    r = torch.tensor([[0.0, 1.0], [1.0, 0.5]])
    g = torch.tensor([0, 0])
    ref = R.gdpo_advantages_ref(r.double(), g, eps=1e-9, eps_batch=0.0)
    assert ref.sequence.abs().min() > 0.7
    for batch_norm in ("sequence", "token"):
        kw = dict(eps=1e-9, eps_batch=0.0, batch_norm=batch_norm, lengths=torch.tensor([3, 5]))
        ref = R.gdpo_advantages_ref(r.double(), g, **kw)
        out = mk.gdpo_advantages(r, g, **kw)
        assert out.sequence.dtype == torch.float32
        assert torch.allclose(out.sequence.double(), ref.sequence, rtol=1e-6, atol=0)
        assert torch.allclose(out.mean.double(), ref.mean, rtol=1e-6, atol=1e-30)
        assert torch.allclose(out.std.double(), ref.std, rtol=1e-6, atol=0)


def test_flat_threshold_is_the_same_in_op_and_reference():
    from mrtpo_kernels import advantages

    assert advantages.FLAT_REL == R.FLAT_REL


@pytest.mark.parametrize(
    "alpha,gamma,clip", [(1.0, 1.0, None), (0.6, 2.0, None), (1.0, 0.5, (0.2, 3.0))]
)
@pytest.mark.parametrize("batch_norm", ["sequence", "token"])
def test_token_advantages_match_reference(alpha, gamma, clip, batch_norm):
    rewards, gid, rel, cu, has_info = _batch(seed=2)
    out = mk.mrtpo_token_advantages(
        rewards, gid, rel, has_info=has_info, cu_seqlens=cu, alpha=alpha, gamma=gamma,
        clip=clip, batch_norm=batch_norm,
    )  # fmt: skip
    ref_tokens, ref_g = R.mrtpo_token_advantages_ref(
        rewards, gid, _split(rel, cu), has_info=has_info, alpha=alpha, gamma=gamma, clip=clip,
        batch_norm=batch_norm,
    )  # fmt: skip
    assert torch.allclose(out.token, torch.cat(ref_tokens), atol=1e-10)
    assert torch.allclose(out.sequence, ref_g.sequence, atol=1e-12)


def test_alpha_zero_is_exactly_gdpo():
    rewards, gid, rel, cu, has_info = _batch(seed=3)
    out = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu, alpha=0.0)
    seq = mk.gdpo_advantages(rewards, gid).sequence
    lengths = cu[1:] - cu[:-1]
    assert torch.equal(out.token, seq.repeat_interleave(lengths))


def test_no_spans_is_exactly_gdpo():
    rewards, gid, rel, cu, _ = _batch(seed=4)
    none = torch.zeros(rewards.shape, dtype=torch.bool)
    out = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=none, cu_seqlens=cu)
    seq = mk.gdpo_advantages(rewards, gid).sequence
    assert torch.equal(out.token, seq.repeat_interleave(cu[1:] - cu[:-1]))
    assert torch.equal(out.allocation, torch.ones_like(rel))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("gamma", [0.5, 1.0, 3.0])
def test_mass_is_conserved(alpha, gamma):
    rewards, gid, rel, cu, has_info = _batch(seed=5)
    out = mk.mrtpo_token_advantages(
        rewards, gid, rel, has_info=has_info, cu_seqlens=cu, alpha=alpha, gamma=gamma
    )
    lengths = (cu[1:] - cu[:-1]).double()
    sums = torch.stack([t.sum() for t in _split(out.token, cu)])
    assert torch.allclose(sums, lengths * out.sequence, atol=1e-9)


def test_zero_variance_group_moves_nothing():
    rewards, gid, rel, cu, has_info = _batch(seed=6)
    has_info[:] = True
    base = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu)
    # reward 1 constant inside group 0: its relevance there must not matter
    rewards2 = rewards.clone()
    rewards2[:4, 1] = 1.0
    a = mk.mrtpo_token_advantages(rewards2, gid, rel, has_info=has_info, cu_seqlens=cu)
    rel2 = rel.clone()
    rel2[1, : cu[4]] = torch.rand(int(cu[4]), dtype=torch.float64)
    b = mk.mrtpo_token_advantages(rewards2, gid, rel2, has_info=has_info, cu_seqlens=cu)
    assert torch.equal(a.per_reward[:4, 1], torch.zeros(4, dtype=torch.float64))
    assert torch.allclose(a.token, b.token, atol=1e-12)
    assert not torch.allclose(a.token, base.token)  # the change of rewards did matter


def test_relevance_concentrates_advantage():
    # one group, one reward with spans; relevance 1 on token 0 only
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    rel = torch.zeros(1, 6, dtype=torch.float64)
    rel[0, 0] = 1.0
    rel[0, 3] = 1.0
    out = mk.mrtpo_token_advantages(
        rewards, torch.tensor([0, 0]), rel, has_info=torch.ones(2, 1, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 3, 6]),
    )  # fmt: skip
    a = out.sequence
    assert torch.allclose(
        out.token, torch.stack([3 * a[0], 0 * a[0], 0 * a[0], 3 * a[1], 0 * a[1], 0 * a[1]])
    )


def test_uniform_when_relevance_below_delta():
    rewards = torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    rel = torch.zeros(1, 4, dtype=torch.float64)
    out = mk.mrtpo_token_advantages(
        rewards, torch.tensor([0, 0]), rel, has_info=torch.ones(2, 1, dtype=torch.bool),
        cu_seqlens=torch.tensor([0, 2, 4]),
    )  # fmt: skip
    assert torch.equal(out.allocation, torch.ones_like(rel))


def _all_zero_relevance_case():
    """Two groups; reward 1 (with spans) has an all-zero relevance on responses 0 and 3,
    and reward 0 on response 2; the rest is random."""
    rewards, gid, rel, cu, has_info = _batch(n_groups=2, g=3, k=2, seed=11)
    has_info[:] = True
    for k, i in ((1, 0), (1, 3), (0, 2)):
        rel[k, cu[i] : cu[i + 1]] = 0.0
    return rewards, gid, rel, cu, has_info


@pytest.mark.parametrize("delta", [0.0, 1e-8])
@pytest.mark.parametrize("clip", [None, (0.2, 3.0)])
def test_all_zero_relevance_is_uniform_whatever_delta(delta, clip):
    """METHOD.md section 4: an all-zero relevance falls back to uniform weights; delta = 0
    must not turn its mean of 0 into 0 / 0 (NaN token advantages)."""
    rewards, gid, rel, cu, has_info = _all_zero_relevance_case()
    out = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu,
                                    delta=delta, clip=clip, backend="torch")  # fmt: skip
    assert bool(out.token.isfinite().all()), out.token
    for k, i in ((1, 0), (1, 3), (0, 2)):
        assert torch.equal(out.allocation[k, cu[i] : cu[i + 1]],
                           torch.ones(int(cu[i + 1] - cu[i]), dtype=rel.dtype))  # fmt: skip
    ref_tok, _ = R.mrtpo_token_advantages_ref(rewards, gid, _split(rel, cu), has_info=has_info,
                                              delta=delta, clip=clip)  # fmt: skip
    assert bool(torch.cat(ref_tok).isfinite().all())
    assert torch.allclose(out.token, torch.cat(ref_tok), atol=1e-10)
    # mass: every response still sums to T_i x its GDPO advantage
    sums = torch.stack([t.sum() for t in _split(out.token, cu)])
    assert torch.allclose(sums, (cu[1:] - cu[:-1]).double() * out.sequence, atol=1e-9)


def _tiny_relevance_case(scale):
    """One group of 2 responses of 3 tokens, one reward with spans, relevance of a few
    units of ``scale`` (float32 subnormals at 1.4e-45)."""
    rel = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, 3.0]]) * scale
    return (torch.tensor([[1.0], [0.0]]), torch.tensor([0, 0]), rel,
            torch.tensor([0, 3, 6]), torch.ones(2, 1, dtype=torch.bool))  # fmt: skip


@pytest.mark.parametrize("scale", [1.401298464324817e-45, 2.0**-140, 2.0**-124, 1e-30])
def test_tiny_relevance_keeps_the_mass_at_delta_zero(scale):
    """A mean relevance below 2^-126 (float32 subnormal: d / mean is no exact ratio there,
    the weights' mean drifts from 1 and mass is lost) counts as zero: uniform. Above it the
    relevance is reallocated with the mass kept. Float32 and float64 inputs and the
    reference decide alike."""
    assert advantages.MEAN_FLOOR == R.MEAN_FLOOR == 2.0**-126
    rewards, gid, rel, cu, info = _tiny_relevance_case(scale)
    for dtype in (torch.float32, torch.float64):
        out = mk.mrtpo_token_advantages(rewards.to(dtype), gid, rel.to(dtype), has_info=info,
                                        cu_seqlens=cu, delta=0.0, backend="torch")  # fmt: skip
        sums = torch.stack([t.sum() for t in _split(out.token, cu)])
        assert torch.allclose(sums, 3 * out.sequence, rtol=1e-6), (dtype, out.token)
        ref, _ = R.mrtpo_token_advantages_ref(rewards.double(), gid,
                                              _split(rel.to(dtype).double(), cu),
                                              has_info=info, delta=0.0)  # fmt: skip
        assert torch.allclose(out.token.double(), torch.cat(ref), rtol=1e-6), (dtype, out.token)
        moved = bool((out.allocation != 1).any())
        assert moved == (scale * 4 / 3 >= 2.0**-126), (scale, out.allocation)


_TRITON_ZERO_REL = """
import torch
import mrtpo_kernels as mk
import test_advantages as A
rewards, gid, rel, cu, has_info = A._all_zero_relevance_case()
fails = 0
for delta in (0.0, 1e-8):
    for clip in (None, (0.2, 3.0)):
        for dtype in (torch.float32, torch.float64):
            kw = dict(has_info=has_info, cu_seqlens=cu, delta=delta, clip=clip)
            r = rewards.to(dtype)
            ours = mk.mrtpo_token_advantages(r, gid, rel.to(dtype), backend="triton", **kw)
            want = mk.mrtpo_token_advantages(r, gid, rel.to(dtype), backend="torch", **kw)
            ok = bool(ours.token.isfinite().all()) and torch.allclose(
                ours.token, want.token, atol=1e-5) and torch.equal(
                ours.allocation == 1, want.allocation == 1)
            if not ok:
                fails += 1
                print("FAIL", delta, clip, dtype, ours.token)
for scale in (1.401298464324817e-45, 2.0**-124):
    rewards, gid, rel, cu, has_info = A._tiny_relevance_case(scale)
    kw = dict(has_info=has_info, cu_seqlens=cu, delta=0.0)
    ours = mk.mrtpo_token_advantages(rewards, gid, rel, backend="triton", **kw)
    want = mk.mrtpo_token_advantages(rewards, gid, rel, backend="torch", **kw)
    if not torch.allclose(ours.token, want.token, rtol=1e-6):
        fails += 1
        print("FAIL tiny", scale, ours.token, want.token)
print(f"{fails} failures")
"""


def test_all_zero_relevance_is_uniform_on_triton_under_interpreter():
    pytest.importorskip("triton")
    from triton_cases._harness import run_interpreted

    run_interpreted("-c", _TRITON_ZERO_REL)


def test_padded_layout_equals_packed():
    rewards, gid, rel, cu, has_info = _batch(seed=7)
    n, k = rewards.shape
    lengths = cu[1:] - cu[:-1]
    t = int(lengths.max()) + 2
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask = mask.roll(1, dims=1)  # one leading pad column: layout need not be right-padded
    rel_p = torch.full((k, n, t), 0.77, dtype=torch.float64)
    rel_p[:, mask] = rel
    out_p = mk.mrtpo_token_advantages(rewards, gid, rel_p, has_info=has_info, response_mask=mask)
    out = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu)
    assert out_p.token.shape == (n, t)
    assert torch.equal(out_p.token[mask], out.token)
    assert torch.equal(out_p.token[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))


def test_float32_inputs_match_float64():
    rewards, gid, rel, cu, has_info = _batch(seed=8)
    a = mk.mrtpo_token_advantages(
        rewards.float(), gid, rel.float(), has_info=has_info, cu_seqlens=cu, gamma=2.0
    )
    b = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu, gamma=2.0)
    assert a.token.dtype == torch.float32
    assert torch.allclose(a.token.double(), b.token, atol=1e-5)


def test_nan_policy():
    rewards, gid, rel, cu, has_info = _batch(seed=9)
    rewards[2, 1] = float("nan")
    with pytest.raises(ValueError, match="rewards"):
        mk.gdpo_advantages(rewards, gid)
    out = mk.gdpo_advantages(rewards, gid, nan="zero")
    fixed = rewards.clone()
    fixed[2, 1] = 0.0
    assert torch.equal(out.per_reward, mk.gdpo_advantages(fixed, gid).per_reward)


def test_hyper_parameter_defaults_are_defined_once():
    """Every advantage op and its reference take their defaults from ADVANTAGE_DEFAULTS (a
    frozen AdvantageSettings): a keyword's default is the dataclass field's, nowhere
    restated."""
    import dataclasses
    import inspect

    d = mk.ADVANTAGE_DEFAULTS
    assert isinstance(d, mk.AdvantageSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.alpha = 0.5
    fields = {f.name for f in dataclasses.fields(d)}
    fns = (mk.gdpo_advantages, mk.mrtpo_token_advantages, R.gdpo_advantages_ref,
           R.mrtpo_token_advantages_ref)  # fmt: skip
    seen = set()
    for fn in fns:
        for name, p in inspect.signature(fn).parameters.items():
            if name in fields:
                assert p.default == getattr(d, name), (fn, name)
                seen.add(name)
    assert seen == fields
    assert (d.alpha, d.gamma, d.eps, d.eps_batch, d.batch_norm, d.delta, d.clip, d.nan) == (
        1.0,
        1.0,
        1e-6,
        None,
        "sequence",
        1e-8,
        None,
        "error",
    )  # METHOD.md's defaults
