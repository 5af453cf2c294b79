"""The chunk driver (mrtpo_kernels/backends/_chunked.py) with every row-kernel
implementation (torch, cpu, Triton under the interpreter), and the Triton row kernels
(mrtpo_kernels/triton/rows.py) on their own, against the float64 references.

The interpreter must be switched on before triton is imported, so the checks live in
tests/triton_cases/rows_cases.py and run here in a subprocess: odd shapes, extreme and
masked logits, NaN and all -inf rows, all-ignored rows, JS with K = 1, 3, 5, the policy
loss with the dual clip and kl_iw, chunk boundaries (chunks of 4 to 6 rows), the low-memory
(vocabulary-chunked) backward, the 16-bit GEMM path of CUDA emulated on the CPU, and int64
row offsets past 2^31 by index arithmetic.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_cases._harness import CASES, needs_triton, run_interpreted


@needs_triton
def test_row_kernels_and_chunk_driver_under_interpreter():
    run_interpreted(CASES / "rows_cases.py")


def test_low_memory_setting():
    from mrtpo_kernels import settings

    old = {k: os.environ.get(k) for k in ("MRTPO_LOW_MEMORY", "MRTPO_DW_BUDGET_BYTES")}
    try:
        os.environ["MRTPO_LOW_MEMORY"] = "auto"
        os.environ["MRTPO_DW_BUDGET_BYTES"] = "1000"
        assert settings.low_memory(1001) and not settings.low_memory(1000)
        os.environ["MRTPO_LOW_MEMORY"] = "0"
        assert not settings.low_memory(10**12)
        os.environ["MRTPO_LOW_MEMORY"] = "1"
        assert settings.low_memory(1)
        os.environ["MRTPO_LOW_MEMORY"] = "sometimes"
        with pytest.raises(ValueError, match="MRTPO_LOW_MEMORY"):
            settings.low_memory(1)
        os.environ["MRTPO_TRITON_VARIANT"] = "fastest"
        with pytest.raises(ValueError, match="MRTPO_TRITON_VARIANT"):
            settings.triton_variant()
    finally:
        os.environ.pop("MRTPO_TRITON_VARIANT", None)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_f32_out_probe_on_cpu_is_false_or_exact():
    """The run-time check of torch.mm(out_dtype=float32): CPU torch has no such kernel, so
    the driver upcasts there; where it exists the probe has checked it is exact."""
    import torch

    from mrtpo_kernels.backends import _chunked

    got = _chunked.f32_out_supported(torch.device("cpu"), torch.bfloat16)
    try:
        torch.mm(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16),
                 out_dtype=torch.float32)  # fmt: skip
        exists = True
    except (RuntimeError, TypeError, NotImplementedError):
        exists = False
    assert got == exists


# --------------------------------------------------------------------------- the public plan

_GEMM_EVENTS = ("aten::mm", "aten::addmm", "aten::addmm_")


def _gemms_run(fn) -> tuple[int, int]:
    """(GEMM calls, their FLOPs) of fn() as the profiler sees them."""
    import torch

    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    ev = [e for e in prof.events() if e.name in _GEMM_EVENTS]
    # FLOPs from the operands' shapes (the profiler's own count skips addmm_)
    flops = 0
    for e in ev:
        first = 0 if e.name == "aten::mm" else 1  # addmm(c, a, b): skip c
        (m, kk), (_, cols) = e.input_shapes[first : first + 2]
        flops += 2 * m * kk * cols
    return len(ev), flops


class _NoRowWork:
    """A row kernel that does nothing (zeros), with the optional methods, so the driver's
    stacked-JS and low-memory paths run on the CPU without triton."""

    @staticmethod
    def stats(z, labels, inv_t, ignore_index, with_ent):
        n = z.shape[0]
        return z.new_zeros(n), (z.new_zeros(n) if with_ent else None), z.new_zeros(n)

    @staticmethod
    def grad_(*args, **kwargs):
        return None

    @staticmethod
    def grad_cols_(*args, **kwargs):
        return None

    @staticmethod
    def js_many(z, inv_t):
        return z.new_zeros(z.shape[0] - 1, z.shape[1])


@pytest.mark.parametrize("keep_rows", [0, 13, 40])
def test_chunk_plan_is_what_the_driver_runs(monkeypatch, keep_rows):
    """mrtpo_kernels.stages.chunk_plan counts the GEMMs (and FLOPs) of real driver calls:
    log-probs forward, forward + backward (kept rows), policy loss, JS per stream and
    stacked, and the low-memory backward; chunks of 7 rows, 40 tokens (a partial chunk)."""
    import torch

    from mrtpo_kernels import stages
    from mrtpo_kernels.backends import _chunked, torch_backend

    n, d, v, k = 40, 16, 300, 3
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * v * 7))
    monkeypatch.setenv("MRTPO_KEEP_LOGITS_BYTES", str(4 * v * keep_rows))
    monkeypatch.setenv("MRTPO_JS_SCRATCH_BYTES", str(4 * v * (1 + k) * 6))
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "0")
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    hq = torch.randn(k, n, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    one = torch.ones(n)
    kern = torch_backend.ROW_KERNEL

    def logprobs(backward):
        lp, ent, lse = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
        if backward:
            _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, 1.0, -100)

    def policy():
        _chunked.linear_policy_loss(
            kern, h, w, None, y, -one, one, one, one[:0], 1.0, 0.2, 0.2, 0.0, -100, True
        )

    def plan(op, **kw):
        p = stages.chunk_plan(op, n, v, d, **kw)
        return p.count(), p.flops

    assert _gemms_run(lambda: logprobs(False)) == plan("linear_logprobs", backward=False)
    assert _gemms_run(lambda: logprobs(True)) == plan("linear_logprobs")
    p = stages.chunk_plan("linear_logprobs", n, v, d)
    assert p.kept_rows == keep_rows and p.rows_per_chunk == 7
    assert p.count("recompute") == (
        0 if keep_rows == n else len(stages.logprobs_spans(n, v, keep_rows))
    )
    assert _gemms_run(policy) == plan("linear_policy_loss")
    assert stages.chunk_plan("linear_policy_loss", n, v, d).count() == 3 * -(-n // 7)
    js = lambda kern: _chunked.linear_js(kern, h, hq, w, None, 1.0)  # noqa: E731
    assert _gemms_run(lambda: js(kern)) == plan("linear_js_distance", k=k, js_stacked=False)
    assert _gemms_run(lambda: js(_NoRowWork)) == plan("linear_js_distance", k=k)
    assert plan("linear_js_distance", k=k)[0] == -(-n // 6)
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "1")
    low = stages.chunk_plan("linear_logprobs", n, v, d, low_memory=True)

    def low_run():
        lp, ent, lse = _chunked.linear_logprobs_fwd(_NoRowWork, h, w, None, y, 1.0, -100, False)
        _chunked.linear_logprobs_bwd(_NoRowWork, h, w, None, y, lse, ent, one, ent, 1.0, -100)

    assert _gemms_run(low_run) == (low.count(), low.flops)
    assert low.low_memory and low.kept_rows == 0 and low.count("recompute") >= 1


def test_chunk_plan_and_row_kernel_check_their_arguments():
    from mrtpo_kernels import stages

    with pytest.raises(ValueError, match="op: expected one of"):
        stages.chunk_plan("linear_js", 4, 10, 2)
    with pytest.raises(ValueError, match="v: expected a positive integer"):
        stages.chunk_plan("linear_logprobs", 4, 0, 2)
    with pytest.raises(ValueError, match="backend: expected one of"):
        stages.row_kernel("cuda")
    assert callable(stages.row_kernel("torch").stats)


def test_policy_backward_scales_dw_without_a_second_fp32_copy(monkeypatch):
    """The policy loss keeps its fp32 dW from the forward; a backward with an upstream
    gradient other than 1 writes dW * g in the weight's dtype by row blocks (no fp32 [V, d]
    copy before the cast) and equals the upstream-1 gradient scaled."""
    import torch

    import mrtpo_kernels as mk

    n, d, v = 8, 64, 1000
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * d * 96))  # 96-row blocks, 11 of them
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.1).bfloat16().requires_grad_()
    b = torch.zeros(v).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    old, adv = torch.full((n,), -7.0), torch.randn(n, generator=g)

    def grads(scale):
        loss, _ = mk.linear_policy_loss(h, w, y, old, adv, bias=b, backend="torch")
        with torch.profiler.profile(profile_memory=True) as prof:
            gh, gw, gb = torch.autograd.grad(scale * loss, (h, w, b))
        biggest = max(e.self_cpu_memory_usage for e in prof.events())
        return gh, gw, gb, biggest

    _, gw1, gb1, _ = grads(1.0)
    _, gw, gb, biggest = grads(0.5)
    assert gw.dtype == torch.bfloat16 and gb.dtype == torch.bfloat16
    assert torch.equal(gw, gw1 * 0.5) and torch.equal(gb, gb1 * 0.5)  # exact: a power of 2
    assert biggest < 4 * v * d, biggest  # the bf16 result (2 V d) and fp32 blocks only


@pytest.mark.parametrize("rows", [16, 17, 33])
def test_16bit_gradient_view_gemms_ignore_the_buffers_other_half(monkeypatch, rows):
    # The 16-bit path writes each row's gradient into the first V bf16 slots of an fp32
    # logits row (row stride 2 V); the other V slots hold logit bits. torch's CPU bf16 GEMM
    # read past V on a row-strided operand (33 rows: NaN rows), so the head's GEMMs must
    # only ever see the V columns: NaN in the other half must not reach dh or dW.
    from mrtpo_kernels.backends import _chunked, torch_backend

    monkeypatch.setattr(_chunked, "f32_out_supported", lambda device, dtype: True)
    monkeypatch.setattr(
        _chunked, "_mm_f32", lambda a, b, out: torch.mm(a.float(), b.float(), out=out)
    )
    monkeypatch.setattr(_chunked, "_addmm_f32", lambda c, a, b: c.addmm_(a.float(), b.float()))
    monkeypatch.setattr(torch_backend, "GRAD_OUT", True, raising=False)
    gen = torch.Generator().manual_seed(rows)
    v, d = 900, 16
    h = torch.randn(rows, d, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=gen) * d**-0.5).to(torch.bfloat16)
    head = _chunked._Head(torch_backend, h, w, None)
    assert head.low
    z = torch.full((rows, v), float("nan"))
    g = head.grad_view(z)
    g.copy_(torch.randn(rows, v, generator=gen).to(torch.bfloat16))
    want_dh = g.double() @ w.double()
    want_dw = g.double().t() @ h.double()
    dh = torch.empty_like(h)
    dw = torch.zeros(v, d)
    head.backward(g, h, dh, dw, None)
    torch.testing.assert_close(dh.double(), want_dh, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dw.double(), want_dw, atol=1e-4, rtol=1e-4)


class _NormRecorder:
    """A row kernel that takes norm= (as the Triton row kernels do) and records what the
    low-memory driver hands it: the (2, rows) slices stats writes into and the buffer
    grad_cols_ reads. Values: stats fills its slice with the row indices."""

    NORM = True

    def __init__(self):
        self.stats_norms, self.cols_norms = [], []

    def stats(self, z, labels, inv_t, ignore_index, with_ent, norm=None):
        n = z.shape[0]
        if norm is not None:
            self.stats_norms.append(norm)
            norm.copy_(torch.arange(len(self.stats_norms) * 1000, len(self.stats_norms) * 1000 + n)
                       .float().expand(2, n))  # fmt: skip
        return z.new_zeros(n), (z.new_zeros(n) if with_ent else None), z.new_zeros(n)

    def grad_cols_(self, z, *args, out=None, norm=None):
        self.cols_norms.append(norm)
        z.zero_()

    @staticmethod
    def policy_terms(logp, *args):
        n = logp.shape[0]
        return logp.new_zeros(n), logp.new_zeros(n), logp.new_zeros(n)


def test_low_memory_driver_hands_the_norm_buffer_to_the_column_kernel(monkeypatch):
    """Where the kernel takes norm= (a declared capability, not a name), the
    low-memory log-probs forward fills the column slices [:, a:b] of one (2, N) fp32 buffer
    by token chunks and its backward passes that buffer to every grad_cols_ call (found
    under lse, as the kept logits); the low-memory policy loss passes its own. A kernel
    without norm= (cpu, torch, a plain grad_cols_) gets none."""
    from mrtpo_kernels.backends import _chunked, torch_backend

    n, d, v = 21, 4, 50
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "1")
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * v * 8))  # 8-row token chunks
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    one = torch.ones(n)
    assert _chunked._takes_norm(_NormRecorder())
    assert not _chunked._takes_norm(torch_backend.ROW_KERNEL)
    assert not _chunked._takes_norm(_NoRowWork)
    for path in ("logprobs", "policy"):
        kern = _NormRecorder()
        if path == "logprobs":
            _, ent, lse = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
            _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, 1.0, -100)
        else:
            _chunked.linear_policy_loss(
                kern, h, w, None, y, -one, one, one, one[:0], 1.0, 0.2, 0.2, 0.0, -100, True
            )
        widths = [s.shape[1] for s in kern.stats_norms]  # token chunks of at most 8 rows
        assert sum(widths) == n and max(widths) <= 8 and len(widths) == 3, (path, widths)
        buf = kern.cols_norms[0]
        assert buf is not None and buf.shape == (2, n) and buf.dtype == torch.float32, path
        assert len(kern.cols_norms) >= 2 and all(c is buf for c in kern.cols_norms), path
        a = 0
        for s in kern.stats_norms:  # each slice is the view [:, a:b] of that buffer
            assert s.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), path
            assert s.stride() == (n, 1) and torch.equal(buf[:, a : a + s.shape[1]], s), path
            a += s.shape[1]
    # the log-probs' entry: read by every backward of the same forward (not taken), never
    # by one at another temperature, and dropped with lse
    kern = _NormRecorder()
    _, ent, lse = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
    for temp in (1.0, 1.0, 0.5):
        kern.cols_norms.clear()
        _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, temp, -100)
        assert kern.cols_norms and all((c is None) == (temp != 1.0) for c in kern.cols_norms)
    key = lse.data_ptr()
    assert key in _chunked._NORM
    del lse
    assert key not in _chunked._NORM
