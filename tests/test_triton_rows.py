"""The Triton kernels the GPU run executes build for sm_90 without a GPU: the row kernels
(mrtpo_kernels/triton_kernels/rows.py and the row_*.py modules it binds, the JS terms of
js_terms.py). Their numerics are checked under the interpreter by
tests/test_chunk_driver.py."""

from __future__ import annotations

import importlib.util
import os

import pytest
from triton_cases._harness import CASES, interpreted, run_interpreted


def _nvidia_backend_present() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "nvidia" in backends


def _compile(fn, signature, constexprs, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature)
             if signature[n].startswith("*")}  # fmt: skip
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _sig(names, types):
    return dict(zip(names, types, strict=True))


hopper = pytest.mark.skipif(not _nvidia_backend_present(), reason="no NVIDIA backend in triton")
compiled_mode = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled mode"
)


@hopper
@compiled_mode
@pytest.mark.parametrize("out_dtype", ["fp32", "bf16", "fp16"])
def test_row_kernels_compile_for_hopper(out_dtype):
    from mrtpo_kernels.triton_kernels import row_cols, row_grads, row_stats, rows

    block = rows.row_block(151936) if os.environ.get("TRITON_INTERPRET") != "1" else 2048
    c = {"BLOCK": block}
    w = dict(num_warps=8)
    for with_norm in (True, False):
        _compile(row_stats._stats_rows_kernel, {
            "z_ptr": "*fp32", "labels_ptr": "*i64", "logp_ptr": "*fp32", "ent_ptr": "*fp32",
            "lse_ptr": "*fp32", "norm_ptr": "*fp32", "V": "i32", "norm_stride": "i32",
            "stride_z": "i64", "inv_t": "fp32", "ignore_index": "i64",
            "WITH_ENT": "constexpr", "WITH_NORM": "constexpr", "BLOCK": "constexpr"},
            {"WITH_ENT": True, "WITH_NORM": with_norm, **c}, **w)  # fmt: skip
    _compile(row_grads._grad_rows_kernel, {
        "z_ptr": "*fp32", "out_ptr": f"*{out_dtype}", "labels_ptr": "*i64", "ent_ptr": "*fp32",
        "g_logp_ptr": "*fp32", "g_ent_ptr": "*fp32", "V": "i32", "stride_z": "i64",
        "stride_out": "i64", "inv_t": "fp32", "ignore_index": "i64", "scale": "fp32",
        "inv_cap": "fp32", "HAS_ENT": "constexpr", "BLOCK": "constexpr", "SLOPE": "constexpr"},
        {"HAS_ENT": True, "SLOPE": True, **c}, **w)  # fmt: skip
    for flags in ((True, True, True, True, True), (False, False, False, False, False)):
        _compile(row_grads._policy_rows_kernel, {
            "z_ptr": "*fp32", "out_ptr": f"*{out_dtype}", "labels_ptr": "*i64",
            "old_ptr": "*fp32", "adv_ptr": "*fp32", "tw_ptr": "*fp32", "ref_ptr": "*fp32",
            "loss_ptr": "*fp32", "logp_ptr": "*fp32", "clipped_ptr": "*fp32", "V": "i32",
            "stride_z": "i64", "stride_out": "i64", "inv_t": "fp32", "clip_low": "fp32",
            "clip_high": "fp32", "clip_c": "fp32", "beta": "fp32", "ignore_index": "i64",
            "scale": "fp32", "inv_cap": "fp32", "HAS_REF": "constexpr",
            "DUAL_CLIP": "constexpr", "KL_IW": "constexpr", "NEED_GRAD": "constexpr",
            "BLOCK": "constexpr", "SLOPE": "constexpr"},
            dict(zip(("HAS_REF", "DUAL_CLIP", "KL_IW", "NEED_GRAD", "SLOPE"), flags, strict=True),
                 **c), **w)  # fmt: skip
    for has_norm in (True, False):
        _compile(row_cols._grad_cols_kernel, {
            "z_ptr": "*fp32", "out_ptr": f"*{out_dtype}", "labels_ptr": "*i64",
            "lse_ptr": "*fp32", "norm_ptr": "*fp32", "ent_ptr": "*fp32", "g_logp_ptr": "*fp32",
            "g_ent_ptr": "*fp32", "W": "i32", "v_lo": "i32", "V": "i32", "norm_stride": "i32",
            "stride_z": "i64", "stride_out": "i64", "inv_t": "fp32", "ignore_index": "i64",
            "scale": "fp32", "inv_cap": "fp32", "HAS_NORM": "constexpr", "HAS_ENT": "constexpr",
            "BLOCK": "constexpr", "SLOPE": "constexpr"},
            {"HAS_NORM": has_norm, "HAS_ENT": True, "SLOPE": has_norm, **c}, **w)  # fmt: skip
    _compile(row_cols._policy_terms_kernel, {
        "logp_ptr": "*fp32", "labels_ptr": "*i64", "old_ptr": "*fp32", "adv_ptr": "*fp32",
        "tw_ptr": "*fp32", "ref_ptr": "*fp32", "loss_ptr": "*fp32", "clipped_ptr": "*fp32",
        "g_ptr": "*fp32", "N": "i32", "V": "i32", "clip_low": "fp32", "clip_high": "fp32",
        "clip_c": "fp32", "beta": "fp32", "ignore_index": "i64", "HAS_REF": "constexpr",
        "DUAL_CLIP": "constexpr", "KL_IW": "constexpr", "BLOCK": "constexpr"},
        {"HAS_REF": True, "DUAL_CLIP": True, "KL_IW": True, "BLOCK": 1024})  # fmt: skip


