"""The chunk driver (mrtpo_kernels/backends/_chunked.py) with every row-kernel
implementation (torch, cpu, Triton under the interpreter), and the Triton row kernels
(mrtpo_kernels/triton_kernels/rows.py) on their own, against the float64 references.

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
from triton_cases._harness import CASES, interpreted, run_groups, run_interpreted

from mrtpo_kernels import PolicyLossSettings
from mrtpo_kernels.backends.contract import RowKernel

CFG = PolicyLossSettings()  # the policy loss's defaults (temperature 1, clip 0.2, no KL)


@interpreted
def test_row_kernels_and_chunk_driver_under_interpreter():
    run_interpreted(CASES / "rows_cases.py")


@interpreted
def test_row_kernels_with_a_row_block_override(monkeypatch):
    """MRTPO_ROW_BLOCK (the GPU tuning knob) reaches the launchers, and the row kernels keep
    the float64 reference at a block smaller than the interpreter's default (64 columns, 2
    warps: every row takes many steps)."""
    from mrtpo_kernels.triton_kernels import row_math

    monkeypatch.setenv("MRTPO_ROW_BLOCK", "64,2")
    assert (row_math.row_block(151936), row_math._warps(64)) == (64, 2)
    monkeypatch.delenv("MRTPO_ROW_BLOCK")
    assert row_math.row_block(151936) in (1024, 2048)  # interpreter / GPU default
    out = run_groups(CASES / "rows_cases.py", "row_kernels", env={"MRTPO_ROW_BLOCK": "64,2"})
    assert "row_kernels" in out


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
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_f32_out_probe_on_cpu_is_false_or_exact():
    """The run-time check of torch.mm(out_dtype=float32): CPU torch has no such kernel, so
    the driver upcasts there; where it exists the probe has checked it is exact."""
    import torch

    from mrtpo_kernels.backends import _lm_head

    got = _lm_head.f32_out_supported(torch.device("cpu"), torch.bfloat16)
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


class _NoRowWork(RowKernel):
    """A row kernel that does nothing (zeros), with the optional methods, so the driver's
    stacked-JS and low-memory paths run on the CPU without triton."""

    JS_MANY = True
    GRAD_COLS = True

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
    """mrtpo_kernels.chunk_plan.chunk_plan counts the GEMMs (and FLOPs) of real driver calls:
    log-probs forward, forward + backward (kept rows), policy loss, JS per stream and
    stacked, and the low-memory backward; chunks of 7 rows, 40 tokens (a partial chunk)."""
    import torch

    from mrtpo_kernels import chunk_plan
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
        lp, ent, lse, saved = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
        if backward:
            _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, 1.0, -100, saved)

    def policy():
        _chunked.linear_policy_loss(kern, h, w, None, y, -one, one, one, one[:0], CFG, True)

    def plan(op, **kw):
        p = chunk_plan.chunk_plan(op, n, v, d, **kw)
        return p.count(), p.flops

    assert _gemms_run(lambda: logprobs(False)) == plan("linear_logprobs", backward=False)
    assert _gemms_run(lambda: logprobs(True)) == plan("linear_logprobs")
    p = chunk_plan.chunk_plan("linear_logprobs", n, v, d)
    assert p.kept_rows == keep_rows and p.rows_per_chunk == 7
    # the backward recomputes the rows it did not keep by chunks of 7 (in place mode)
    assert p.count("recompute") == len(chunk_plan.balanced(n - keep_rows, 7))
    assert _gemms_run(policy) == plan("linear_policy_loss")
    assert chunk_plan.chunk_plan("linear_policy_loss", n, v, d).count() == 3 * -(-n // 7)
    js = lambda kern: _chunked.linear_js_distance(kern, h, hq, w, None, 1.0)  # noqa: E731
    assert _gemms_run(lambda: js(kern)) == plan("linear_js_distance", k=k, js_stacked=False)
    assert _gemms_run(lambda: js(_NoRowWork)) == plan("linear_js_distance", k=k)
    assert plan("linear_js_distance", k=k)[0] == -(-n // 6)
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "1")
    low = chunk_plan.chunk_plan("linear_logprobs", n, v, d, low_memory=True)

    def low_run():
        out = _chunked.linear_logprobs_fwd(_NoRowWork, h, w, None, y, 1.0, -100, False)
        lp, ent, lse, saved = out
        _chunked.linear_logprobs_bwd(
            _NoRowWork, h, w, None, y, lse, ent, one, ent, 1.0, -100, saved
        )

    assert _gemms_run(low_run) == (low.count(), low.flops)
    assert low.low_memory and low.kept_rows == 0 and low.count("recompute") >= 1


def test_chunk_plan_and_row_kernel_check_their_arguments():
    from mrtpo_kernels import chunk_plan

    with pytest.raises(ValueError, match="op: expected one of"):
        chunk_plan.chunk_plan("js_distance", 4, 10, 2)  # no fused LM head
    with pytest.raises(ValueError, match="v: expected a positive integer"):
        chunk_plan.chunk_plan("linear_logprobs", 4, 0, 2)
    with pytest.raises(ValueError, match="backend: expected one of"):
        chunk_plan.row_kernel("cuda")
    assert callable(chunk_plan.row_kernel("torch").stats)


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


class _OutKernel(RowKernel):
    """A row kernel with ``out=`` (as the Triton row kernels declare by GRAD_OUT) built on an
    in-place one: the gradient is computed on a copy of the logits and written into out, so
    the driver's 16-bit path (separate 16-bit gradient buffer) runs with the torch and C++
    kernels on the CPU. The logits are read only, as the contract has it for ``out=`` (a
    driver that took the gradient from them would fail the float64 comparison)."""

    GRAD_OUT = True

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def stats(self, *args, **kwargs):
        return self.inner.stats(*args, **kwargs)

    def grad_(self, z, *args, out=None):
        self.calls.append(z.shape[0])
        zz = z.clone()
        self.inner.grad_(zz, *args)
        out.copy_(zz)

    def policy_(self, z, *args, out=None, **kwargs):
        self.calls.append(z.shape[0])
        zz = z.clone()
        res = self.inner.policy_(zz, *args, **kwargs)
        if out is not None:
            out.copy_(zz)
        return res


def _emulate_f32_out(monkeypatch):
    """CPU torch has no 16-bit GEMM with fp32 output: emulate it (exact fp32 products of
    the 16-bit operands) so the driver takes its 16-bit path here."""
    monkeypatch.setattr(_lm_head_mod(), "f32_out_supported", lambda device, dtype: True)
    monkeypatch.setattr(
        _lm_head_mod(), "mm_f32", lambda a, b, out: torch.mm(a.float(), b.float(), out=out)
    )
    monkeypatch.setattr(_lm_head_mod(), "addmm_f32", lambda c, a, b: c.addmm_(a.float(), b.float()))


def _lm_head_mod():
    from mrtpo_kernels.backends import _lm_head

    return _lm_head


def test_balanced_spans():
    from mrtpo_kernels import chunk_plan

    for n in (0, 1, 7, 40, 41, 16384):
        for cap in (1, 3, 7, 441, 2048, 10**6):
            spans = chunk_plan.balanced(n, cap, 5)
            sizes = [e - s for s, e in spans]
            assert sum(sizes) == n and all(0 < x <= cap for x in sizes)
            assert len(spans) == -(-n // cap)  # the fewest spans
            assert not sizes or max(sizes) - min(sizes) <= 1  # no small tail
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert not spans or spans[0][0] == 5


def test_plan_sizes_at_the_target_shape():
    """The default plan at V = 151936, d = 4096, N = 16384 bf16 (16-bit path): 8 gradient
    buffers of 2048 rows (K of every dW GEMM), each filled by 5 logits chunks of 409-410
    fp32 rows, dW written by the first GEMM and accumulated by the 7 others; extra memory
    under 1 GB (log-probs: the 110 kept rows' buffer first, then 8 of 2034-2035 rows); the
    old plan's 38 chunks of 441 rows (tail 67) are gone."""
    from mrtpo_kernels import chunk_plan

    n, v, d = 16384, 151936, 4096
    p = chunk_plan.chunk_plan("linear_policy_loss", n, v, d, grad16=True)
    dws = [g for g in p.gemms if g.stage == "dw"]
    assert len(dws) == 8 and {g.k for g in dws} == {2048} and p.grad_rows == 2048
    assert [g.accumulate for g in dws] == [False] + [True] * 7
    logits = [g.m for g in p.gemms if g.stage == "logits"]
    assert len(logits) == 40 and set(logits) <= {409, 410}
    assert [g.m for g in p.gemms if g.stage == "dh"] == [2048] * 8
    assert p.flops == 6 * n * d * v
    assert p.buffer_bytes < 10**9
    lp = chunk_plan.chunk_plan("linear_logprobs", n, v, d, grad16=True)
    assert lp.kept_rows == 110 and lp.buffer_bytes < 10**9  # 64 MiB of fp32 rows kept
    assert {g.k for g in lp.gemms if g.stage == "dw"} == {110, 2034, 2035}
    assert lp.count("recompute") == 40  # the 16274 others, by 409-410-row chunks
    # fp32 in place (cpu, torch): the logits chunk is the gradient buffer
    p32 = chunk_plan.chunk_plan("linear_policy_loss", n, v, 896)
    assert p32.rows_per_chunk == 441  # 256 MiB of fp32 rows, balanced: 38 of 431-432
    assert (
        {g.m for g in p32.gemms if g.stage == "logits"}
        == {431, 432}
        == {g.k for g in p32.gemms if g.stage == "dw"}
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("keep", [0, 5, 13])
def test_16bit_path_against_float64(monkeypatch, backend, keep):
    """The driver's 16-bit path (separate 16-bit gradient buffer, dh and dW once per
    buffer, the first dW GEMM written) with the torch and C++ row kernels at odd shapes
    (N = 37, V = 611, d = 24; logits chunks of 4 rows, gradient buffers of 9 rows, kept
    rows 0 / 5 / 13) against the float64 references, and its GEMMs (count, FLOPs, the
    first dW a plain mm) against chunk_plan.chunk_plan(..., grad16=True)."""
    from mrtpo_kernels import chunk_plan
    from mrtpo_kernels import reference as ref
    from mrtpo_kernels.backends import _chunked

    if backend == "cpu" and not _cpu_available():
        pytest.skip("C++ extension not built")
    n, v, d = 37, 611, 24
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * v * 4))
    monkeypatch.setenv("MRTPO_GRAD_BUFFER_BYTES", str(2 * v * 9))
    monkeypatch.setenv("MRTPO_KEEP_LOGITS_BYTES", str(4 * v * keep))
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "0")
    _emulate_f32_out(monkeypatch)
    kern = _OutKernel(chunk_plan.row_kernel(backend))
    gen = torch.Generator().manual_seed(keep)
    h = torch.randn(n, d, generator=gen).bfloat16()
    w = (torch.randn(v, d, generator=gen) * d**-0.5).bfloat16()
    b = (torch.randn(v, generator=gen) * 0.1).bfloat16()
    y = torch.randint(0, v, (n,), generator=gen)
    y[::6] = -100
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    h64, w64, b64 = (t.double().requires_grad_() for t in (h, w, b))
    rl, re = ref.linear_logprobs_ref(h64, w64, y, bias=b64, temperature=0.8, return_entropy=True)
    want = torch.autograd.grad((rl * g).sum() + (re * ge).sum(), (h64, w64, b64))
    assert _lm_head_mod().Head(kern, h, w, b).low

    def run():
        lp, en, lse, saved = _chunked.linear_logprobs_fwd(kern, h, w, b, y, 0.8, -100, True)
        before = saved.clone()
        grads = _chunked.linear_logprobs_bwd(kern, h, w, b, y, lse, en, g, ge, 0.8, -100, saved)
        assert torch.equal(saved, before)  # the kept logits are read, never written
        return (lp, en) + grads

    lp, en, dh, dw, db = run()
    tol = dict(atol=2e-2, rtol=2e-2)
    for got, exp in ((lp, rl), (en, re), (dh, want[0]), (dw, want[1]), (db, want[2])):
        torch.testing.assert_close(got.double(), exp.detach(), **tol)
    assert kern.calls and max(kern.calls) <= 4
    plan = chunk_plan.chunk_plan("linear_logprobs", n, v, d, grad16=True)
    assert plan.kept_rows == keep and plan.grad_rows <= 9
    assert _gemms_run(run) == (plan.count(), plan.flops)
    events = _gemm_events(run)
    first_dw = next(e for e in events if e[1] == (v, d))  # the first (V, d) output
    assert first_dw[0] == "aten::mm"  # written, not accumulated into zeros
    # the policy loss on the same path
    old, adv = torch.full((n,), -6.5), torch.randn(n, generator=gen)
    mask = (y != -100).float()
    tw = mask / mask.sum()
    kern.calls.clear()
    cfg = PolicyLossSettings(temperature=0.8)
    loss, lp2, cl, dh2, dw2, db2 = _chunked.linear_policy_loss(
        kern, h, w, b, y, old, adv, tw, tw[:0], cfg, True
    )
    h64, w64, b64 = (t.double().requires_grad_() for t in (h, w, b))
    rloss, _ = ref.linear_policy_loss_ref(
        h64, w64, y, old.double(), adv.double(), bias=b64, temperature=0.8
    )
    rg = torch.autograd.grad(rloss, (h64, w64, b64))
    torch.testing.assert_close(loss.double(), rloss.detach(), **tol)
    for got, exp in ((dh2, rg[0]), (dw2, rg[1]), (db2, rg[2])):
        torch.testing.assert_close(got.double(), exp, **tol)
    pp = chunk_plan.chunk_plan("linear_policy_loss", n, v, d, grad16=True)
    assert pp.count("dw") == -(-n // 9) and max(kern.calls) <= 4


def _cpu_available() -> bool:
    from mrtpo_kernels import backends

    return backends.load("cpu") is not None


def _gemm_events(fn):
    """(name, output shape) of every GEMM of fn() in order."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    out = []
    for e in prof.events():
        if e.name in _GEMM_EVENTS:
            first = 0 if e.name == "aten::mm" else 1
            (m, _), (_, cols) = e.input_shapes[first : first + 2]
            out.append((e.name, (m, cols)))
    return out


class _NormRecorder(RowKernel):
    """A row kernel that takes norm= (as the Triton row kernels do) and records what the
    low-memory driver hands it: the (2, rows) slices stats writes into and the buffer
    grad_cols_ reads. Values: stats fills its slice with the row indices."""

    NORM = True
    GRAD_COLS = True

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
    from mrtpo_kernels.backends import _chunked, _saved_state, torch_backend

    n, d, v = 21, 4, 50
    monkeypatch.setenv("MRTPO_LOW_MEMORY", "1")
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * v * 8))  # 8-row token chunks
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    one = torch.ones(n)
    assert _saved_state.takes_norm(_NormRecorder())
    assert not _saved_state.takes_norm(torch_backend.ROW_KERNEL)
    assert not _saved_state.takes_norm(_NoRowWork)
    for path in ("logprobs", "policy"):
        kern = _NormRecorder()
        if path == "logprobs":
            _, ent, lse, saved = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
            _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, 1.0, -100, saved)
        else:
            _chunked.linear_policy_loss(kern, h, w, None, y, -one, one, one, one[:0], CFG, True)
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
    # the log-probs' norm travels as the forward's saved output ((2, N) floats, the buffer
    # stats wrote), read by every backward given it (not written); none without it
    kern = _NormRecorder()
    _, ent, lse, saved = _chunked.linear_logprobs_fwd(kern, h, w, None, y, 1.0, -100, False)
    assert saved.shape == (2 * n,) and saved._base is None
    assert saved.data_ptr() == kern.stats_norms[0].untyped_storage().data_ptr()
    before = saved.clone()
    for given in (saved, saved, None):
        kern.cols_norms.clear()
        _chunked.linear_logprobs_bwd(kern, h, w, None, y, lse, ent, one, ent, 1.0, -100, given)
        assert kern.cols_norms
        assert all((c is None) == (given is None) for c in kern.cols_norms)
        assert all(c is None or c.data_ptr() == saved.data_ptr() for c in kern.cols_norms)
    assert torch.equal(saved, before)


class _Recorder:
    """Recording stand-ins for CUDA streams and events (and Tensor.record_stream): every
    call lands in ``log`` in order, so the overlap's stream ordering can be checked on the
    CPU (the GPU test compares the overlap bitwise with the serial driver)."""

    def __init__(self, monkeypatch):
        log = self.log = []

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.id = Event.count

            def record(self, stream):
                log.append(("record", stream.name, self.id))

        class Stream:
            def __init__(self, name="side", device=None):
                self.name = name

            def wait_event(self, ev):
                log.append(("wait", self.name, ev.id))

            def wait_stream(self, other):
                log.append(("wait_stream", self.name, other.name))

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                log.append(("enter", self.stream.name))

            def __exit__(self, *exc):
                log.append(("exit", self.stream.name))

        self.main = Stream("main")
        self.storages = {}  # id of a storage -> a name given by the test

        def record_stream(t, stream):
            name = self.storages.get(t.untyped_storage().data_ptr(), "other")
            log.append(("record_stream", name, stream.name))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.main)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)

    def name(self, t, name):
        self.storages[t.untyped_storage().data_ptr()] = name


def test_row_lanes_order_the_streams(monkeypatch):
    """MRTPO_OVERLAP_ROWS's stream ordering, checked on the CPU with recording stand-ins:
    each row kernel waits for its own chunk's logits GEMM, a GEMM into a buffer waits for
    the row kernel that last read that buffer, the two buffers alternate and are held for
    the side stream (record_stream), and join makes the current stream wait for the side
    stream."""
    from mrtpo_kernels.backends import _row_lanes

    rec = _Recorder(monkeypatch)
    log = rec.log
    z_buf = torch.zeros(2, 3)
    lanes = _row_lanes._RowLanes(z_buf, torch.zeros(1))
    assert log == [("record_stream", "other", "side")] * 2  # both chunk buffers, at once
    log.clear()
    bufs = {id(b.untyped_storage()): i for i, b in enumerate(lanes.bufs)}
    seen = []

    def gemm(zb, chunk):
        log.append(("gemm", bufs[id(zb.untyped_storage())]))
        return zb.fill_(chunk)

    def row_fn(z, g, a, b):
        log.append(("row", a))
        seen.append((a, z[0, 0].item()))

    for chunk in range(4):
        lanes.run(lambda zb, c=chunk: gemm(zb, c), row_fn, None, chunk, chunk + 1)
    lanes.join()
    assert seen == [(c, float(c)) for c in range(4)]  # each row kernel saw its own chunk
    gemms = [e[1] for e in log if e[0] == "gemm"]
    assert gemms == [0, 1, 0, 1]
    # per chunk: [wait for the buffer's last reader], gemm, record ready on main, enter side,
    # side waits for ready, row kernel, record done on side, exit
    ready = {}
    done = {}
    i = 0
    for chunk in range(4):
        if chunk >= 2:
            assert log[i] == ("wait", "main", done[chunk - 2])
            i += 1
        assert log[i] == ("gemm", chunk % 2)
        kind, stream, ready[chunk] = log[i + 1]
        assert (kind, stream) == ("record", "main")
        assert log[i + 2] == ("enter", "side")
        assert log[i + 3] == ("wait", "side", ready[chunk])
        assert log[i + 4] == ("row", chunk)
        kind, stream, done[chunk] = log[i + 5]
        assert (kind, stream) == ("record", "side")
        assert log[i + 6] == ("exit", "side")
        i += 7
    assert log[i:] == [("wait_stream", "main", "side")]
    # off the GPU, or with the setting off, the driver keeps its serial loop
    monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "1")
    assert not _row_lanes._RowLanes.enabled(True, torch.zeros(1))  # a CPU tensor
    monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "0")


class _FakeHead:
    """A stand-in for backends._lm_head.Head in the 16-bit path (``low``), logging its
    GEMMs; ``fail_at``: the number of the logits GEMM that raises (1-based), or 0."""

    low = True

    def __init__(self, log, rec, fail_at=0, fail_backward=False):
        self.log, self.rec, self.fail_at, self.fail_backward = log, rec, fail_at, fail_backward
        self.calls = 0

    def logits(self, h, buf):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("GEMM failed")
        self.log.append(("gemm", h.shape[0]))
        return buf[: h.shape[0]].fill_(float(self.calls))

    def grad_buffer(self, rows, cols, like):
        g = like.new_empty((rows, cols))
        self.rec.name(g, "grad buffer")
        return g

    def backward(self, g, h, dh_rows, dw, db, first):
        if self.fail_backward:
            raise RuntimeError("dh GEMM failed")
        self.log.append(("dh dw", h.shape[0]))


def _lanes_on_cpu(monkeypatch, rec):
    """Let the driver build its lanes on CPU tensors (the recording stand-ins run them), and
    name each lane buffer in the log by its order of creation."""
    from mrtpo_kernels.backends import _row_lanes

    made = []
    real_init = _row_lanes._RowLanes.__init__

    def init(self, z_buf, hidden):
        rec.name(z_buf, f"chunk {len(made) * 2}")
        real_empty = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t: rec_named(real_empty(t)))

        def rec_named(t):
            rec.name(t, f"chunk {len(made) * 2 + 1}")
            return t

        real_init(self, z_buf, hidden)
        monkeypatch.setattr(torch, "empty_like", real_empty)
        made.append(self)

    monkeypatch.setattr(_row_lanes._RowLanes, "__init__", init)
    monkeypatch.setattr(_row_lanes._RowLanes, "enabled", staticmethod(lambda wanted, h: wanted))
    return made


@pytest.mark.parametrize("fail", ["gemm", "row", "backward"])
def test_row_lanes_join_when_the_driver_raises(monkeypatch, fail):
    """The overlap's failure path (_run_backward, as the policy loss and the log-prob
    backward run it): an exception between a side-stream row kernel and the join (the next
    chunk's logits GEMM, a row kernel's launch, the dh / dW GEMMs) still makes the current
    stream wait for the side stream before the exception leaves the driver, after every
    side-stream launch; the chunk buffers and the gradient buffer's rows were held for the
    side stream (record_stream) before any side work on them was queued."""
    from mrtpo_kernels.backends import _chunk_backward, _row_lanes

    rec = _Recorder(monkeypatch)
    log = rec.log
    made = _lanes_on_cpu(monkeypatch, rec)
    n, v, c = 12, 5, 3  # 4 chunks of 3 rows in one gradient buffer of 12 rows
    monkeypatch.setenv("MRTPO_GRAD_BUFFER_BYTES", str(2 * v * n))
    head = _FakeHead(log, rec, fail_at=3 if fail == "gemm" else 0,
                     fail_backward=fail == "backward")  # fmt: skip
    rows_run = []

    def row_fn(z, g, a, b):
        if fail == "row" and a == 6:
            raise RuntimeError("row kernel launch failed")
        log.append(("row", a))
        rows_run.append(a)

    hidden = torch.zeros(n, 2)
    spans = [(0, n, False)]
    with pytest.raises(RuntimeError, match="failed"):
        _chunk_backward._run_backward(
            head, hidden, torch.zeros(v, 2), None, spans, None, 0, row_fn, c, need_dw=True
        )
    assert len(made) == 1
    # the join is the last thing, after every side-stream launch (an exit of the side context)
    assert log[-1] == ("wait_stream", "main", "side")
    last_exit = max(i for i, e in enumerate(log) if e == ("exit", "side"))
    assert last_exit < len(log) - 1
    assert log.count(("enter", "side")) == log.count(("exit", "side"))
    # the buffers the side stream touches are held for it before it is given work
    first_enter = log.index(("enter", "side"))
    held = {e[1] for e in log[:first_enter] if e[0] == "record_stream" and e[2] == "side"}
    assert {"chunk 0", "chunk 1", "grad buffer"} <= held
    assert rows_run == {"gemm": [0, 3], "row": [0, 3], "backward": [0, 3, 6, 9]}[fail]
    # the serial path, for comparison: no lanes, no stream calls
    monkeypatch.setattr(_row_lanes._RowLanes, "enabled", staticmethod(lambda wanted, h: False))
    log.clear()
    head = _FakeHead(log, rec)
    _chunk_backward._run_backward(
        head,
        hidden,
        torch.zeros(v, 2),
        None,
        spans,
        None,
        0,
        lambda z, g, a, b: None,
        c,
        need_dw=True,
    )
    assert [e[0] for e in log] == ["gemm"] * 4 + ["dh dw"]


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_row_lanes_cover_the_logprobs_forward(monkeypatch, fail_at):
    """The log-prob forward's statistics on the side stream (MRTPO_OVERLAP_ROWS=1): each
    span's stats after its own GEMM, the kept rows' GEMM into ``saved`` on the current
    stream and their stats on the side, one join at the end, also when a GEMM raises
    (fail_at: the failing logits GEMM; 0: none). Without a failure the outputs equal the
    serial forward's."""
    from mrtpo_kernels.backends import _chunked, _chunked_logprobs

    rec = _Recorder(monkeypatch)
    log = rec.log
    made = _lanes_on_cpu(monkeypatch, rec)
    n, v, d = 12, 50, 4
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * v * 3))  # 3-row spans
    monkeypatch.setenv("MRTPO_KEEP_LOGITS_BYTES", str(4 * v * 2))  # 2 kept rows

    class Kern:
        GRAD_OUT = True
        NORM = False

        @staticmethod
        def stats(z, labels, inv_t, ii, with_ent, **kw):
            log.append(("stats", z.shape[0]))
            return z[:, 0].clone(), (z[:, 1].clone() if with_ent else None), z[:, 2].clone()

    def fake_head(kern, hidden, weight, bias, cap=None):
        return _FakeHead(log, rec, fail_at=fail_at)

    monkeypatch.setattr(_chunked_logprobs, "Head", fake_head)
    monkeypatch.setattr(_chunked_logprobs, "_low_memory", lambda kern, weight: False)
    h, w = torch.zeros(n, d), torch.zeros(v, d)
    y = torch.zeros(n, dtype=torch.long)
    if fail_at:
        with pytest.raises(RuntimeError, match="GEMM failed"):
            _chunked.linear_logprobs_fwd(Kern, h, w, None, y, 1.0, -100, True)
        assert log[-1] == ("wait_stream", "main", "side")
        assert log.count(("enter", "side")) == log.count(("exit", "side")) == fail_at - 1
        return
    logp, ent, lse, saved = _chunked.linear_logprobs_fwd(Kern, h, w, None, y, 1.0, -100, True)
    assert len(made) == 1
    # 4 spans of 2-3 rows (10 rows), then the kept 2 rows: 5 GEMMs, 5 side launches
    kinds = [e[0] for e in log if e[0] in ("gemm", "stats", "enter", "wait_stream")]
    assert kinds == ["gemm", "enter", "stats"] * 5 + ["wait_stream"]
    assert saved.numel() == 2 * v and bool((saved.view(2, v) == 5.0).all())  # the kept GEMM
    # each row's statistics come from its own span's GEMM (the fake fills span i with i)
    want = torch.tensor([1.0] * 3 + [2.0] * 3 + [3.0] * 2 + [4.0] * 2 + [5.0] * 2)
    assert torch.equal(logp, want) and torch.equal(lse, want)


