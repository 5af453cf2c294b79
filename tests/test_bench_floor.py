"""The gemm-floor provider runs the GEMM FLOPs of our chunk driver and nothing else; the
Cut Cross-Entropy provider's CPU path computes what ours does; the summary puts every op
beside its floor and prints issue 12's CPU verdicts. Tiny shapes: seconds."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import providers, summary
from bench.workloads import make_inputs

N, D, V, K = 40, 16, 300, 3


_GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_")


def _gemms(fn) -> tuple[int, int]:
    """(GEMM calls, the FLOPs the profiler counts for them) of fn(), also inside custom ops
    (the profiler sees every aten call; FlopCounterMode stops at a custom op)."""
    with torch.profiler.profile(with_flops=True) as prof:
        fn()
    ev = [e for e in prof.events() if e.name in _GEMMS]
    return len(ev), sum(e.flops for e in ev)


def _ours_call(op, x):
    return providers.prepare("mrtpo-cpu", op, x, torch.device("cpu"))


@pytest.mark.parametrize("keep", ["0", str(4 * V * 13)])  # none kept / 13 rows kept
@pytest.mark.parametrize(
    "op",
    ["linear_logprobs_fwd", "linear_logprobs_fwd_bwd", "linear_policy_loss_fwd_bwd"],
)
def test_floor_runs_the_gemms_of_our_driver(monkeypatch, op, keep):
    """Same GEMM FLOPs as mrtpo-cpu (chunks of 7 rows, 40 tokens: a partial last chunk)."""
    if providers.availability("mrtpo-cpu") is not None:
        pytest.skip(providers.availability("mrtpo-cpu"))
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * V * 7))
    monkeypatch.setenv("MRTPO_KEEP_LOGITS_BYTES", keep)
    x = make_inputs(op, N, D, V, 0, torch.float32, "cpu", seed=1)
    floor = providers.prepare("gemm-floor", op, x, torch.device("cpu"))
    got = _gemms(floor)
    want = _gemms(_ours_call(op, x))
    x.clear_grads()
    assert got == want
    chunks = -(-N // 7)  # with a backward, at least 2 GEMMs per chunk (dH, dW)
    assert got[0] >= (1 if op == "linear_logprobs_fwd" else 2 * chunks)


def test_floor_js_counts_one_stacked_gemm_per_chunk(monkeypatch):
    """JS one-vs-K: (1 + K) 2 N d V FLOPs, in ceil(N / C) GEMMs of (1 + K) C rows."""
    monkeypatch.setenv("MRTPO_JS_SCRATCH_BYTES", str(4 * V * (1 + K) * 6))  # C = 6 tokens
    x = make_inputs("linear_js_distance", N, D, V, K, torch.float32, "cpu", seed=2)
    floor = providers.prepare("gemm-floor", "linear_js_distance", x, torch.device("cpu"))
    with FlopCounterMode(display=False) as fc:
        out = floor()
    assert fc.get_total_flops() == (1 + K) * 2 * N * D * V
    assert out[0].shape[0] == K
    assert _gemms(floor) == (-(-N // 6), (1 + K) * 2 * N * D * V)


def test_floor_has_no_advantage_stage():
    x = make_inputs("advantages", 64, 0, 0, 2, torch.float32, "cpu", responses=4)
    with pytest.raises(providers.Unsupported, match="no GEMM"):
        providers.prepare("gemm-floor", "advantages", x, torch.device("cpu"))


@pytest.mark.skipif(
    importlib.util.find_spec("cut_cross_entropy") is None,
    reason="cut_cross_entropy is not installed (requirements.txt pins it)",
)
def test_cce_cpu_path_matches_ours():
    """On the CPU the cce provider runs impl="torch_compile": its loss is -log p(label),
    and with the upstream gradient negated its dh and dW equal ours."""
    if providers.availability("mrtpo-cpu") is not None:
        pytest.skip(providers.availability("mrtpo-cpu"))
    op = "linear_logprobs_fwd_bwd"
    x = make_inputs(op, N, D, V, 0, torch.float32, "cpu", seed=3)
    loss, dh, dw = (t.clone() for t in providers.prepare("cce", op, x, torch.device("cpu"))())
    logp, dh_ours, dw_ours = (t.clone() for t in _ours_call(op, x)())
    torch.testing.assert_close(-loss, logp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(dh, dh_ours, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dw, dw_ours, atol=2e-5, rtol=1e-4)
    with pytest.raises(providers.Unsupported, match="no equivalent"):
        js = make_inputs("linear_js_distance", 8, D, V, 1, torch.float32, "cpu")
        providers.prepare("cce", "linear_js_distance", js, torch.device("cpu"))


def _row(op, prov, n, k, ms, extra):
    return dict(op=op, provider=prov, N=str(n), K=str(k), d="896", dtype="float32",
                ms_p50=str(ms), extra_mem_mb=str(extra), peak_mem_mb="1", status="ok")  # fmt: skip


def test_summary_shows_floor_ratio_and_issue12_verdicts():
    lp, js = "linear_logprobs_fwd_bwd", "linear_js_distance"
    rows = [
        _row(lp, "mrtpo-cpu", 2048, 0, 140.0, 400.0),
        _row(lp, "cce", 2048, 0, 145.0, 1400.0),
        _row(lp, "gemm-floor", 2048, 0, 100.0, 300.0),
        _row(js, "mrtpo-cpu", 2048, 4, 130.0, 300.0),
        _row(js, "gemm-floor", 2048, 4, 100.0, 300.0),
    ]
    rows[0]["cpu_ms_p50"], rows[1]["cpu_ms_p50"] = "120", "150"
    rows[0]["load_avg"] = "2.50/3.00"
    text = "\n".join(summary.cpu_peer_targets(rows))
    assert "- PASS N=2048 linear_logprobs_fwd_bwd: time mrtpo-cpu / cce <= 1: 0.966x" in text
    assert "(CPU time 0.8x)" in text
    assert "CPU time 120 ms; load 2.50/3.00 |" in "\n".join(summary.results_table(rows))
    assert "- PASS N=2048 linear_logprobs_fwd_bwd: extra memory mrtpo-cpu / cce <= 1/3" in text
    assert "- FAIL N=2048 linear_js_distance K=4: time mrtpo-cpu / gemm-floor <= 1.2: 1.3x" in text
    floor = "\n".join(summary.floor_table(rows))
    assert "| linear_logprobs_fwd_bwd | 896 | 2048 | 0 | float32 | 100 | mrtpo-cpu 1.4x" in floor
    table = "\n".join(summary.results_table(rows))
    assert "| 1.45 |" in table  # cce's time over the floor
    rows[-1]["status"] = "error"
    text = "\n".join(summary.cpu_peer_targets(rows))
    assert "- NOT MEASURED N=2048 linear_js_distance K=4" in text


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_kept_logits_save_the_recompute_and_are_released(monkeypatch, backend):
    """MRTPO_KEEP_LOGITS_BYTES: the kept rows cost no recompute in the backward, gradients
    equal the float64 reference whatever is kept, the kept logits travel as the forward's
    ``saved`` output (k x V floats, read and never written by the backward: a second
    backward gives the same gradient) and are freed with the graph; no module table."""
    import weakref

    import mrtpo_kernels as mk
    from mrtpo_kernels import logprobs
    from mrtpo_kernels import reference as ref
    from mrtpo_kernels.backends import (
        _chunk_backward,
        _chunk_sizes,
        _chunked,
        _chunked_js,
        _chunked_logprobs,
        _chunked_policy,
        _row_lanes,
        _saved_state,
    )

    if backend not in mk.available_backends("linear_logprobs", torch.device("cpu"), torch.float32):
        pytest.skip(f"backend {backend} not available")
    driver = (_chunked, _chunked_logprobs, _chunked_js, _chunked_policy, _chunk_backward)
    for mod in (*driver, _chunk_sizes, _row_lanes, _saved_state):
        assert not [name for name in vars(mod) if name in ("_KEPT", "_NORM")]
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", str(4 * V * 7))
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, V, (N,), generator=g)
    y[3] = -100
    gl = torch.randn(N, generator=g, dtype=torch.float64)
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (ref.linear_logprobs_ref(h64, w64, y) * gl).sum().backward()
    counts = {}
    for keep in (0, 13, 100):  # none, the last 13 rows, all 40
        monkeypatch.setenv("MRTPO_KEEP_LOGITS_BYTES", str(4 * V * keep))
        h32, w32 = h.float().requires_grad_(True), w.float().requires_grad_(True)
        out = logprobs.linear_logprobs_fwd_op(h32, w32, None, y, 1.0, -100, False, backend)
        assert out[3].shape == (min(keep, N) * V,) and out[3]._base is None
        ref_saved = weakref.ref(out[3])
        before = out[3].clone()
        (gh1,) = torch.autograd.grad((out[0] * gl.float()).sum(), h32, retain_graph=True)
        assert torch.equal(out[3], before)  # read, not written
        (gh2,) = torch.autograd.grad((out[0] * gl.float()).sum(), h32)
        # the same gradient up to the CPU GEMM's own rounding: with 2 threads a GEMM's
        # thread partition and operand alignment vary between calls (seen: 1 ulp, 6e-8, on
        # the rows of one thread's share of a chunk); a kept block the first backward had
        # written would be off by O(1)
        torch.testing.assert_close(gh1, gh2, rtol=1e-6, atol=1e-7)
        del out, gh1, gh2
        assert ref_saved() is None  # released with the graph

        def step(h32=h32, w32=w32):
            lp = mk.linear_logprobs(h32, w32, y, backend=backend)
            lp.backward(gl.float())

        counts[keep] = _gemms(step)[0]
        torch.testing.assert_close(h32.grad.double(), h64.grad, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(w32.grad.double(), w64.grad, atol=2e-6, rtol=1e-5)
    assert counts[0] == 4 * 6  # 6 spans of <= 7 rows: forward 1, backward 3 each
    # 13 kept rows: one GEMM forward and, copied into the 7-row chunk, dh and dW per chunk
    # (2 chunks); the 27 others: forward in 3 spans of 9 rows (the kept block, 13 rows, is
    # the span limit), backward in 4 chunks of <= 7 rows, 3 GEMMs each
    assert counts[13] == (1 + 3) + 2 * 2 + 4 * 3
    assert counts[100] == 1 + 6 * 2  # all 40 rows kept: no recompute


def test_keep_logits_setting_is_read():
    from mrtpo_kernels import settings

    assert settings.keep_logits_bytes() >= 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MRTPO_KEEP_LOGITS_BYTES", "-1")
        with pytest.raises(ValueError, match="MRTPO_KEEP_LOGITS_BYTES"):
            settings.keep_logits_bytes()
        mp.setenv("MRTPO_KEEP_LOGITS_BYTES", "0")
        assert settings.keep_logits_bytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_js_stacked_chunks_against_reference(monkeypatch, dtype):
    """The CPU backend's stacked JS path (one GEMM of the 1 + K streams per chunk, then
    _C.js_many): chunk boundaries with a partial last chunk, K = 1, 3, and the non-finite
    contract (a NaN or +inf logit row gives NaN, not 0) against the float64 reference."""
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as ref

    if providers.availability("mrtpo-cpu") is not None:
        pytest.skip(providers.availability("mrtpo-cpu"))
    n, v = 23, 257
    g = torch.Generator().manual_seed(7)
    for k in (1, 3):
        streams = 1 + k
        monkeypatch.setenv("MRTPO_JS_SCRATCH_BYTES", str(8 * v * streams * 5))  # <= 10 tokens
        h = torch.randn(n, D, generator=g, dtype=torch.float64)
        w = torch.randn(v, D, generator=g, dtype=torch.float64) * 0.4
        hq = h + 0.5 * torch.randn(k, n, D, generator=g, dtype=torch.float64)
        want = ref.linear_js_distance_ref(h, hq, w)
        got = mk.linear_js_distance(h.to(dtype), hq.to(dtype), w.to(dtype), backend="cpu")
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        bad = hq.clone()
        bad[k - 1, 11, 0] = float("nan")  # a NaN hidden value makes that Q row's logits NaN
        got = mk.linear_js_distance(h.to(dtype), bad.to(dtype), w.to(dtype), backend="cpu")
        assert torch.isnan(got[k - 1, 11]) and torch.isfinite(got[:, :11]).all()
        assert torch.isfinite(got[:, 12:]).all()
