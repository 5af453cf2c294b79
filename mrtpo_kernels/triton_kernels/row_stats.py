"""Triton row kernels, statistics: per row of fp32 logits z [C, V] the log-prob of the
label, the entropy, lse and, for the low-memory backward, the row's raw max and log s
(rows.py's header has the math and the contract; ``TritonRowKernel`` binds ``stats`` and
``stats_split`` as its methods).

- ``stats``: one program per row, one pass over the row (``_stats_rows_kernel``).
- ``stats_split``: the split-row form (issue 35, item 4): one program per (row, vocabulary
  split) (``_stats_split_kernel``), then one merging program per row
  (``_stats_merge_kernel``); both store through ``_store_stats``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, num_sms
from .row_math import (
    _merge_parts,
    _norm,
    _row_offset,
    _row_scan,
    _span_scan,
    _target_x,
    _warps,
    row_block,
)


@triton.jit
def _stats_rows_kernel(
    z_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,  # (2, rows) out with WITH_NORM: raw row max M, log s (NaN: undefined row)
    V,
    norm_stride,  # elements from norm's M plane to its log s plane
    stride_z,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    m, s, t, bad = _row_scan(row_ptr, V, inv_t, WITH_ENT, BLOCK)
    _store_stats(
        row_ptr,
        r,
        labels_ptr,
        logp_ptr,
        ent_ptr,
        lse_ptr,
        norm_ptr,
        V,
        norm_stride,
        m,
        s,
        t,
        bad,
        inv_t,
        ignore_index,
        WITH_ENT,
        WITH_NORM,
    )


@triton.jit
def _store_stats(
    row_ptr,
    r,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,
    V,
    norm_stride,
    m,
    s,
    t,
    bad,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
):
    """Row r's outputs from its (M, s, t, bad): log p (the label's x less log s), lse,
    entropy, and with WITH_NORM the (M, log s) pair; NaN for an undefined row, 0 for an
    ignored one (the header's rules)."""
    ok = (bad == 0) & (m > float("-inf"))
    y = tl.load(labels_ptr + r)
    valid = y != ignore_index
    use = valid & (y >= 0) & (y < V)
    log_s = tl.log(s)
    xy = _target_x(row_ptr, y, use, m, inv_t)
    logp = tl.where(use & ok, xy - log_s, float("nan"))
    tl.store(logp_ptr + r, tl.where(valid, logp, 0.0))
    tl.store(lse_ptr + r, tl.where(ok, m * inv_t + log_s, float("nan")))
    if WITH_NORM:
        tl.store(norm_ptr + r, m)
        tl.store(norm_ptr + norm_stride + r, tl.where(ok, log_s, float("nan")))
    if WITH_ENT:
        ent = tl.where(ok, log_s - t / s, float("nan"))
        tl.store(ent_ptr + r, tl.where(valid, ent, 0.0))


@triton.jit
def _stats_split_kernel(
    z_ptr,
    part_ptr,  # (4, S, rows) fp32: each split's raw max m, s, t and bad (1.0: a NaN / +inf)
    V,
    rows,
    plane,  # S x rows: elements from one part plane to the next
    cols_per_split,
    stride_z,
    inv_t,
    WITH_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The split-row statistics, first pass: one program per (row, vocabulary split), the
    one-program-per-row scan (``_span_scan``) over the split's columns only, so that a
    chunk of a few hundred rows still fills the GPU (S programs per row)."""
    r = tl.program_id(0)
    sp = tl.program_id(1)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    lo = sp * cols_per_split
    hi = tl.minimum(lo + cols_per_split, V)
    m, s, t, bad = _span_scan(row_ptr, lo, hi, inv_t, WITH_ENT, BLOCK)
    at = _row_offset(sp, rows) + r
    tl.store(part_ptr + at, m)
    tl.store(part_ptr + plane + at, s)
    tl.store(part_ptr + 2 * plane + at, t)
    tl.store(part_ptr + 3 * plane + at, bad.to(tl.float32))


@triton.jit
def _stats_merge_kernel(
    z_ptr,
    part_ptr,
    labels_ptr,
    logp_ptr,
    ent_ptr,
    lse_ptr,
    norm_ptr,
    V,
    rows,
    splits,
    plane,
    norm_stride,
    stride_z,
    inv_t,
    ignore_index,
    WITH_ENT: tl.constexpr,
    WITH_NORM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The split-row statistics, second pass: one program per row merges its S splits'
    (m, s, t) like the lanes of one program (``_merge_parts``) and stores the outputs of
    ``_stats_rows_kernel`` (``_store_stats``)."""
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK_S)
    live = i < splits
    at = i.to(tl.int64) * rows + r
    m = tl.load(part_ptr + at, mask=live, other=float("-inf"))
    s = tl.load(part_ptr + plane + at, mask=live, other=0.0)
    t = tl.load(part_ptr + 2 * plane + at, mask=live, other=0.0)
    bad = tl.max(tl.load(part_ptr + 3 * plane + at, mask=live, other=0.0), axis=0)
    mx, s_all, t_all = _merge_parts(m, s, t, inv_t, WITH_ENT)
    row_ptr = z_ptr + _row_offset(r, stride_z)
    _store_stats(
        row_ptr,
        r,
        labels_ptr,
        logp_ptr,
        ent_ptr,
        lse_ptr,
        norm_ptr,
        V,
        norm_stride,
        mx,
        s_all,
        t_all,
        bad,
        inv_t,
        ignore_index,
        WITH_ENT,
        WITH_NORM,
    )


def stats(z, labels, inv_t, ignore_index, with_ent, norm=None):
    """(logp, entropy|None, lse); with ``norm`` ((2, rows) fp32, e.g. the slice [:, a:b]
    of a (2, N) buffer) also each row's raw max M and log s (NaN for an undefined row)
    there, for ``grad_cols_``."""
    check_device("z", z)
    rows, v = z.shape
    f32 = dict(dtype=torch.float32, device=z.device)
    logp, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
    ent = torch.empty(rows if with_ent else 0, **f32)
    if rows:
        block = row_block(v)
        _stats_rows_kernel[(rows,)](
            z,
            labels.contiguous(),
            logp,
            ent if with_ent else lse,
            lse,
            lse if norm is None else _norm(norm, rows),
            V=v,
            norm_stride=0 if norm is None else norm.stride(0),
            stride_z=z.stride(0),
            inv_t=float(inv_t),
            ignore_index=int(ignore_index),
            WITH_ENT=bool(with_ent),
            WITH_NORM=norm is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return logp, (ent if with_ent else None), lse


def stats_split(z, labels, inv_t, ignore_index, with_ent, norm=None, splits=None):
    """``stats`` by split rows (issue 35, item 4; not yet the driver's: the GPU window
    measures it against ``stats``): each row's vocabulary in S contiguous splits, one
    program per (row, split), then one merging program per row, for the chunk's few
    hundred rows that leave one program per row latency-bound on 132 SMs. ``splits``:
    S (default: enough programs for 8 per SM, at most one split per column step)."""
    check_device("z", z)
    rows, v = z.shape
    f32 = dict(dtype=torch.float32, device=z.device)
    logp, lse = torch.empty(rows, **f32), torch.empty(rows, **f32)
    ent = torch.empty(rows if with_ent else 0, **f32)
    if rows == 0:
        return logp, (ent if with_ent else None), lse
    block = row_block(v)
    if splits is None:
        splits = max(1, min(triton.cdiv(8 * num_sms(z.device), rows), triton.cdiv(v, block)))
    per = triton.cdiv(triton.cdiv(v, int(splits)), block) * block  # whole column steps
    splits = triton.cdiv(v, per)  # every split non-empty
    part = torch.empty((4, splits, rows), **f32)
    _stats_split_kernel[(rows, splits)](
        z,
        part,
        V=v,
        rows=rows,
        plane=splits * rows,
        cols_per_split=per,
        stride_z=z.stride(0),
        inv_t=float(inv_t),
        WITH_ENT=bool(with_ent),
        BLOCK=block,
        num_warps=_warps(block),
    )
    _stats_merge_kernel[(rows,)](
        z,
        part,
        labels.contiguous(),
        logp,
        ent if with_ent else lse,
        lse,
        lse if norm is None else _norm(norm, rows),
        V=v,
        rows=rows,
        splits=splits,
        plane=splits * rows,
        norm_stride=0 if norm is None else norm.stride(0),
        stride_z=z.stride(0),
        inv_t=float(inv_t),
        ignore_index=int(ignore_index),
        WITH_ENT=bool(with_ent),
        WITH_NORM=norm is not None,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        num_warps=1,
    )
    return logp, (ent if with_ent else None), lse