def test_plan_counts_the_overlap_chunk(monkeypatch):
    """MRTPO_OVERLAP_ROWS's second fp32 logits chunk is in the plan's buffer bytes (16-bit
    path: the backward's and policy loss's chunk, the log-prob forward's span buffer); the
    GEMMs and row passes do not change, and the fp32 path (no overlap there) keeps its
    bytes."""
    from mrtpo_kernels import chunk_plan

    n, v, d = 16384, 151936, 4096
    for op in ("linear_policy_loss", "linear_logprobs"):
        off = chunk_plan.chunk_plan(op, n, v, d, grad16=True, overlap=False)
        on = chunk_plan.chunk_plan(op, n, v, d, grad16=True, overlap=True)
        assert on.gemms == off.gemms and on.row_passes == off.row_passes
        chunk = on.rows_per_chunk * 4 * v  # the driver's chunk buffer: chunk_rows(V) rows
        assert on.buffer_bytes == off.buffer_bytes + chunk, op
        monkeypatch.setenv("MRTPO_OVERLAP_ROWS", "1")
        assert chunk_plan.chunk_plan(op, n, v, d, grad16=True).buffer_bytes == on.buffer_bytes
        assert chunk_plan.chunk_plan(op, n, v, 896).buffer_bytes == chunk_plan.chunk_plan(
            op, n, v, 896, overlap=False).buffer_bytes  # fmt: skip
        monkeypatch.delenv("MRTPO_OVERLAP_ROWS")