@hopper
@compiled_mode
def test_split_stats_kernels_compile_for_hopper():
    """The split-row statistics (issue 35, item 4): the per-(row, split) scan and the
    per-row merge build for sm_90 (the numerics: rows_cases.py, group split_stats)."""
    from mrtpo_kernels.triton_kernels import row_stats, rows

    block = rows.row_block(151936)
    _compile(row_stats._stats_split_kernel, {
        "z_ptr": "*fp32", "part_ptr": "*fp32", "V": "i32", "rows": "i32", "plane": "i32",
        "cols_per_split": "i32", "stride_z": "i64", "inv_t": "fp32",
        "WITH_ENT": "constexpr", "BLOCK": "constexpr"},
        {"WITH_ENT": True, "BLOCK": block}, num_warps=8)  # fmt: skip
    for with_norm in (True, False):
        _compile(row_stats._stats_merge_kernel, {
            "z_ptr": "*fp32", "part_ptr": "*fp32", "labels_ptr": "*i64", "logp_ptr": "*fp32",
            "ent_ptr": "*fp32", "lse_ptr": "*fp32", "norm_ptr": "*fp32", "V": "i32",
            "rows": "i32", "splits": "i32", "plane": "i32", "norm_stride": "i32",
            "stride_z": "i64", "inv_t": "fp32", "ignore_index": "i64",
            "WITH_ENT": "constexpr", "WITH_NORM": "constexpr", "BLOCK_S": "constexpr"},
            {"WITH_ENT": True, "WITH_NORM": with_norm, "BLOCK_S": 4}, num_warps=1)  # fmt: skip


@hopper
@compiled_mode
@pytest.mark.parametrize("k", [1, 4, 5])
def test_js_row_kernels_compile_for_hopper(k):
    """js_many's kernels: per-row (raw max, log sum) of the stacked rows, then the split
    sums of the terms for K streams (block sizes as js_many picks them on a GPU)."""
    from mrtpo_kernels.triton_kernels import js_terms, row_js, rows

    block = rows.row_block(151936)
    _compile(row_js._row_norm_kernel, {
        "z_ptr": "*fp32", "m_ptr": "*fp32", "log_s_ptr": "*fp32", "V": "i32", "rows": "i32",
        "stride_s": "i64", "stride_r": "i64", "inv_t": "fp32", "BLOCK": "constexpr"},
        {"BLOCK": block}, num_warps=8)  # fmt: skip
    block_k, block_v = js_terms._sum_blocks(k)
    sig = {
        "z_ptr": "*fp32", "m_ptr": "*fp32", "log_s_ptr": "*fp32", "part_ptr": "*fp32",
        "K": "i32", "rows": "i32", "cols": "i32", "cols_per_split": "i32", "stride_s": "i64",
        "stride_r": "i64", "inv_t": "fp32", "BLOCK_K": "constexpr", "BLOCK_V": "constexpr",
        "FAST_LOG": "constexpr"}  # fmt: skip
    blocks = {"BLOCK_K": block_k, "BLOCK_V": block_v}
    fast = _compile(row_js._js_rows_sum_kernel, sig, {**blocks, "FAST_LOG": True}, num_warps=8)
    slow = _compile(row_js._js_rows_sum_kernel, sig, {**blocks, "FAST_LOG": False}, num_warps=8)
    # the GPU build takes its log from the special function unit, not libdevice's logf
    assert "lg2.approx.f32" in fast.asm["ptx"] and "__nv_logf" not in fast.asm["ptx"]
    assert "__nv_logf" in slow.asm["ptx"]  # (what tl.log alone compiles to)
    _compile(js_terms._js_finish_kernel, {
        "part_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32", "rows": "i32", "splits": "i32",
        "row0": "i32", "stride_part_s": "i32", "stride_part_k": "i32",
        "stride_out_k": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 1024}, num_warps=4)  # fmt: skip


@interpreted
def test_row_kernels_index_past_2_31_under_interpreter():
    """stats, grad_, policy_ and js_many on views whose second row (or stream) starts
    2^31 + 67 elements after the first, in a lazily allocated storage (only those rows are
    touched): the kernels' own int64 offsets, against float64
    (tests/triton_cases/offsets_cases.py)."""
    out = run_interpreted(CASES / "offsets_cases.py")
    assert "ok stats_grad_policy" in out and "ok js_streams" in out
