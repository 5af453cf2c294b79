"""Triton one-vs-many JS distance (mrtpo_kernels/triton_kernels/js.py); the advantage kernel is in
test_triton_advantages.py.

CPU: the kernels run under the Triton interpreter, which must be on before triton is
imported, so the checks live in tests/triton_cases/js_cases.py and run here one subprocess
per group on the default variant (MRTPO_TRITON_VARIANT=rows: the chunk driver with the
stacked row kernel) and all groups in one more on the fused one (triton_kernels/js.py): odd shapes
N = 1, 7, 129, V = 1, 1000, 5003, d = 3, 64, K = 1, 3, 5, temperature, bias, extreme and
-inf logits, identical -> 0, disjoint -> 1, several token chunks, bf16/fp16;
torch.library.opcheck; torch.compile(fullgraph=True) with aot_eager.
GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): V = 151936, d = 896 and 4096, N up
to 16384, bf16 and fp32, K = 4, against float64 references computed in row chunks; offsets
beyond 2^31 elements; torch.compile(fullgraph=True) of a caller.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from triton_cases._harness import CASES, needs_triton, run_interpreted

import mrtpo_kernels as mk
from mrtpo_kernels.reference import (
    js_distance_ref,
    linear_js_distance_ref,
)

GROUPS = [
    "linear_shapes",
    "linear_chunks_dtypes",
    "linear_special",
    "logits",
    "opcheck",
    "compile",
]


@needs_triton
@pytest.mark.parametrize("group", GROUPS)
def test_triton_js_under_interpreter(group):
    run_interpreted(CASES / "js_cases.py", group, env={"MRTPO_TRITON_VARIANT": "rows"})


@needs_triton
def test_triton_js_fused_variant_under_interpreter():
    """Every group on MRTPO_TRITON_VARIANT=fused (triton_kernels/js.py), in one process: ~20 s."""
    run_interpreted(CASES / "js_cases.py", env={"MRTPO_TRITON_VARIANT": "fused"})


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_js_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.triton_kernels import js

    with pytest.raises(ValueError, match="hidden_p"):
        js.linear_js_distance(torch.randn(3, 4), torch.randn(1, 3, 4), torch.randn(5, 4), None, 1.0)
    with pytest.raises(ValueError, match="logits_p"):
        js.js_distance(torch.randn(3, 5), torch.randn(1, 3, 5), 1.0)


# --------------------------------------------------------------------------- Hopper build


def _compile_for_hopper(fn, signature, constexprs, div16=(), **options):
    """Compile a kernel for sm_90 without a GPU (as a launch would: pointers and the named
    integers marked divisible by 16); return the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name].startswith("*") or name in div16
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _nvidia_backend_present() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton's NVIDIA backend is absent")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled mode")
def test_triton_js_kernels_compile_for_hopper():
    """Every kernel builds for sm_90 (catches what the interpreter does not: types, layouts,
    shared memory), and the GEMM at the default 16-bit tiles is a pipelined wgmma loop."""
    from mrtpo_kernels.triton_kernels import js

    cfg = js._gemm_configs(torch.bfloat16)[0]
    gemm_sig = {
        "a_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "z_ptr": "*fp32",
        "part_ptr": "*fp32", "M": "i32", "D": "i32", "V": "i32", "n_vt": "i32",
        "inv_t": "fp32", "stride_a": "i32", "stride_w": "i32", "HAS_BIAS": "constexpr",
        "DOT_PRECISION": "constexpr", "UPCAST_DOT": "constexpr", "BLOCK_M": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
    }  # fmt: skip
    k = _compile_for_hopper(
        js._js_logits_kernel, gemm_sig,
        {"HAS_BIAS": True, "DOT_PRECISION": "tf32", "UPCAST_DOT": False,
         "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k},
        div16=("M", "D", "V", "stride_a", "stride_w"), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    ttgir = k.asm["ttgir"]
    assert "warp_group_dot" in ttgir, "the GEMM does not use wgmma"
    assert "async_copy_global_to_local" in ttgir or "async_tma" in ttgir, "loads not pipelined"
    assert k.metadata.shared <= 227 * 1024
    gemm_sig.update(a_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32")
    cfg32 = js._gemm_configs(torch.float32)[0]
    _compile_for_hopper(
        js._js_logits_kernel, gemm_sig,
        {"HAS_BIAS": False, "DOT_PRECISION": "ieee", "UPCAST_DOT": False,
         "BLOCK_M": cfg32.block_m, "BLOCK_N": cfg32.block_n, "BLOCK_K": cfg32.block_k},
        num_warps=cfg32.num_warps, num_stages=cfg32.num_stages,
    )  # fmt: skip
    _compile_for_hopper(
        js._row_lse_kernel,
        {"x_ptr": "*bf16", "out_ptr": "*fp32", "cols": "i32", "stride_xs": "i64",
         "stride_xr": "i32", "stride_os": "i32", "scale": "fp32", "BLOCK": "constexpr"},
        {"BLOCK": 2048}, num_warps=8,
    )  # fmt: skip
    _compile_for_hopper(
        js._js_sum_kernel,
        {"zp_ptr": "*fp32", "zq_ptr": "*bf16", "lse_ptr": "*fp32", "part_ptr": "*fp32",
         "K": "i32", "cols": "i32", "cols_per_split": "i32", "stride_p": "i32",
         "stride_qk": "i64", "stride_q": "i32", "stride_ls": "i32", "stride_part_s": "i32",
         "stride_part_k": "i32", "scale": "fp32", "BLOCK_K": "constexpr",
         "BLOCK_V": "constexpr", "FAST_LOG": "constexpr"},
        {"BLOCK_K": 4, "BLOCK_V": 1024, "FAST_LOG": True}, num_warps=8,
    )  # fmt: skip
    _compile_for_hopper(
        js._js_finish_kernel,
        {"part_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32", "rows": "i32", "splits": "i32",
         "row0": "i32", "stride_part_s": "i32", "stride_part_k": "i32",
         "stride_out_k": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 1024}, num_warps=4,
    )  # fmt: skip


# --------------------------------------------------------------------------- GPU


def gpu_test(fn):
    """Marked ``gpu`` (deselected by default) and skipped where CUDA is absent."""
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


V_REAL = 151936


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _within_budget(ours, ref64, same, atol):
    e, base = _err(ours, ref64), _err(same, ref64)
    assert e <= 2 * base + atol, f"error {e:.3e} > 2 x {base:.3e} + {atol:g}"


def _linear_ref_rows(hp, hq, w, dtype, rows=256, **kw):
    """linear_js_distance_ref in ``dtype``, row chunk by row chunk (rows are independent)."""
    wd = w.to(dtype)
    outs = [
        linear_js_distance_ref(hp[s : s + rows].to(dtype), hq[:, s : s + rows].to(dtype), wd, **kw)
        for s in range(0, hp.shape[0], rows)
    ]
    return torch.cat(outs, dim=-1)


def _streams(n, d, k, dtype, v=V_REAL, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hp = torch.randn(n, d, device="cuda", generator=g)
    hq = hp + 0.3 * torch.randn(k, n, d, device="cuda", generator=g)
    w = torch.randn(v, d, device="cuda", generator=g) * (2.0 / d**0.5)
    return hp.to(dtype), hq.to(dtype), w.to(dtype)


@gpu_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,d", [(16384, 896), (2048, 4096)])
def test_gpu_linear_js_real_shapes(n, d, dtype):
    hp, hq, w = _streams(n, d, 4, dtype)
    out = mk.linear_js_distance(hp, hq, w, temperature=0.9, backend="triton")
    assert out.shape == (4, n) and out.dtype == torch.float32
    # float64 reference on a strided subset of rows (all rows would take minutes)
    idx = torch.arange(0, n, max(1, n // 512), device="cuda")
    with torch.no_grad():
        ref = _linear_ref_rows(hp[idx], hq[:, idx], w, torch.float64, temperature=0.9)
        same = mk.linear_js_distance(hp[idx], hq[:, idx], w, temperature=0.9, backend="torch")
    _within_budget(out[:, idx], ref, same, atol=1e-4)
    assert _err(out[:, idx], ref) <= 1e-3


@gpu_test
def test_gpu_linear_js_bias_identical_and_chunks(monkeypatch):
    hp, hq, w = _streams(1000, 896, 4, torch.bfloat16, seed=1)
    b = torch.randn(V_REAL, device="cuda").to(torch.bfloat16)
    hq[2] = hp  # one stream identical to P: exactly 0
    monkeypatch.setenv("MRTPO_JS_SCRATCH_BYTES", str(64 << 20))  # several chunks
    out = mk.linear_js_distance(hp, hq, w, bias=b, temperature=0.7, backend="triton")
    assert bool((out[2] == 0).all())
    with torch.no_grad():
        ref = _linear_ref_rows(hp, hq, w, torch.float64, bias=b.double(), temperature=0.7)
    assert _err(out, ref) <= 1e-3


@gpu_test
def test_gpu_logits_js_offsets_beyond_int32():
    # K x N x V = 4 x 16384 x 151936 ~ 1.0e10 elements: every int32 offset would wrap.
    n, k = 16384, 4
    g = torch.Generator(device="cuda").manual_seed(2)
    zp = (3 * torch.randn(n, V_REAL, device="cuda", generator=g)).to(torch.bfloat16)
    zq = torch.empty((k, n, V_REAL), device="cuda", dtype=torch.bfloat16)
    for j in range(k):
        zq[j] = zp + torch.randn(n, V_REAL, device="cuda", generator=g).to(torch.bfloat16)
    out = mk.js_distance(zp, zq, temperature=1.1, backend="triton")
    rows = torch.cat([torch.arange(0, 64), torch.arange(n - 64, n)]).cuda()
    with torch.no_grad():
        ref = js_distance_ref(zp[rows].double(), zq[:, rows].double(), temperature=1.1)
    assert _err(out[:, rows], ref) <= 1e-4


@gpu_test
def test_gpu_compile_fullgraph_caller():
    hp, hq, w = _streams(300, 896, 2, torch.bfloat16, v=32000, seed=4)
    zp, zq = (hp.float() @ w.float().t()), (hq.float() @ w.float().t())

    def caller(hp, hq, w, zp, zq):
        d_lin = mk.linear_js_distance(hp, hq, w, temperature=0.8, backend="triton")
        d_log = mk.js_distance(zp, zq, temperature=0.8, backend="triton")
        return d_lin.mean(0) + d_log.mean(0)

    compiled = torch.compile(caller, fullgraph=True)
    torch.testing.assert_close(compiled(hp, hq, w, zp, zq), caller(hp, hq, w, zp, zq))
