"""Triton token-advantage kernel (mrtpo_kernels/triton_kernels/advantages.py).

CPU: the kernel runs under the Triton interpreter, which must be on before triton is
imported, so the checks live in tests/triton_cases/advantages_cases.py and run here one
subprocess per group (alpha, gamma and clip variants, mixed has_info, zero and negative
relevance, the padded layout, float64, the mass invariant; torch.library.opcheck;
torch.compile(fullgraph=True) with aot_eager). The kernel also builds for sm_90.
GPU (``-m gpu``, on the H200 through bench/gpu_check.sh): 512 responses up to 4096 tokens
against the float64 reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_triton_js import (
    _compile_for_hopper,
    _err,
    _nvidia_backend_present,
    _within_budget,
    gpu_test,
)
from triton_cases._harness import CASES, needs_triton, run_interpreted

import mrtpo_kernels as mk
from mrtpo_kernels.reference import mrtpo_token_advantages_ref

GROUPS = ["packed", "opcheck", "compile"]


@needs_triton
@pytest.mark.parametrize("group", GROUPS)
def test_triton_advantages_under_interpreter(group):
    run_interpreted(CASES / "advantages_cases.py", group)


@needs_triton
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="needs the compiled (non-interpreted) mode"
)
def test_triton_advantages_rejects_cpu_tensors_without_interpreter():
    from mrtpo_kernels.triton_kernels import advantages

    with pytest.raises(ValueError, match="relevance"):
        advantages.mrtpo_token_advantages(
            torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool),
            torch.rand(1, 4), torch.tensor([0, 4]), torch.tensor(0.0), torch.tensor(1.0), 1.0,
            1.0, 1e-6, 1e-8, 0.0, float("inf"),
        )  # fmt: skip


@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton's NVIDIA backend is absent")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled mode")
def test_triton_advantages_kernel_compiles_for_hopper():
    from mrtpo_kernels.triton_kernels import advantages

    for dt in ("fp32", "fp64"):
        sig = {name: f"*{dt}" for name in ("per_reward_ptr", "lam_ptr")}
        sig.update(has_info_ptr="*u8", rel_ptr=f"*{dt}", cu_ptr="*i64", mean_ptr=f"*{dt}")
        sig.update(std_ptr=f"*{dt}", params_ptr=f"*{dt}", token_ptr=f"*{dt}")
        sig.update(alloc_ptr=f"*{dt}", K="i32", N="i32", GAMMA_ONE="constexpr")
        sig.update(HAS_CLIP="constexpr", BLOCK_K="constexpr", BLOCK_T="constexpr")
        for gamma_one, clip in ((True, False), (False, True)):
            _compile_for_hopper(
                advantages._reallocate_kernel, sig,
                {"GAMMA_ONE": gamma_one, "HAS_CLIP": clip, "BLOCK_K": 4, "BLOCK_T": 256},
                num_warps=4,
            )  # fmt: skip


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
