"""Sharper relevance (METHOD.md section 3b): ``specific_relevance`` against its float64
reference, by hand, and the section 5 invariants when its output drives the allocation."""

from __future__ import annotations

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R


def _batch(n_groups=3, g=4, k=4, seed=0, max_len=8):
    gen = torch.Generator().manual_seed(seed)
    n = n_groups * g
    rewards = torch.randint(0, 2, (n, k), generator=gen).double()
    group_ids = torch.arange(n_groups).repeat_interleave(g)
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rel = torch.rand(k, int(cu[-1]), generator=gen, dtype=torch.float64)
    ctrl = torch.rand(int(cu[-1]), generator=gen, dtype=torch.float64) * 0.5
    has_info = torch.rand(n, k, generator=gen) > 0.3
    has_info[:, 0] = False  # a reward that reads no span
    has_info[0] = torch.tensor([False, True, False, False])  # only one reward with spans
    return rewards, group_ids, rel, ctrl, cu, has_info


def _split(x, cu):
    return [x[..., cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


def _pad(x, cu):
    """(K, N) packed -> (K, n, T) padded (and the mask), or (N,) -> (n, T)."""
    lengths = cu[1:] - cu[:-1]
    n, t = len(lengths), int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]
    out = torch.full((*x.shape[:-1], n, t), -7.0, dtype=x.dtype)
    out[..., mask] = x
    return out, mask


@pytest.mark.parametrize("mode", ["specific", "control"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_packed_and_padded(mode, seed):
    _, _, rel, ctrl, cu, has_info = _batch(seed=seed)
    control = ctrl if mode == "control" else None
    got = mk.specific_relevance(rel, has_info, control=control, cu_seqlens=cu)
    ref = R.specific_relevance_ref(
        _split(rel, cu), has_info, control=None if control is None else _split(ctrl, cu)
    )
    assert got.shape == rel.shape and got.dtype == rel.dtype
    assert torch.allclose(got, torch.cat(ref, dim=-1), atol=1e-12, rtol=0)
    rel_p, mask = _pad(rel, cu)
    ctrl_p = _pad(ctrl, cu)[0] if control is not None else None
    got_p = mk.specific_relevance(rel_p, has_info, control=ctrl_p)
    assert torch.allclose(got_p[:, mask], got, atol=1e-12, rtol=0)


def test_specific_by_hand():
    # one response of 2 tokens, K = 3, all with spans
    d = torch.tensor([[0.5, 0.1], [0.2, 0.4], [0.2, 0.1]], dtype=torch.float64)
    info = torch.tensor([[True, True, True]])
    cu = torch.tensor([0, 2])
    got = mk.specific_relevance(d, info, cu_seqlens=cu)
    expect = torch.tensor([[0.3, 0.0], [0.0, 0.3], [0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(got, expect, atol=1e-15)
    # reward 2 without spans: it keeps d_2 and leaves the others' mean
    info = torch.tensor([[True, True, False]])
    got = mk.specific_relevance(d, info, cu_seqlens=cu)
    expect = torch.tensor([[0.3, 0.0], [0.0, 0.3], [0.2, 0.1]], dtype=torch.float64)
    assert torch.allclose(got, expect, atol=1e-15)
    # a single reward with spans: r = d
    info = torch.tensor([[False, True, False]])
    assert torch.equal(mk.specific_relevance(d, info, cu_seqlens=cu), d)


def test_control_by_hand():
    d = torch.tensor([[0.5, 0.1], [0.2, 0.4]], dtype=torch.float64)
    ctrl = torch.tensor([0.3, 0.2], dtype=torch.float64)
    got = mk.specific_relevance(
        d, torch.tensor([[True, False]]), control=ctrl, cu_seqlens=torch.tensor([0, 2])
    )
    expect = torch.tensor([[0.2, 0.0], [0.2, 0.4]], dtype=torch.float64)
    assert torch.allclose(got, expect, atol=1e-15)


@pytest.mark.parametrize("mode", ["specific", "control"])
@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_section5_invariants_hold(mode, gamma):
    rewards, gid, rel, ctrl, cu, has_info = _batch(seed=3)
    r = mk.specific_relevance(
        rel, has_info, control=ctrl if mode == "control" else None, cu_seqlens=cu
    )
    assert bool((r >= 0).all())
    g = mk.gdpo_advantages(rewards, gid)
    lengths = (cu[1:] - cu[:-1]).double()
    # alpha = 0 is GDPO at every token
    a0 = mk.mrtpo_token_advantages(rewards, gid, r, has_info=has_info, cu_seqlens=cu, alpha=0.0)
    assert torch.allclose(a0.token, g.sequence.repeat_interleave(cu[1:] - cu[:-1]), atol=1e-12)
    # mass: sum_t A[i, t] = T_i x GDPO advantage
    a1 = mk.mrtpo_token_advantages(rewards, gid, r, has_info=has_info, cu_seqlens=cu, gamma=gamma)
    sums = torch.stack([x.sum() for x in _split(a1.token, cu)])
    assert torch.allclose(sums, lengths * g.sequence, atol=1e-9)
    ref, _ = R.mrtpo_token_advantages_ref(
        rewards, gid, _split(r, cu), has_info=has_info, gamma=gamma
    )
    assert torch.allclose(a1.token, torch.cat(ref), atol=1e-12)


def test_all_zero_falls_back_to_uniform():
    # every reward moves every token alike: the specific part is 0 everywhere -> uniform
    n, k, t = 4, 3, 5
    rel = torch.full((k, n * t), 0.4, dtype=torch.float64)
    info = torch.ones(n, k, dtype=torch.bool)
    cu = torch.arange(n + 1) * t
    r = mk.specific_relevance(rel, info, cu_seqlens=cu)
    assert torch.equal(r, torch.zeros_like(rel))
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = mk.mrtpo_token_advantages(
        rewards.double(), torch.zeros(n, dtype=torch.long), r, has_info=info, cu_seqlens=cu
    )
    assert torch.equal(out.allocation, torch.ones_like(rel))
    # control equal to d: all zero too
    r = mk.specific_relevance(rel, info, control=rel[0], cu_seqlens=cu)
    assert torch.equal(r, torch.zeros_like(rel))


def test_float32_close_to_float64_and_nan_stays():
    _, _, rel, _, cu, has_info = _batch(seed=5)
    got = mk.specific_relevance(rel.float(), has_info, cu_seqlens=cu)
    ref = mk.specific_relevance(rel, has_info, cu_seqlens=cu)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, atol=1e-6)
    bad = rel.clone()
    bad[1, 0] = float("nan")
    info = torch.ones_like(has_info)
    out = mk.specific_relevance(bad, info, cu_seqlens=cu)
    assert bool(out[:, 0].isnan().all())  # d_1 enters every other reward's baseline


def test_bad_input_names_the_argument():
    _, _, rel, ctrl, cu, has_info = _batch()
    with pytest.raises(ValueError, match="has_info"):
        mk.specific_relevance(rel, has_info[:, :2], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mk.specific_relevance(rel, has_info)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mk.specific_relevance(rel, has_info, cu_seqlens=cu[:-1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        bad = cu.clone()
        bad[-1] += 1
        mk.specific_relevance(rel, has_info, cu_seqlens=bad)
    with pytest.raises(ValueError, match="control"):
        mk.specific_relevance(rel, has_info, control=ctrl[:-1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="relevance"):
        mk.specific_relevance(rel[0], has_info, cu_seqlens=cu)
    with pytest.raises(ValueError, match="relevance"):
        mk.specific_relevance(rel.long(), has_info, cu_seqlens=cu)