# --------------------------------------------------------------------------- bf16 operands, CPU


def _bf16_case(n=37, d=24, v=3001, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    hq = (h.float() + 0.5 * torch.randn(2, n, d, generator=g)).bfloat16()
    w = (0.3 * torch.randn(v, d, generator=g)).bfloat16()
    y = torch.randint(0, v, (n,), generator=g)
    return h, hq, w, y


def test_cpu_bf16_logits_path_is_exact_operands_fp32_accumulation(monkeypatch):
    """bf16 hidden states and head on the CPU: the logits GEMM runs in oneDNN's bf16 mode
    (the switch on inside the GEMM, restored after), and every output equals the fp32
    GEMM's on the same (upcast) operands up to the order of fp32 accumulation; against
    float64 both are within the error budget of plain PyTorch in bf16."""
    import torch

    import mrtpo_kernels as mk
    from mrtpo_kernels import reference
    from mrtpo_kernels.backends import _lm_head

    if not _lm_head._cpu_bf16_gemm_available():
        pytest.skip("this CPU's oneDNN has no bf16 GEMM")
    h, hq, w, y = _bf16_case()
    seen = []
    real = _lm_head.fp32_logits

    def spy(*a, **k):
        seen.append(torch.backends.mkldnn.matmul.fp32_precision)
        return real(*a, **k)

    before = torch.backends.mkldnn.matmul.fp32_precision
    monkeypatch.setattr(_lm_head, "fp32_logits", spy)
    out = {}
    for on in ("1", "0"):
        monkeypatch.setenv("MRTPO_CPU_BF16_GEMM", on)
        seen.clear()
        lp = mk.linear_logprobs(h, w, y, backend="cpu")
        d = mk.linear_js_distance(h, hq, w, backend="cpu")
        assert seen and set(seen) == ({"bf16"} if on == "1" else {before}), (on, seen)
        assert torch.backends.mkldnn.matmul.fp32_precision == before  # restored
        out[on] = (lp.float(), d.float())
    assert (out["1"][0] - out["0"][0]).abs().max() < 1e-4
    assert (out["1"][1] - out["0"][1]).abs().max() < 1e-4
    ref_lp = reference.linear_logprobs_ref(h.double(), w.double(), y)[0]
    plain = torch.log_softmax((h @ w.t()).float(), -1).gather(1, y[:, None])[:, 0]
    budget = 2 * (plain.double() - ref_lp).abs().max().item() + 1e-5
    assert (out["1"][0].double() - ref_lp).abs().max().item() <= budget
    from mrtpo_kernels import chunk_plan

    monkeypatch.setenv("MRTPO_CPU_BF16_GEMM", "1")
    assert chunk_plan.gemm_path("cpu", "cpu", torch.bfloat16).endswith("bf16-operand logits")
    monkeypatch.setenv("MRTPO_CPU_BF16_GEMM", "0")
    assert chunk_plan.gemm_path("cpu", "cpu", torch.bfloat16) == "fp32"
    assert chunk_plan.gemm_path("cpu", "cpu", torch.float32) == "fp32"


def test_cpu_bf16_logits_rows_do_not_depend_on_the_batch():
    """The replay's bit-for-bit skip needs a token's JS to be the same whichever other rows
    share its GEMM: on the bf16 path too, every row of a call equals the same row computed
    in a call of fewer rows."""
    import torch

    import mrtpo_kernels as mk
    from mrtpo_kernels.backends import _lm_head

    if not _lm_head._cpu_bf16_gemm_available():
        pytest.skip("this CPU's oneDNN has no bf16 GEMM")
    h, hq, w, _ = _bf16_case(n=64, d=64, v=8192, seed=1)
    full = mk.linear_js_distance(h, hq, w, backend="cpu")
    for s, e in ((0, 4), (5, 9), (10, 27), (31, 64)):
        part = mk.linear_js_distance(h[s:e], hq[:, s:e], w, backend="cpu")
        assert torch.equal(part, full[:, s:e]), (s, e)
    one = mk.linear_js_distance(h[3:7], hq[:1, 3:7], w, backend="cpu")
    assert torch.equal(one, full[:1, 3:7])


@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_bf16_logits_blocked_upcast_equals_one_gemm(monkeypatch, with_bias):
    """The bf16-operand logits GEMM upcasts the head a block of rows at a time (no fp32 copy
    of the whole head per call): every logit equals, bit for bit, the one-GEMM product of
    the upcast operands in the same bf16 mode, for blocks that do not divide the vocabulary;
    a forward-only call never makes the whole fp32 copy."""
    from types import SimpleNamespace

    import torch

    from mrtpo_kernels.backends import _lm_head

    if not _lm_head._cpu_bf16_gemm_available():
        pytest.skip("this CPU's oneDNN has no bf16 GEMM")
    h, _, w, _ = _bf16_case(n=37, d=48, v=1000, seed=2)
    b = (torch.randn(1000, generator=torch.Generator().manual_seed(3))).bfloat16()
    bias = b if with_bias else None
    monkeypatch.setattr(_lm_head, "WEIGHT_BLOCK_BYTES", 4 * 48 * 300)  # blocks of 300 rows
    assert _lm_head.weight_block_rows(1000, 48) == 300
    head = _lm_head.Head(SimpleNamespace(GRAD_OUT=False), h, w, bias)  # the cpu kernel's path
    assert head.bf16_operands
    got = head.logits(h, torch.empty(37, 1000))
    assert head._w is None  # no whole fp32 copy of the head
    with _lm_head.bf16_operand_gemms():
        want = h.float() @ w.float().t()
        if with_bias:
            want = torch.addmm(b.float(), h.float(), w.float().t())
    assert torch.equal(got, want)
    assert torch.equal(head.w, w.float())  # the backward's copy, made when asked
