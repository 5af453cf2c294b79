"""The low-memory backward's centred dh GEMM (backends/_chunk_backward._Centred): dh += G (W - c)
with c the mean of the head's rows at the labels. Exact in exact arithmetic because every
row of G sums to zero (an op of the log-softmax); more accurate in fp32 where the head's rows
share a large component (logits ~1e4). The low-memory mode is the column kernel's
(GRAD_COLS: Triton, CUDA); its accuracy at logits ~1e4 against float64 is checked under the
interpreter in tests/triton_cases/clip_extreme_cases.py ("extreme"). Here the helper's
rules on their own."""

from __future__ import annotations

import pytest
import torch

from mrtpo_kernels._types import LogitCap
from mrtpo_kernels.backends._chunk_backward import _Centred

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
