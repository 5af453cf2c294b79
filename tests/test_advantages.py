"""gdpo_advantages, mrtpo_token_advantages and specific_relevance: every check of the
advantage ops in one place.

- CPU (torch and the reference): GDPO, the token reallocation, their invariants (mass,
  zero variance, all-zero and tiny relevance), the padded layout, NaN policy.
- Fuzz (hypothesis; shared machinery in tests/fuzzing.py): ``test_fuzz``, and the
  ``slow``-marked ``test_fuzz_long``.
- Triton under the interpreter (marker ``triton``; ``make test-triton``): TRITON_INTERPRET=1
  must be on before triton is imported, so the ``group_*`` functions below run one
  subprocess per group, started by tests/triton_cases/_harness.py (alpha, gamma and clip
  variants, mixed has_info, zero and negative relevance, the padded layout, float64, the
  mass invariant; all-zero and tiny relevance; torch.library.opcheck;
  torch.compile(fullgraph=True) with aot_eager). Error rule (README.md, "Numerics"): our
  error against float64 is at most 2x that of the "torch" backend in the same dtype, plus
  a small atol. The kernel also builds for sm_90.
- GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): 512 responses up to 4096 tokens
  against the float64 reference.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from fuzzing import (
    DTYPES,
    INJECT,
    _acc,
    _assert_matches,
    _body,
    _fmax,
    _inject,
    _names_an_argument,
    _scale,
    fuzz_tests,
)
from hypothesis import strategies as st
from test_js import _compile_for_hopper, _err, _nvidia_backend_present, _within_budget, gpu_test
from triton_cases._harness import (
    close,
    compile_check,
    expect,
    interpreted,
    needs_triton,
    opcheck,
    run_groups,
)

import mrtpo_kernels as mk
from mrtpo_kernels import advantages
from mrtpo_kernels import reference as R
from mrtpo_kernels.reference import mrtpo_token_advantages_ref


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


# --------------------------------------------------------------------------- scale_rewards

SCALES = ["group", "batch", "none"]


def test_scale_rewards_hand_computed_example():
    """METHOD.md section 1's three scalings written out on two groups of 3, one reward:
    r - group mean over the group std + eps ("group"), over the batch std of r + eps
    ("batch"), or alone ("none"); then S = A (K = 1) normalized over the batch."""
    r = torch.tensor([[1.0], [0.0], [0.0], [3.0], [1.0], [2.0]], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0], dtype=torch.float64)
    group_std = torch.tensor([math.sqrt(1 / 3)] * 3 + [1.0] * 3, dtype=torch.float64)
    eps = 1e-4
    want = {
        "group": centred / (group_std + eps),
        "batch": centred / (r[:, 0].std() + eps),  # unbiased std of all six rewards
        "none": centred,
    }
    for scale, a in want.items():
        out = mk.gdpo_advantages(r, gid, eps=eps, eps_batch=0.0, scale_rewards=scale)
        torch.testing.assert_close(out.per_reward[:, 0], a, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.sequence, (a - a.mean()) / a.std(), rtol=0, atol=1e-12)
        torch.testing.assert_close(out.mean, a.mean(), rtol=0, atol=1e-12)
        torch.testing.assert_close(out.std, a.std(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch_norm", ["sequence", "token"])
@pytest.mark.parametrize("scale_rewards", SCALES)
def test_scale_rewards_match_reference(scale_rewards, batch_norm):
    rewards, gid, rel, cu, has_info = _batch(seed=21)
    rewards[:, 1] *= 7.0  # rewards of different scales: the three variants differ
    lengths = cu[1:] - cu[:-1]
    w = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    kw = dict(weights=w, batch_norm=batch_norm, scale_rewards=scale_rewards)
    out = mk.gdpo_advantages(rewards, gid, lengths=lengths, **kw)
    ref = R.gdpo_advantages_ref(rewards, gid, lengths=lengths, **kw)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for backend in ("torch", None):  # None: the default backend for the device
        tok = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu,
                                        alpha=0.7, gamma=1.5, backend=backend, **kw)  # fmt: skip
        ref_tok, ref_g = mrtpo_token_advantages_ref(
            rewards, gid, _split(rel, cu), has_info=has_info, alpha=0.7, gamma=1.5, **kw
        )
        torch.testing.assert_close(tok.token, torch.cat(ref_tok), rtol=0, atol=1e-12)
        torch.testing.assert_close(tok.sequence, ref_g.sequence, rtol=0, atol=1e-12)
        # mass: sum_t A[i, t] = T_i x GDPO's sequence advantage, whichever the scaling
        sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(lengths)), lengths), tok.token
        )
        torch.testing.assert_close(sums, lengths * tok.sequence, rtol=0, atol=1e-10)
    others = [mk.gdpo_advantages(rewards, gid, lengths=lengths, **dict(kw, scale_rewards=o))
              for o in SCALES if o != scale_rewards]  # fmt: skip
    assert all((o.sequence - out.sequence).abs().max() > 1e-3 for o in others)


def test_scale_rewards_batch_is_group_for_one_group_and_none_is_unit_free():
    """One group in the batch: its std is the batch std, "batch" is "group". "none" keeps
    the rewards' units, so scaling every reward by a power of two scales its A_k and
    leaves the sequence and token advantages unchanged bit for bit (eps_batch = 0)."""
    rewards, gid, rel, cu, has_info = _batch(seed=22)
    one = torch.zeros_like(gid)
    g = mk.gdpo_advantages(rewards, one, scale_rewards="group")
    b = mk.gdpo_advantages(rewards, one, scale_rewards="batch")
    for x, y in zip(g, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    kw = dict(has_info=has_info, cu_seqlens=cu, eps_batch=0.0, scale_rewards="none")
    base = mk.mrtpo_token_advantages(rewards, gid, rel, **kw)
    for p in (-1000, -60, 60, 1000):  # float64: down to subnormal units, up to ~1e301
        scaled = mk.mrtpo_token_advantages(rewards * 2.0**p, gid, rel, **kw)
        assert torch.equal(scaled.token, base.token), p
        assert torch.equal(scaled.sequence, base.sequence), p
        assert torch.equal(scaled.per_reward, base.per_reward * 2.0**p), p
    # near the float maximum: S's sums would overflow in the rewards' units, not here
    big = rewards * (0.25 * torch.finfo(torch.float64).max)
    kw = dict(has_info=has_info, scale_rewards="none", weights=torch.full((3,), 1.5).double())
    out = mk.mrtpo_token_advantages(big, gid, rel, cu_seqlens=cu, **kw)
    assert bool(torch.isfinite(out.token).all()) and bool(torch.isfinite(out.sequence).all())
    ref_tok, _ = mrtpo_token_advantages_ref(big, gid, _split(rel, cu), **kw)
    torch.testing.assert_close(out.token, torch.cat(ref_tok), rtol=0, atol=1e-10)


@pytest.mark.parametrize("bad", [True, False, "Group", "std", None])
def test_scale_rewards_takes_the_three_names_only(bad):
    rewards, gid, rel, cu, has_info = _batch(seed=23)
    with pytest.raises(ValueError, match="^scale_rewards: "):
        mk.gdpo_advantages(rewards, gid, scale_rewards=bad)
    with pytest.raises(ValueError, match="^scale_rewards: "):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu,
                                  scale_rewards=bad)  # fmt: skip


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


def _cancelling_batch(seed=0):
    """The batch of a real run's step (SmolLM2, constraints, K = 3): group 0 passes every
    reward, in group 1 one response passes the keyword and fails the end phrase and its three
    mates the reverse, so A_keyword = -A_end and every S is 0 (std 0)."""
    rewards = torch.tensor(
        [[1.0, 1, 1]] * 4 + [[1.0, 1, 0], [1.0, 0, 1], [1.0, 0, 1], [1.0, 0, 1]],
        dtype=torch.float64,
    )
    gid = torch.tensor([0] * 4 + [1] * 4)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 30, (8,), generator=gen)
    cu = torch.zeros(9, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(3, int(cu[-1]), generator=gen, dtype=torch.float64) ** 4  # peaked
    return rewards, gid, rel, cu, torch.ones(8, 3, dtype=torch.bool)


@pytest.mark.parametrize("eps_batch", [0.0, 1e-6, 1e-3])
def test_rewards_cancelling_in_s_keep_the_redistribution_at_unit_scale(eps_batch):
    # every S equal: GDPO's advantages are 0, the token-level redistribution is not; its
    # divisor is floored at 1/2 the rewards-uncorrelated std (METHOD.md section 5) instead of
    # eps_batch alone (which gave |A| ~ 5e6 in that run; eps_batch = 0 dropped it)
    rewards, gid, rel, cu, has_info = _cancelling_batch()
    out = mk.mrtpo_token_advantages(
        rewards, gid, rel, has_info=has_info, cu_seqlens=cu, eps_batch=eps_batch
    )
    assert float(out.std) == 0.0 and torch.equal(out.sequence, torch.zeros(8, dtype=torch.float64))
    want, _ = mrtpo_token_advantages_ref(
        rewards, gid, _split(rel, cu), has_info=has_info, eps_batch=eps_batch
    )
    assert torch.allclose(out.token, torch.cat(want), rtol=1e-12, atol=1e-12)
    # each of A_keyword, A_end over the batch: (0 x4, +-1.5, -+0.5 x3), unbiased variance 3/7;
    # u = sqrt(6/7) (times 0.5 / (0.5 + eps_group) from the group std's eps), D = u / 2 + eps_batch
    d0 = float(out.per_reward.var(0).sum().sqrt()) / 2
    assert d0 == pytest.approx(math.sqrt(6 / 7) / 2, rel=1e-5)
    a = out.per_reward.abs().sum(1)  # |A_keyword| + |A_end| per response
    moved = [t for t in _split(out.token, cu)]
    for i in range(8):
        t_i = float(cu[i + 1] - cu[i])
        assert float(moved[i].abs().max()) <= float(a[i]) * t_i / d0 + 1e-9
        assert abs(float(moved[i].sum())) <= 1e-12 * t_i  # mass: T_i * 0
    assert float(out.token[cu[4] :].abs().max()) > 0.5  # group 1's credit still moves
    assert float(out.token[: cu[4]].abs().max()) == 0.0  # group 0's rewards do not vary
    # continuous in eps_batch (the divisor is d0 + eps_batch)
    ref0 = mk.mrtpo_token_advantages(
        rewards, gid, rel, has_info=has_info, cu_seqlens=cu, eps_batch=0.0
    )
    assert torch.allclose(out.token, ref0.token * d0 / (d0 + eps_batch), rtol=1e-12, atol=1e-15)


def test_cancellation_floor_is_inactive_for_correlated_rewards():
    # K identical reward columns (perfectly correlated): std = K * u / sqrt(K) >= u / 2, and the
    # token advantages are METHOD.md's (sum_k A_k w_k - mu) / (std + eps_batch) verbatim
    rewards, gid, rel, cu, has_info = _batch(seed=8)
    rewards = rewards[:, :1].repeat(1, 3)
    has_info[:] = True
    out = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu)
    w = out.allocation
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    literal = ((out.per_reward.T[:, seg] * w).sum(0) - out.mean) / (out.std + 1e-6)
    assert torch.allclose(out.token, literal, rtol=1e-12, atol=1e-12)


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


@interpreted
def test_all_zero_relevance_is_uniform_on_triton_under_interpreter():
    """group_zero_relevance below (all-zero and tiny relevance on the Triton kernel)."""
    run_groups(__file__, "zero_relevance")


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
    assert d.scale_rewards == "group"  # GDPO's per-group normalization


# --------------------------------------------------------------------------- fuzz


@st.composite
def _rewards_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = _scale(draw, dtype)
    # verifier-like scores: a few levels (pass/fail/partial), then scaled
    levels = torch.randint(0, 5, (n, k), generator=gen).double() / 4.0
    rewards = (levels * scale).clamp(-_fmax(dtype), _fmax(dtype)).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    if layout == "strided":
        big = torch.zeros((2 * n, k), dtype=dtype)
        big[::2] = rewards
        rewards = big[::2]
    elif layout == "transposed":
        rewards = rewards.t().contiguous().t()
    gsize = draw(st.integers(1, 4))
    group_ids = torch.arange(n) // gsize
    rewards = _inject(rewards, draw(INJECT), gen)
    weights = draw(st.sampled_from([None, "w", "bad"]))
    if weights == "w":
        weights = torch.rand(k, generator=gen, dtype=torch.float64).to(dtype) + 0.5
    elif weights == "bad":
        weights = torch.ones(k, dtype=dtype)
        weights[-1] = draw(st.sampled_from([math.nan, math.inf]))
    eps = draw(st.sampled_from([0.0, 1e-6]))
    eps_batch = draw(st.sampled_from([None, 0.0, 1e-6]))
    nan = draw(st.sampled_from(["error", "zero"]))
    return rewards, group_ids, weights, eps, eps_batch, nan, gen, draw


def _gdpo_ref_inputs(rewards, weights, nan):
    r = rewards.double()
    if nan == "zero":
        r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    return r, None if weights is None else weights.double()


def _rewards_bad(rewards, weights, nan):
    bad_r = nan == "error" and not bool(torch.isfinite(rewards).all())
    bad_w = weights is not None and not bool(torch.isfinite(weights).all())
    return bad_r or bad_w


def _adv_tol(rewards):
    """float32 (or float64) rounding of normalized quantities: O(n) terms of size O(sqrt n)."""
    eps = torch.finfo(_acc(rewards)).eps
    return 64 * eps * rewards.shape[0]


@_body(st.data())
def _gdpo_body(data):
    rewards, gid, weights, eps, eps_batch, nan, gen, draw = data.draw(_rewards_case())
    batch_norm = draw(st.sampled_from(["sequence", "token"]))
    n = rewards.shape[0]
    lengths = torch.randint(1, 6, (n,), generator=gen) if batch_norm == "token" else None
    bad_len = batch_norm == "token" and draw(st.booleans()) and draw(st.booleans())
    if bad_len:
        lengths = lengths.clone()
        lengths[0] = draw(st.sampled_from([0, -3]))
    scale_rewards = draw(st.sampled_from(["group", "batch", "none"]))
    fn = mk.gdpo_advantages
    kw = dict(weights=weights, eps=eps, eps_batch=eps_batch, batch_norm=batch_norm,
              lengths=lengths, scale_rewards=scale_rewards)  # fmt: skip
    try:
        out = fn(rewards, gid, nan=nan, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert _rewards_bad(rewards, weights, nan) or bad_len, f"ValueError on valid input: {e}"
        return
    assert not _rewards_bad(rewards, weights, nan) and not bad_len, "bad input accepted"
    r, w = _gdpo_ref_inputs(rewards, weights, nan)
    ref = R.gdpo_advantages_ref(r, gid, **dict(kw, weights=w))
    tol = _adv_tol(rewards)
    for name, a, b in zip(ref._fields, out, ref):
        assert not bool(a.isnan().any()), f"gdpo {name}: NaN for finite input"
        if name in ("mean", "std") or (name == "per_reward" and scale_rewards == "none"):
            # relative; "none" keeps the rewards' units: to the largest reward
            big = float(r.abs().max()) if scale_rewards == "none" else 1.0
            _assert_matches(a, b, b, f"gdpo {name}", atol=tol * big, rtol=tol)
        else:
            _assert_matches(a, b, b, f"gdpo {name}", atol=tol, rtol=0)


def _relevance_case(draw, gen, n, k, dtype):
    lengths = torch.randint(1, 5, (n,), generator=gen)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(k, int(cu[-1]), generator=gen, dtype=torch.float64)
    if draw(st.booleans()):  # exact zeros: delta / uniform fallbacks
        rel[rel < 0.3] = 0.0
    rel = rel.to(dtype)
    bad = draw(st.sampled_from([None, None, None, "nan", "inf", "neg"]))
    if bad:
        rel = rel.clone()
        rel[0, 0] = {"nan": math.nan, "inf": math.inf, "neg": -0.5}[bad]
    has_info = torch.rand(n, k, generator=gen) < 0.7
    return rel, cu, has_info, bad


@_body(st.data())
def _token_adv_body(data):
    rewards, gid, weights, eps, eps_batch, nan, gen, draw = data.draw(_rewards_case())
    n, k = rewards.shape if rewards.dim() == 2 else (rewards.shape[0], 1)
    rel, cu, has_info, bad_rel = _relevance_case(draw, gen, n, k, rewards.dtype)
    padded = draw(st.booleans())
    alpha = draw(st.sampled_from([0.0, 0.5, 1.0]))
    gamma = draw(st.sampled_from([1.0, 2.0, 0.5]))
    clip = draw(st.sampled_from([None, (0.5, 2.0), (0.5,), (1.5, 2.0)]))
    batch_norm = draw(st.sampled_from(["sequence", "token"]))
    scale_rewards = draw(st.sampled_from(["group", "batch", "none"]))
    kw = dict(weights=weights, eps=eps, eps_batch=eps_batch, alpha=alpha, gamma=gamma,
              clip=clip, batch_norm=batch_norm, scale_rewards=scale_rewards)  # fmt: skip
    fn = mk.mrtpo_token_advantages
    lengths = cu[1:] - cu[:-1]
    if padded:
        t = int(lengths.max())
        mask = torch.arange(t)[None, :] < lengths[:, None]
        rel_in = torch.full((k, n, t), math.nan, dtype=rel.dtype)  # padding is never read
        rel_in[:, mask] = rel
        args = dict(response_mask=mask)
    else:
        rel_in, args = rel, dict(cu_seqlens=cu)
    bad_clip = clip is not None and (len(clip) != 2 or clip[0] > 1)
    try:
        out = fn(rewards, gid, rel_in, has_info=has_info, nan=nan, **args, **kw)
    except ValueError as e:
        assert _names_an_argument(e, fn), str(e)
        assert _rewards_bad(rewards, weights, nan) or bad_rel or bad_clip, f"valid input: {e}"
        return
    assert not (_rewards_bad(rewards, weights, nan) or bad_rel or bad_clip), "accepted"
    r, w = _gdpo_ref_inputs(rewards, weights, nan)
    rel_list = [rel[:, int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    tok_ref, g_ref = R.mrtpo_token_advantages_ref(r, gid, rel_list, has_info=has_info,
                                                 **dict(kw, weights=w))  # fmt: skip
    tok = out.token[mask] if padded else out.token
    tol = _adv_tol(rewards) * (1 + 4 * k)
    what = f"mrtpo_token_advantages[{rewards.dtype}, padded={padded}]"
    assert not bool(tok.isnan().any()), f"{what}: NaN for finite input"
    # token values are O(per_reward * w_hat): w_hat up to T / (its share of the mass)
    w_max = max(1.0, float(lengths.max()))
    ref_cat = torch.cat(tok_ref)
    _assert_matches(tok, ref_cat, ref_cat, what, atol=tol * w_max * 8, rtol=tol)
    _assert_matches(out.sequence, g_ref.sequence, g_ref.sequence, what + " seq", atol=tol)


@_body(st.data())
def _specific_body(data):
    draw = data.draw
    dtype = draw(st.sampled_from(DTYPES))
    n, k = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    rel, cu, has_info, bad = _relevance_case(draw, gen, n, k, dtype)
    control = None
    if draw(st.booleans()):
        control = torch.rand(rel.shape[1], generator=gen).to(dtype)
    try:
        out = mk.specific_relevance(rel, has_info, control=control, cu_seqlens=cu)
    except ValueError as e:
        assert _names_an_argument(e, mk.specific_relevance), str(e)
        assert bad == "inf", f"ValueError on valid input: {e}"
        return
    assert bad != "inf", "infinite relevance accepted"
    rel_list = [rel[:, int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    ctl = None
    if control is not None:
        ctl = [control[int(cu[i]) : int(cu[i + 1])].double() for i in range(n)]
    ref = torch.cat(R.specific_relevance_ref(rel_list, has_info, control=ctl), dim=1)
    plain = torch.cat(R.specific_relevance_ref(
        [rel[:, int(cu[i]) : int(cu[i + 1])] for i in range(n)], has_info,
        control=None if control is None else [control[int(cu[i]) : int(cu[i + 1])]
                                              for i in range(n)]), dim=1)  # fmt: skip
    what = f"specific_relevance[{dtype}, bad={bad}]"
    eps = torch.finfo(dtype).eps
    _assert_matches(out, ref, plain, what, atol=4 * eps, rtol=4 * eps)


FUZZ = {
    "gdpo_advantages": _gdpo_body,
    "mrtpo_token_advantages": _token_adv_body,
    "specific_relevance": _specific_body,
}

test_fuzz, test_fuzz_long = fuzz_tests(FUZZ)


# ----------------------------------------------------------- Triton (interpreter, sm_90 build)


TRITON_GROUPS = ["packed", "opcheck", "compile"]  # one subprocess each


@interpreted
@pytest.mark.parametrize("group", TRITON_GROUPS)
def test_triton_advantages_under_interpreter(group):
    run_groups(__file__, group)


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_advantages_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.triton_kernels import advantages

    with pytest.raises(ValueError, match="relevance"):
        advantages.mrtpo_token_advantages(
            torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool),
            torch.rand(1, 4), torch.tensor([0, 4]), torch.zeros(1), torch.tensor(1.0), 1.0,
            1.0, 1e-8, 0.0, float("inf"),
        )  # fmt: skip


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton's NVIDIA backend is absent")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled mode")
def test_triton_advantages_kernel_compiles_for_hopper():
    from mrtpo_kernels.triton_kernels import advantages

    for dt in ("fp32", "fp64"):
        sig = {name: f"*{dt}" for name in ("per_reward_ptr", "lam_ptr")}
        sig.update(has_info_ptr="*u8", rel_ptr=f"*{dt}", cu_ptr="*i64", seq_ptr=f"*{dt}")
        sig.update(div_ptr=f"*{dt}", params_ptr=f"*{dt}", token_ptr=f"*{dt}")
        sig.update(alloc_ptr=f"*{dt}", K="i32", N="i32", GAMMA_ONE="constexpr")
        sig.update(HAS_CLIP="constexpr", BLOCK_K="constexpr", BLOCK_T="constexpr")
        for gamma_one, clip in ((True, False), (False, True)):
            _compile_for_hopper(
                advantages._reallocate_kernel, sig,
                {"GAMMA_ONE": gamma_one, "HAS_CLIP": clip, "BLOCK_K": 4, "BLOCK_T": 256},
                num_warps=4,
            )  # fmt: skip


# --------------------------------------------------------------------------- reallocation


def _packed_batch(lengths, k, seed, has_frac=0.7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    n = lengths.numel()
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    rewards = torch.randn(n, k, generator=g)
    group_ids = torch.arange(n) // 4
    rel = torch.rand(k, int(cu[-1]), generator=g)
    has_info = torch.rand(n, k, generator=g) < has_frac
    return rewards, group_ids, rel, has_info, cu


def _realloc_case(lengths, k, *, seed=0, dtype=torch.float32, tag="", edit=None, **kw):
    rewards, gid, rel, has_info, cu = _packed_batch(lengths, k, seed)
    if edit is not None:
        edit(rewards, rel, has_info, cu)
    rewards, rel = rewards.to(dtype), rel.to(dtype)
    n = len(lengths)
    name = f"reallocate n={n} k={k} {dtype} {kw}{tag}"
    args = (rewards, gid, rel)
    ours = mk.mrtpo_token_advantages(*args, has_info=has_info, cu_seqlens=cu, backend="triton",
                                     **kw)  # fmt: skip
    plain = mk.mrtpo_token_advantages(*args, has_info=has_info, cu_seqlens=cu, backend="torch",
                                      **kw)  # fmt: skip
    spans = [rel[:, cu[i] : cu[i + 1]].double() for i in range(n)]
    ref_tok, ref_g = mrtpo_token_advantages_ref(rewards.double(), gid, spans, has_info=has_info,
                                                **kw)  # fmt: skip
    atol = 1e-12 if dtype == torch.float64 else 2e-6
    close(name + " token", ours.token, torch.cat(ref_tok), plain.token, atol=atol, rtol=0)
    close(name + " allocation", ours.allocation, plain.allocation, plain.allocation,
          atol=atol * 4, rtol=0)  # fmt: skip
    # Mass: each reward's weights average 1 over a response; sum_t A = T_i x GDPO advantage.
    lengths_t = (cu[1:] - cu[:-1]).double()
    seg = torch.repeat_interleave(torch.arange(n), cu[1:] - cu[:-1])
    w_sum = torch.zeros(k, n, dtype=torch.float64).index_add_(1, seg, ours.allocation.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    expect(name + " weights mean 1", bool(((w_sum / lengths_t - 1).abs() <= tol).all()),
          f"max dev {(w_sum / lengths_t - 1).abs().max():.3e}")  # fmt: skip
    a_sum = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, ours.token.double())
    mass = lengths_t * ref_g.sequence.double()
    dev = (a_sum - mass).abs().max().item()
    expect(name + " mass", dev <= tol * (1 + mass.abs().max().item()), f"max dev {dev:.3e}")
    return ours, ref_g, cu


def group_packed():
    lengths = [5, 1, 17, 40, 3, 9, 2500, 7, 33, 1, 64, 12]
    _realloc_case(lengths, 3)
    _realloc_case(lengths, 3, alpha=0.3, gamma=2.0, seed=1)
    _realloc_case(lengths, 3, alpha=0.7, gamma=0.5, clip=(0.2, 3.0), seed=2)
    _realloc_case(lengths, 3, clip=(0.0, 2.0), seed=3, dtype=torch.float64)
    _realloc_case(lengths, 5, gamma=1.5, batch_norm="token", seed=4, weights=None)
    _realloc_case([4, 9, 1, 30, 6, 2, 8, 8], 1, seed=5, weights=torch.tensor([0.5]))

    def zero_spans(rewards, rel, has_info, cu):
        has_info[:, 1] = False  # a reward whose verifier reads no span: plain GDPO broadcast
        rel[0, cu[2] : cu[3]] = 0.0  # mean d below delta: uniform weights
        rel[2, cu[5] : cu[6]] = 1e-9  # a span of tiny relevance (mean d below delta)
        rewards[:4, 0] = 1.0  # zero variance in group 0 for reward 0: moves nothing

    _realloc_case(lengths, 3, seed=6, edit=zero_spans, alpha=0.8, tag=" edge cases")
    # scale_rewards: "batch" and "none" (the kernels get D whole and eps_batch 0)
    _realloc_case(lengths, 3, seed=11, alpha=0.6, scale_rewards="batch")
    _realloc_case(lengths, 3, seed=12, alpha=0.6, gamma=1.5, scale_rewards="none")
    _realloc_case(lengths, 3, seed=13, dtype=torch.float64, scale_rewards="none")
    # relevance is a distance: a negative value is a ValueError naming it (both backends)
    rewards, gid, rel, has_info, cu = _packed_batch(lengths, 3, 6)
    rel[2, cu[5]] = -1e-3
    for backend in ("triton", "torch"):
        try:
            mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu,
                                      backend=backend)  # fmt: skip
            raised = ""
        except ValueError as exc:
            raised = str(exc)
        expect(f"reallocate negative relevance raises ({backend})", "relevance" in raised,
              raised or "no error")  # fmt: skip
    # alpha = 0: every token gets the GDPO sequence advantage of its response.
    ours, g, cu = _realloc_case(lengths, 3, seed=7, alpha=0.0)
    seq = torch.repeat_interleave(g.sequence, cu[1:] - cu[:-1]).double()
    dev = (ours.token.double() - seq).abs().max().item()
    expect("reallocate alpha=0 is GDPO", dev <= 1e-5, f"max dev {dev:.3e}")
    # ... bit for bit against the op's own sequence advantages: the kernel adds exactly 0
    own = torch.repeat_interleave(ours.sequence.to(ours.token.dtype), cu[1:] - cu[:-1])
    expect("reallocate alpha=0 is GDPO bit for bit", torch.equal(ours.token, own),
           f"max dev {(ours.token - own).abs().max():.3e}")  # fmt: skip
    # padded layout (K, n, T) with a response mask
    rewards, gid, rel, has_info, _ = _packed_batch([1] * 6, 2, 8)
    rel_p = torch.rand(2, 6, 11, generator=torch.Generator().manual_seed(10))
    mask = torch.zeros(6, 11, dtype=torch.bool)
    for i, t in enumerate([11, 3, 7, 1, 10, 5]):
        mask[i, :t] = True
    kw = dict(has_info=has_info, response_mask=mask, alpha=0.9)
    ours = mk.mrtpo_token_advantages(rewards, gid, rel_p, backend="triton", **kw)
    plain = mk.mrtpo_token_advantages(rewards, gid, rel_p, backend="torch", **kw)
    spans = [rel_p[:, i, mask[i]].double() for i in range(6)]
    ref_tok, _ = mrtpo_token_advantages_ref(rewards.double(), gid, spans, has_info=has_info,
                                            alpha=0.9)  # fmt: skip
    close("reallocate padded", ours.token[mask], torch.cat(ref_tok), plain.token[mask],
          atol=2e-6, rtol=0)  # fmt: skip
    expect("reallocate padded zeros", bool((ours.token[~mask] == 0).all()), "nonzero padding")


def group_opcheck():
    g = torch.Generator().manual_seed(9)
    rel = torch.rand(2, 12, generator=g)
    cu = torch.tensor([0, 3, 4, 12])
    per = torch.randn(3, 2, generator=g)
    has = torch.tensor([[True, False], [True, True], [False, True]])
    seq, divisor = torch.randn(3, generator=g), torch.tensor(1.3)
    args = (per, torch.ones(2), has, rel, cu, seq, divisor, 0.7, 1.5, 1e-8, 0.1, 4.0, "triton")
    opcheck("mrtpo_token_advantages", torch.ops.mrtpo.mrtpo_token_advantages.default, args)


def group_compile():
    """torch.compile(fullgraph=True) of a caller traces the op without a graph break."""
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(4, 2, generator=g)
    rel = torch.rand(2, 10, generator=g)
    cu = torch.tensor([0, 3, 4, 9, 10])
    has = torch.tensor([[True, False], [True, True], [False, True], [True, True]])

    def realloc(rewards, rel):
        return mk.mrtpo_token_advantages(
            rewards, torch.tensor([0, 0, 1, 1]), rel, has_info=has, cu_seqlens=cu,
            alpha=0.5, backend="triton",
        ).token  # fmt: skip

    compile_check("advantages", realloc, (rewards, rel))


def group_zero_relevance():
    """All-zero relevance is uniform whatever delta, tiny relevance keeps the mass at
    delta 0: the Triton kernel as the torch backend (test_all_zero_relevance_is_uniform_
    whatever_delta, test_tiny_relevance_keeps_the_mass_at_delta_zero)."""
    rewards, gid, rel, cu, has_info = _all_zero_relevance_case()
    for delta in (0.0, 1e-8):
        for clip in (None, (0.2, 3.0)):
            for dtype in (torch.float32, torch.float64):
                kw = dict(has_info=has_info, cu_seqlens=cu, delta=delta, clip=clip)
                r = rewards.to(dtype)
                ours = mk.mrtpo_token_advantages(r, gid, rel.to(dtype), backend="triton", **kw)
                want = mk.mrtpo_token_advantages(r, gid, rel.to(dtype), backend="torch", **kw)
                ok = (
                    bool(ours.token.isfinite().all())
                    and torch.allclose(ours.token, want.token, atol=1e-5)
                    and torch.equal(ours.allocation == 1, want.allocation == 1)
                )
                expect(f"zero relevance delta={delta} clip={clip} {dtype}", ok, str(ours.token))
    for scale in (1.401298464324817e-45, 2.0**-124):
        rewards, gid, rel, cu, has_info = _tiny_relevance_case(scale)
        kw = dict(has_info=has_info, cu_seqlens=cu, delta=0.0)
        ours = mk.mrtpo_token_advantages(rewards, gid, rel, backend="triton", **kw)
        want = mk.mrtpo_token_advantages(rewards, gid, rel, backend="torch", **kw)
        ok = torch.allclose(ours.token, want.token, rtol=1e-6)
        expect(f"tiny relevance {scale}", ok, f"{ours.token} != {want.token}")


GROUPS = {k[len("group_") :]: f for k, f in sorted(globals().items()) if k.startswith("group_")}


# --------------------------------------------------------------------------- GPU


@gpu_test
def test_gpu_reallocate_matches_reference():
    g = torch.Generator(device="cuda").manual_seed(3)
    n, k = 512, 4
    lengths = torch.randint(1, 4096, (n,), device="cuda", generator=g)
    cu = torch.zeros(n + 1, dtype=torch.long, device="cuda")
    cu[1:] = torch.cumsum(lengths, 0)
    rewards = torch.randn(n, k, device="cuda", generator=g)
    gid = torch.arange(n, device="cuda") // 8
    rel = torch.rand(k, int(cu[-1]), device="cuda", generator=g)
    has = torch.rand(n, k, device="cuda", generator=g) < 0.7
    kw = dict(has_info=has, cu_seqlens=cu, alpha=0.8, gamma=1.5, clip=(0.1, 5.0))
    ours = mk.mrtpo_token_advantages(rewards, gid, rel, backend="triton", **kw)
    plain = mk.mrtpo_token_advantages(rewards, gid, rel, backend="torch", **kw)
    spans = [rel[:, cu[i] : cu[i + 1]].double().cpu() for i in range(n)]
    kw.pop("cu_seqlens")
    kw["has_info"] = has.cpu()
    ref, _ = mrtpo_token_advantages_ref(rewards.double().cpu(), gid.cpu(), spans, **kw)
    _within_budget(ours.token.cpu(), torch.cat(ref), plain.token.cpu(), atol=1e-5)
    assert _err(ours.allocation, plain.allocation) <= 1e-4


def test_sequence_advantage_is_zero_where_every_s_counts_as_equal():
    # the two rewards cancel in S (equal in exact arithmetic, apart by rounding in the last
    # bits at these magnitudes): the batch is flat, so each sequence advantage is 0 as in the
    # reference, not the rounding over eps_batch (it was ~1e-10, found by test_fuzz_long)
    r = torch.tensor([[7.5e29, 5e29], [2.5e29, 1e30]], dtype=torch.float64)
    gid = torch.tensor([0, 0])
    got = mk.gdpo_advantages(r, gid, eps=1e-6)
    ref = R.gdpo_advantages_ref(r, gid, eps=1e-6)
    assert torch.equal(ref.sequence, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(got.sequence, ref.sequence)
    assert float(got.std) == 0.0
