"""The low-memory backward's centred dh GEMM (backends/_chunk_backward._Centred): dh += G (W - c)
with c the mean of the head's rows at the labels. Exact in exact arithmetic because every
row of G sums to zero (an op of the log-softmax); more accurate in fp32 where the head's rows
share a large component (logits ~1e4). The low-memory mode is the column kernel's
(GRAD_COLS: Triton, CUDA); its accuracy at logits ~1e4 against float64 is checked under the
interpreter in tests/triton_cases/clip_extreme_cases.py ("extreme"). Here the helper's
rules on their own, and the chunk driver with a float64 column kernel: centred only where
the caller promises the zero sums (not the vocabulary-parallel shard's entropy term)."""

from __future__ import annotations

import pytest
import torch

from mrtpo_kernels._types import LogitCap
from mrtpo_kernels.backends._chunk_backward import _Centred
from mrtpo_kernels.backends.contract import RowKernel

II = -100


class _Head:  # what _Centred reads of backends._lm_head.Head
    def __init__(self, weight, cap=None, low=False):
        self.weight, self.cap, self.low = weight, cap or LogitCap(), low


def test_centre_is_the_mean_of_the_label_rows_and_skipped_where_it_must_be():
    w = torch.randn(10, 3)
    lab = torch.tensor([2, 2, 5, II, 10, -1])  # 10 and -1: outside the vocabulary
    c = _Centred(_Head(w), lab, II, 1 << 20)
    torch.testing.assert_close(c.c, (2 * w[2] + w[5]) / 3)
    assert _Centred(_Head(w), torch.full((4,), II), II, 1 << 20).c is None  # no label
    assert _Centred(_Head(w, LogitCap(softcap=30.0)), lab, II, 1 << 20).c is None
    assert _Centred(_Head(w, LogitCap(scale=0.5)), lab, II, 1 << 20).c is not None
    assert _Centred(_Head(w, low=True), lab, II, 1 << 20).c is None  # 16-bit mode
    w_inf = w.clone()
    w_inf[5, 1] = float("inf")
    assert _Centred(_Head(w_inf), lab, II, 1 << 20).c is None  # not finite


@pytest.mark.parametrize("budget", [4 * 3 * 7, 1 << 20])  # blocks of 7 rows, and one block
def test_centred_addmm_equals_plain_when_rows_of_g_sum_to_zero(budget):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    g = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    g -= g.mean(1, keepdim=True)  # each row sums to zero, as a log-softmax op's gradient
    lab = torch.tensor([3, 7, 7, 30, II])
    cen = _Centred(_Head(w), lab, II, budget)
    assert cen.c is not None and cen.c.dtype == torch.float64
    dh = torch.full((5, 3), 0.25, dtype=torch.float64)
    cen.addmm_(dh, g, w)
    torch.testing.assert_close(dh, 0.25 + g @ w, rtol=1e-12, atol=1e-12)
    if budget < 1 << 20:
        assert cen.block.shape[0] == 7  # the centred block stays within its budget


class _Float64Cols(RowKernel):
    """GRAD_COLS in float64 by the contract's formula (from the saved lse, no norm): dz =
    (g ([v == y] - p) - g_ent p (log p + ent)) / tau on the used rows."""

    GRAD_COLS = True

    def grad_cols_(self, z, labels, lse, ent, g_logp, g_ent, inv_t, ii, v_lo, vocab, out=None):
        lp = z * inv_t - lse[:, None]
        p = lp.exp()
        use = (labels != ii) & (labels >= 0) & (labels < vocab)
        cols = torch.arange(v_lo, v_lo + z.shape[1])
        dz = g_logp[:, None] * ((cols[None] == labels[:, None]).to(z.dtype) - p)
        if g_ent is not None:
            dz -= g_ent[:, None] * p * (lp + ent[:, None])
        (z if out is None else out).copy_(torch.where(use[:, None], dz * inv_t, 0.0))


@pytest.mark.parametrize("shift", [0.0, 0.7])
def test_low_memory_centres_only_where_the_rows_sum_to_zero(monkeypatch, shift):
    """The chunk driver's low-memory backward (5 vocabulary chunks): with the rows' own
    entropy, dh is G W (the centring changes no value); with an entropy input that is not
    the rows' own (the vocabulary-parallel shard's: own_entropy=False) the rows of G do not
    sum to zero, and dh is still G W, where a centred product would be off by G 1 c^T."""
    from mrtpo_kernels.backends import _chunked

    n, d, v, t = 9, 3, 50, 0.8
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "1")
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(8 * n * 10))  # 10 columns a chunk
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) + 3.0  # a shared component
    y = torch.randint(0, v, (n,), generator=gen)
    y[2] = II
    g, ge = torch.randn(2, n, generator=gen, dtype=torch.float64)
    z = h @ w.T
    lse = torch.logsumexp(z / t, 1)
    p = torch.softmax(z / t, 1)
    ent = -(p * torch.log_softmax(z / t, 1)).sum(1) + shift
    kern = _Float64Cols()
    dz = torch.empty_like(z)
    kern.grad_cols_(dz.copy_(z), y, lse, ent, g, ge, 1.0 / t, II, 0, v)
    want = dz @ w
    dh, _, _ = _chunked.linear_logprobs_bwd(
        kern, h, w, None, y, lse, ent, g, ge, t, II, None, own_entropy=shift == 0.0
    )
    torch.testing.assert_close(dh, want, rtol=1e-12, atol=1e-12)
    if shift:  # what the flag prevents: the rows of G do not sum to zero here
        assert dz.sum(1).abs().max() > 1e-3
        wrong, _, _ = _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, g, ge, t, II)
        assert (wrong - want).abs().max() > 1e-3
