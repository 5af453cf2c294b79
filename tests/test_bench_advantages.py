"""Micro-benchmarks of the advantage stage (pytest-benchmark), each checked against the
float64 reference on the inputs it times.

`make test` runs them once as plain tests (pyproject's addopts has --benchmark-disable);
to time them and compare with a saved run:
    pytest tests/test_bench_advantages.py --benchmark-enable --benchmark-autosave
    pytest tests/test_bench_advantages.py --benchmark-enable --benchmark-compare
"""

from __future__ import annotations

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import reference as ref

# responses x tokens each (uneven lengths), K rewards: small enough for the float64
# reference loops, large enough that the per-token work dominates the call overhead
N_RESP, MAX_LEN, K, GROUP = 128, 512, 4, 8

# the CPU backends that implement the advantage stage
ADV_BACKENDS = [
    b for b in ("torch", "cpu") if b in mk.available_backends("mrtpo_token_advantages", "cpu")
]


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(MAX_LEN // 4, MAX_LEN + 1, (N_RESP,), generator=g)
    cu = torch.zeros(N_RESP + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    rewards = torch.rand(N_RESP, K, generator=g).round()
    rewards[:, 0] = torch.rand(N_RESP, generator=g)  # one continuous reward
    group_ids = torch.arange(N_RESP) // GROUP
    has_info = torch.rand(N_RESP, K, generator=g) < 0.75
    relevance = torch.rand(K, int(cu[-1]), generator=g) ** 2
    return rewards, group_ids, has_info, relevance, cu, lengths


def _reference(batch, alpha, gamma):
    rewards, group_ids, has_info, relevance, cu, _ = batch
    rel = [relevance[:, cu[i] : cu[i + 1]].double() for i in range(N_RESP)]
    tokens, g = ref.mrtpo_token_advantages_ref(
        rewards.double(), group_ids, rel, has_info=has_info, alpha=alpha, gamma=gamma
    )
    return torch.cat(tokens), g


def test_bench_gdpo_advantages(benchmark, batch):
    rewards, group_ids = batch[0], batch[1]
    out = benchmark(mk.gdpo_advantages, rewards, group_ids)
    expect = ref.gdpo_advantages_ref(rewards.double(), group_ids)
    torch.testing.assert_close(out.per_reward.double(), expect.per_reward, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.sequence.double(), expect.sequence, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ADV_BACKENDS)
@pytest.mark.parametrize("alpha,gamma", [(1.0, 1.0), (0.5, 2.0)])
def test_bench_token_advantages_packed(benchmark, batch, backend, alpha, gamma):
    rewards, group_ids, has_info, relevance, cu, lengths = batch
    out = benchmark(
        mk.mrtpo_token_advantages,
        rewards,
        group_ids,
        relevance,
        has_info=has_info,
        cu_seqlens=cu,
        alpha=alpha,
        gamma=gamma,
        backend=backend,
    )
    expect, g = _reference(batch, alpha, gamma)
    torch.testing.assert_close(out.token.double(), expect, atol=2e-5, rtol=1e-4)
    # mass invariant: each response's token advantages sum to T_i x its GDPO advantage
    seg = torch.repeat_interleave(torch.arange(N_RESP), lengths)
    sums = torch.zeros(N_RESP, dtype=torch.float64).index_add_(0, seg, out.token.double())
    torch.testing.assert_close(sums, lengths.double() * g.sequence, atol=2e-3, rtol=1e-4)


def test_bench_token_advantages_padded(benchmark, batch):
    rewards, group_ids, has_info, relevance, cu, lengths = batch
    mask = torch.arange(MAX_LEN)[None, :] < lengths[:, None]
    padded = torch.zeros(K, N_RESP, MAX_LEN)
    padded[:, mask] = relevance
    out = benchmark(
        mk.mrtpo_token_advantages, rewards, group_ids, padded, has_info=has_info, response_mask=mask
    )
    expect, _ = _reference(batch, 1.0, 1.0)
    torch.testing.assert_close(out.token[mask].double(), expect, atol=2e-5, rtol=1e-4)
    assert bool((out.token[~mask] == 0).all())
