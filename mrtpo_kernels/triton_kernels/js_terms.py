"""The Jensen-Shannon terms the stacked JS row kernel (row_js.py, ``_js_rows_sum_kernel``)
sums, and the launch helpers of that sum (METHOD.md section 3).

Math (per token row r, stream k = 1..K, vocabulary entry v; log p and log q formed per row
from its own raw max and log s, rows.py's header):
    JSD  = 1/2 sum_v [ p log(p/m) + q log(q/m) ],  m = (p + q) / 2
    d    = min(1, sqrt(max(JSD, 0) / ln 2))
  Each vocabulary term is evaluated without cancellation from delta = log p - log q
  (identical rows give delta = 0 exactly):
    p log(p/m) + q log(q/m) = m h,   h = 2 (x tanh x - log cosh x),  x = delta / 2
    |delta| <  1/2:  h = x^2 - x^4/2 + 2x^6/9 - 17x^8/180 + 62x^10/1575 - 1382x^12/85050
                     (next term below 1e-9 relative there)
    |delta| >= 1/2:  m h = (p + q)(ln 2 - log(1 + e^-|delta|)) - min(p, q) |delta|
  Every term is >= 0, and 0 where p = q = 0. Disjoint supports give JSD = ln 2, d = 1.
  Per term and stream: 3 transcendentals (exp lq, exp -|delta|, log(1 + e)); exp lp is
  shared by the K streams.
The sum runs over vocabulary splits (``_splits``: enough programs to fill the GPU) into
(S, K, rows) fp32 partials; ``_js_finish_kernel`` adds the splits in a fixed order and
takes the square root.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import interpreting, num_sms

LN2 = math.log(2.0)

# Series coefficients of h(x) = 2 (x tanh x - log cosh x) in powers of x^2 (see the header).
_H1 = tl.constexpr(-0.5)
_H2 = tl.constexpr(2.0 / 9.0)
_H3 = tl.constexpr(-17.0 / 180.0)
_H4 = tl.constexpr(62.0 / 1575.0)
_H5 = tl.constexpr(-1382.0 / 85050.0)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _log1p_unit(x, FAST_LOG: tl.constexpr):
    """log(1 + x) for x in [0, 1]. FAST_LOG (on a GPU): lg2.approx.f32, the special
    function unit's log2 (CUDA's __log2f), times ln 2. The CUDA programming guide bounds
    __log2f by 2^-22 absolute for arguments in [0.5, 2] (here 1 + x in [1, 2]): at most
    1.7e-7 absolute in this log. tl.log (and tl.log2) compile to libdevice's logf, a
    software sequence on which the JS sum is ALU-bound. Elsewhere (the interpreter, which
    has no inline PTX) tl.log."""
    if FAST_LOG:
        lg2 = tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [1.0 + x], dtype=tl.float32, is_pure=True, pack=1
        )
        return lg2 * _LN2
    return tl.log(1.0 + x)


@triton.jit
def _js_terms(p, q, delta, FAST_LOG: tl.constexpr):
    """Per-element p log(p/m) + q log(q/m) from p, q and delta = log p - log q (fp32).
    FAST_LOG: _log1p_unit's approximate log, at most 1.7e-7 (p + q) off per element (only
    where |delta| >= 1/2), so at most 1.7e-7 in the divergence (half the sum of the terms;
    the sum of p + q is 2)."""
    ad = tl.abs(delta)
    x2 = 0.25 * ad * ad
    h = x2 * (1.0 + x2 * (_H1 + x2 * (_H2 + x2 * (_H3 + x2 * (_H4 + x2 * _H5)))))
    small = 0.5 * (p + q) * h
    log1pe = _log1p_unit(tl.exp(-ad), FAST_LOG)
    mn = tl.minimum(p, q)
    large = (p + q) * (_LN2 - log1pe) - tl.where(mn > 0.0, mn * ad, 0.0)
    term = tl.where(ad < 0.5, small, large)
    return tl.where(p + q > 0.0, term, 0.0)


@triton.jit
def _js_finish_kernel(
    part_ptr,  # (S, K, rows_alloc) fp32
    out_ptr,  # (K, N) fp32
    K,
    rows,
    splits,
    row0,
    stride_part_s,
    stride_part_k,
    stride_out_k,
    BLOCK: tl.constexpr,
):
    # d = min(1, sqrt(max(JSD, 0) / ln 2)), JSD = sum over the S splits (fixed order).
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < K * rows
    k = j // rows
    r = j % rows
    src = part_ptr + k * stride_part_k + r
    jsd = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(0, splits):
        jsd += tl.load(src + sp * stride_part_s, mask=mask, other=0.0)
    # clamps by comparison: tl.maximum / tl.minimum may drop a NaN on the GPU
    d = tl.sqrt_rn(tl.where(jsd < 0.0, 0.0, jsd) * (1.0 / _LN2))
    tl.store(out_ptr + k * stride_out_k + row0 + r, tl.where(d > 1.0, 1.0, d), mask=mask)


def _sum_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V) of the sum kernel: the K streams in one power-of-two block, and
    about 4096 elements per step (8192 under the interpreter)."""
    block_k = triton.next_power_of_2(k)
    elems = 8192 if interpreting() else 4096
    return block_k, max(64, elems // block_k)


def _splits(rows: int, cols: int, block_v: int, device: torch.device) -> tuple[int, int]:
    """Vocabulary splits per row so that rows x splits programs fill the GPU (8 per SM)."""
    target = 8 * num_sms(device)
    splits = max(1, min(triton.cdiv(target, rows), triton.cdiv(cols, block_v)))
    per_split = triton.cdiv(triton.cdiv(cols, splits), block_v) * block_v
    return triton.cdiv(cols, per_split), per_split
