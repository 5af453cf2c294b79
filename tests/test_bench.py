"""The benchmark suite: FLOP formulas, memory estimates, the baselines' math against the
float64 reference, a smoke run writing CSV + Markdown + PNG, the per-cell child process,
the target verdicts, and the dry run of bench/gpu_check.sh (so that it cannot rot)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from bench import formulas, summary
from bench.__main__ import main as bench_main
from bench.__main__ import run_group
from bench.measure import percentile, summarize
from bench.plot import main as plot_main
from bench.results import COLUMNS
from bench.torch_impls import ChunkedTorch, plain_js_distance, plain_logprobs, plain_policy_loss
from mrtpo_kernels import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, D = 151936, 896


# --------------------------------------------------------------------------- formulas


def test_flop_formulas():
    n, d, v = 16384, 4096, 151936
    assert formulas.flops("linear_logprobs_fwd", n, d, v) == 2 * n * d * v
    assert formulas.flops("linear_logprobs_entropy", n, d, v) == 2 * n * d * v
    assert formulas.flops("linear_logprobs_fwd_bwd", n, d, v) == 6 * n * d * v
    assert formulas.flops("linear_policy_loss_fwd_bwd", n, d, v) == 6 * n * d * v
    assert formulas.flops("linear_js_distance", n, d, v, 1) == 2 * 2 * n * d * v
    assert formulas.flops("linear_js_distance", n, d, v, 4) == 5 * 2 * n * d * v
    assert formulas.flops("credit_assignment_step", n, d, v, 4) == (10 + 6) * n * d * v
    assert formulas.flops("advantages", n, 0, 0, 4) == 0
    # issue 3's target: 500 TFLOP/s of policy loss at this shape is 122 ms per call
    assert formulas.flops("linear_policy_loss_fwd_bwd", n, d, v) / 500e12 == pytest.approx(
        0.1224, rel=1e-3
    )
    with pytest.raises(ValueError, match="op"):
        formulas.flops("softmax", n, d, v)


def test_memory_estimate():
    plain = formulas.estimate_extra_bytes(
        "pytorch", "linear_logprobs_fwd_bwd", 16384, D, V, 0, "float32"
    )
    assert plain > 20e9  # issue 2: plain PyTorch needs over 20 GB at N = 16384
    quarter = formulas.estimate_extra_bytes(
        "pytorch", "linear_logprobs_fwd_bwd", 4096, D, V, 0, "float32"
    )
    assert plain / quarter == pytest.approx(4.0)  # O(N V)
    fused = formulas.estimate_extra_bytes(
        "mrtpo-cpu", "linear_logprobs_fwd_bwd", 16384, D, V, 0, "float32"
    )
    assert fused < 2e9
    assert fused == formulas.estimate_extra_bytes(
        "mrtpo-cpu", "linear_logprobs_fwd_bwd", 65536, D, V, 0, "float32"
    )
    ram = 24e9
    assert formulas.fits("mrtpo-cpu", "linear_js_distance", 16384, D, V, 4, "float32", ram)[0]
    ok, need = formulas.fits("pytorch", "linear_logprobs_fwd_bwd", 16384, D, V, 0, "float32", ram)
    assert not ok and need > plain
    # bf16 logits cost their own [N, V] on top of the fp32 ones
    assert (
        formulas.estimate_extra_bytes(
            "pytorch", "linear_logprobs_fwd", 1024, 4096, V, 0, "bfloat16"
        )
        == (2 * 4 + 2) * 1024 * V
    )


def test_estimated_row_instead_of_running(monkeypatch):
    from bench import cell

    monkeypatch.setattr(cell.envinfo, "mem_available_bytes", lambda device: 1 << 20)
    spec = dict(
        op="linear_logprobs_fwd_bwd",
        provider="pytorch",
        n=4096,
        d=D,
        v=V,
        k=0,
        dtype="float32",
        device="cpu",
        repeats=1,
    )
    row = cell.run_cell(spec)
    assert row["status"] == "estimated"
    est = formulas.estimate_extra_bytes(
        "pytorch", "linear_logprobs_fwd_bwd", 4096, D, V, 0, "float32"
    )
    assert row["extra_mem_mb"] == pytest.approx(est / 2**20)
    assert "not run" in row["note"]


def test_percentiles():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 20) == pytest.approx(1.8)
    s = summarize(xs)
    assert s["ms_p50"] == 3.0 and s["ms_p20"] < s["ms_p50"] < s["ms_p80"]


# --------------------------------------------------------------------------- baselines


@pytest.fixture
def small():
    g = torch.Generator().manual_seed(3)
    n, d, v, k = 37, 8, 101, 3
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    lab = torch.randint(0, v, (n,), generator=g)
    hq = h + 0.3 * torch.randn(k, n, d, generator=g, dtype=torch.float64)
    return h, w, lab, hq


@pytest.mark.parametrize("impl", ["plain", "chunked"])
def test_baselines_match_reference(small, impl):
    """The baselines compute what the ops compute (fp32 against the float64 reference)."""
    h, w, lab, hq = small
    chunked = ChunkedTorch(compile=False, budget_bytes=4 * w.shape[0] * 8)  # 8-row chunks
    logprobs = plain_logprobs if impl == "plain" else chunked.logprobs
    js = plain_js_distance if impl == "plain" else chunked.js_distance
    policy = plain_policy_loss if impl == "plain" else chunked.policy_loss
    h32 = h.float().requires_grad_(True)
    w32 = w.float().requires_grad_(True)
    lp, ent = logprobs(h32, w32, lab, return_entropy=True)
    rlp, rent = ref.linear_logprobs_ref(h, w, lab, return_entropy=True)
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=2e-5, rtol=1e-5)
    g = torch.randn(lab.shape[0], dtype=torch.float64)
    logprobs(h32, w32, lab).backward(g.float())
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref.linear_logprobs_ref(h64, w64, lab).backward(g)
    torch.testing.assert_close(h32.grad.double(), h64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(w32.grad.double(), w64.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        js(h.float(), hq.float(), w.float()).double(),
        ref.linear_js_distance_ref(h, hq, w),
        atol=2e-5,
        rtol=1e-4,
    )
    old = rlp + 0.3 * torch.randn(lab.shape[0], dtype=torch.float64)
    adv = torch.randn(lab.shape[0], dtype=torch.float64)
    h32.grad = w32.grad = h64.grad = w64.grad = None
    loss = policy(h32, w32, lab, old.float(), adv.float())
    loss.backward()
    rloss, _ = ref.linear_policy_loss_ref(h64, w64, lab, old, adv)
    rloss.backward()
    torch.testing.assert_close(loss.double(), rloss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h32.grad.double(), h64.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(w32.grad.double(), w64.grad, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------- runs


def test_smoke_run_writes_csv_markdown_and_plot(tmp_path):
    out = tmp_path / "run"
    ops = ["linear_logprobs_fwd_bwd", "linear_js_distance", "advantages"]
    rc = bench_main(
        ["--preset", "smoke", "--ops", *ops, "--N", "64", "--repeats", "2", "--out", str(out)]
    )
    assert rc == 0
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    # logprobs 1 shape, JS K in {1, 2}, advantages 1 shape; 3 providers each
    assert len(rows) == (1 + 2 + 1) * 3
    by = {(r["op"], r["provider"], r["K"]): r for r in rows}
    for key, r in by.items():
        if key[1] == "mrtpo-torch" or (key[1] == "pytorch" and key[0] != "advantages"):
            assert r["status"] == "ok", r
            assert float(r["ms_p20"]) <= float(r["ms_p50"]) <= float(r["ms_p80"])
            assert float(r["peak_mem_mb"]) > 0 and float(r["extra_mem_mb"]) >= 0
            assert r["repeats"] == "2" and r["dtype"] == "float32" and r["commit"]
        else:  # never dropped silently: a row with the reason
            assert r["status"] in ("unavailable", "unsupported"), r
            assert r["note"]
    assert float(by[("linear_logprobs_fwd_bwd", "mrtpo-torch", "0")]["tflops"]) > 0
    assert float(by[("advantages", "mrtpo-torch", "2")]["gb_per_s"]) > 0
    md = (out / "results.md").read_text()
    assert "## Results" in md and "mrtpo-torch | pytorch" in md
    assert plot_main(["--csv", str(out / "results.csv"), "--out", str(out / "plots")]) == 0
    pngs = sorted(p.name for p in (out / "plots").iterdir())
    assert "linear_js_distance_k2_float32.png" in pngs
    with open(out / "plots" / pngs[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cell_runs_in_its_own_process():
    spec = dict(
        op="linear_policy_loss_fwd_bwd",
        provider="mrtpo-torch",
        n=32,
        d=16,
        v=300,
        k=0,
        dtype="float32",
        device="cpu",
        repeats=2,
        warmup=1,
    )
    bad = dict(spec, provider="mrtpo-cuda")
    rows = run_group([spec, bad], timeout=300)
    assert rows[0]["status"] == "ok" and float(rows[0]["ms_p50"]) > 0
    assert rows[1]["status"] in ("unavailable", "unsupported") and "cuda" in rows[1]["note"]


def test_bad_arguments():
    assert bench_main(["--preset", "smoke", "--ops", "softmax", "--dry-run"]) == 2
    assert bench_main(["--preset", "smoke", "--providers", "numpy", "--dry-run"]) == 2


def test_target_verdicts():
    def row(op, prov, n, k, ms, extra, peak=1000.0, status="ok"):
        return dict(
            op=op,
            provider=prov,
            N=str(n),
            K=str(k),
            d="896",
            dtype="float32",
            ms_p50=str(ms),
            extra_mem_mb=str(extra),
            peak_mem_mb=str(peak),
            status=status,
        )

    rows = [
        row("linear_logprobs_fwd_bwd", "mrtpo-cpu", 4096, 0, 120.0, 100.0),
        row("linear_logprobs_fwd_bwd", "pytorch", 4096, 0, 100.0, 1000.0),
        row("linear_js_distance", "mrtpo-cpu", 4096, 4, 90.0, 500.0),
        row("linear_js_distance", "pytorch", 4096, 4, 100.0, 1000.0),
        row("linear_js_distance", "mrtpo-cpu", 16384, 4, 1.0, 1.0, peak=5000.0),
        row("linear_js_distance", "pytorch", 16384, 4, None, 30000.0, 40000.0, "estimated"),
    ]
    lines = summary.cpu_targets(rows)
    text = "\n".join(lines)
    assert "- PASS N=4096 linear_logprobs_fwd_bwd: extra memory" in text  # 0.1 <= 1/8
    assert "- PASS N=4096 linear_logprobs_fwd_bwd: time mrtpo-cpu / pytorch <= 1.3" in text
    assert "- FAIL N=4096 linear_js_distance K=4: extra memory" in text  # 0.5 > 1/8
    assert "- PASS N=4096 linear_js_distance K=4: time" in text
    assert "- NOT MEASURED N=4096 linear_policy_loss_fwd_bwd" in text
    assert "- PASS N=16384 linear_js_distance K=4: mrtpo-cpu peak RSS <= 4 GB" not in text
    assert "- FAIL N=16384 linear_js_distance K=4: mrtpo-cpu peak RSS" in text  # 5.2 GB
    assert "estimated, not run" in text


# --------------------------------------------------------------------------- gpu_check.sh


def _gpu_check(*args):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gpu_check_dry_run(tmp_path):
    proc = _gpu_check("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    steps = (
        "wheels", "env", "test_deps", "build", "micro_cublas", "micro_rows", "micro_rows_sweep",
        "micro_ops",
        "micro_ops_buf304", "micro_ops_chunk128", "micro_correctness", "bench",
        "pytest_test_logprobs", "pytest_test_cuda_build", "pytest_compile",
    )  # fmt: skip
    order = [out.index(f"== {s} ") for s in steps]
    assert order == sorted(order)  # the steps run in this order
    # the CUDA build starts in the background, before the Triton measurements
    assert "== build (background" in out and "MRTPO_SKIP_CPU_BUILD=1" in out
    assert "setup.py build_ext --inplace" in out
    # each measurement its own process; the row kernels' grid; the ops at three plans
    assert out.count("-m bench.gpu_micro --out") == 7 and "--part rows-sweep" in out
    assert "--grad-buffer-mib 304" in out and "--chunk-mib 128" in out
    assert "--variant" not in out and "--part correctness" in out
    assert "would measure N=16384 d=4096 V=151936" in out and "gradient buffers of 2048" in out
    # pytest per file, -v with a junit file each, compile tests last
    assert "-m pytest -m gpu" in out and "-v -rA --durations=15 --timeout=" in out
    assert out.count("--junitxml=") == 7 and out.count("-k not compile") == 6
    assert out.index("-k not compile") < out.index("-k compile")
    assert "preset gpu-target:" in out and "N=16384" in out and "d=4096" in out
    # at most 8 files come back from the GPU machine: the dry run leaves at most that many
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8
    assert "linear_policy_loss_fwd_bwd   mrtpo-triton" in out
    assert "all steps and files check out" in out
    script = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    assert "trap finish EXIT" in script and "write_summary" in script


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gpu_micro_parts_run_under_interpreter(tmp_path):
    """The window's micro parts end to end on the CPU (the Triton interpreter, tiny shapes):
    every figure lands in figures.jsonl with the GEMM path and the prediction beside it, the
    correctness part reports its errors in its own line, and nothing raises, so a GPU
    window cannot be lost to a typo in a part."""
    out = tmp_path / "figures.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MRTPO_STRICT_BACKEND="1")
    for part in ("cublas", "rows", "rows-sweep", "ops", "correctness"):
        proc = subprocess.run(
            [sys.executable, "-m", "bench.gpu_micro", "--part", part, "--device", "cpu",
             "--n", "40", "--d", "16", "--v", "3000", "--chunk-mib", "1",
             "--grad-buffer-mib", "1", "--rows", "24", "--out", str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["part"], r.get("name")): r for r in rows}
    for name in ("stats", "grad", "policy", "js_many_k4"):
        assert by[("rows", name)]["ms"] > 0 and by[("rows", name)]["pred_ms"] > 0
    for name in ("linear_policy_loss_fwd_bwd", "linear_logprobs_fwd_bwd", "linear_js_distance"):
        r = by[("ops", name)]
        assert "error" not in r and r["ms"] > 0 and r["pred_ms"] > 0
        # the CPU's torch has no 16-bit fp32-out GEMM (whether oneDNN then runs the bf16
        # logits GEMM, the suffix, is test_chunk_driver's question)
        assert r["gemm_path"].startswith("fp32 fallback")
    assert by[("correctness", "bf16_24_rows")]["ok"] is True
    assert by[("cublas", "full_bf16_gemm")]["ms"] > 0
    sweep = {(r["name"], r["block"]) for r in rows if r["part"] == "rows-sweep"}
    assert sweep == {(n, b) for n in ("stats", "grad", "policy") for b in (256, 512)}
    from bench import figures

    best = figures.best_row_block(rows)
    times = {b: sum(r["ms"] for r in rows if r["part"] == "rows-sweep" and r["block"] == b)
             for b in (256, 512)}  # fmt: skip
    assert best == f"{min(times, key=times.get)},4"


def test_best_row_block_needs_all_three_kernels():
    from bench import figures

    def rec(name, block, ms):
        return {"part": "rows-sweep", "name": name, "block": block, "warps": 8, "ms": ms}

    rows = [rec("stats", 1024, 1.0), rec("grad", 1024, 1.0), rec("policy", 1024, 1.0),
            rec("stats", 4096, 0.1), rec("grad", 4096, 0.1),  # policy missing: not a candidate
            rec("stats", 2048, 0.9), rec("grad", 2048, 0.9), rec("policy", 2048, 1.1)]  # fmt: skip
    assert figures.best_row_block(rows) == "2048,8"
    assert figures.best_row_block([rec("stats", 1024, 1.0)]) is None


def test_figures_table_keeps_every_part_and_skips_a_torn_line(tmp_path):
    from bench import figures

    path = tmp_path / "figures.jsonl"
    path.write_text(
        json.dumps({"part": "ops", "name": "linear_policy_loss_fwd_bwd", "ms": 80.5,
                    "pred_ms": 89.3, "gemm_path": "16-bit, fp32 out", "low_memory": "0"})
        + "\n" + json.dumps({"part": "correctness", "name": "bf16_512_rows", "ok": False})
        + "\n" + '{"part": "rows", "na'
    )  # fmt: skip
    rows = figures.read(str(path))
    assert len(rows) == 2
    text = figures.markdown(rows)
    assert "**ops**" in text and "| linear_policy_loss_fwd_bwd | 0 |" in text
    assert "| 80.5 | 89.3 |" in text and "16-bit, fp32 out" in text
    assert "**correctness**" in text and "False" in text
    assert figures.markdown([]) == "(no figures yet)"


def test_gpu_check_rejects_bad_arguments():
    assert _gpu_check("--frobnicate").returncode == 2
    assert _gpu_check().returncode == 2  # no --out and no $OUT outside a dry run


# --------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
def test_gpu_cell_measures_device_memory():
    """On CUDA the cell times with events and reads max_memory_allocated: plain PyTorch's
    log-probs forward+backward holds [N, V] fp32 tensors beyond its inputs and outputs."""
    from bench.cell import run_cell

    n, v = 512, 20000
    spec = dict(op="linear_logprobs_fwd_bwd", provider="pytorch", n=n, d=64, v=v, k=0,
                dtype="bfloat16", device="cuda", repeats=3)  # fmt: skip
    row = run_cell(spec)
    assert row["status"] == "ok", row
    assert row["extra_mem_mb"] * 2**20 >= 2 * 4 * n * v  # at least 2 fp32 [N, V] tensors
    assert row["ms_p20"] <= row["ms_p50"] <= row["ms_p80"]


@pytest.mark.gpu
def test_gpu_ceilings_are_measured():
    from bench.envinfo import ceilings

    c = ceilings("cuda", seconds=0.2)
    assert c["bf16_matmul_tflops"] > 10 and c["copy_gb_per_s"] > 100


def test_gpu_targets_on_the_recorded_h200_run():
    """Issue 18's targets read off the first H200 run's CSV (bench/results/gpu-2026-12-04-h200):
    the three speed targets are missed, and the extra memory beyond the fp32 dW is within
    1 GB (the dW accumulator alone is 2374 MiB at this shape)."""
    import csv

    from bench import summary

    path = os.path.join(ROOT, "bench", "results", "gpu-2026-12-04-h200", "check", "results.csv")
    with open(path) as f:
        lines = summary.gpu_targets(list(csv.DictReader(f)))
    assert [ln.split()[1] for ln in lines] == ["FAIL", "PASS"] * 3
    assert "600 TFLOP/s" in lines[0] and ">= 700" in lines[0]
    assert "435 TFLOP/s" in lines[2] and "529 TFLOP/s" in lines[4]
    assert "beyond the fp32 dW" in lines[1] and "beyond" not in lines[5]


def test_gpu_tune_script_parses_and_names_real_parts():
    """bench/gpu_tune.sh (the follow-up GPU call) parses, and every gpu_micro part and bench
    provider it names exists, so a GPU call cannot be lost to a renamed part."""
    import re

    from bench import gpu_micro, providers

    path = os.path.join(ROOT, "bench", "gpu_tune.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    text = open(path).read()
    parts = set(re.findall(r"--part ([\w-]+)", text))
    assert parts == {"rows-sweep", "ops"} and parts <= set(gpu_micro.PARTS)
    named = re.search(r"--providers ([\w\- ]+?) --out", text).group(1).split()
    assert named == ["mrtpo-triton", "gemm-floor", "cce"] and set(named) <= set(providers.PROVIDERS)


# --------------------------------------------------------------------------- gpu_window.sh


def test_gpu_window_header_states_every_rule():
    """Every decision rule of bench/gpu_window.py is written, verbatim, in the shell script's
    header (the rules are fixed before the window runs)."""
    from bench import gpu_window

    script = open(os.path.join(ROOT, "bench", "gpu_window.sh")).read()
    header = script.split("set -u -o pipefail")[0]
    for key, rule in gpu_window.THRESHOLDS.items():
        assert f"#   {key}: {rule}\n" in header, key


def test_gpu_window_timeline_analysis():
    """The timeline's arithmetic on a hand-made trace: kernels sorted into GEMM, row and
    small ones; the idle time is the span less the union of the intervals (two streams
    overlapping count once); the 3 ms rule picks fold / graph / neither."""
    from bench import gpu_window_timeline as gw

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_gemm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "_policy_rows_kernel", "ts": 900, "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 2300, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 2400, "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10},
    ]}  # fmt: skip
    ivs = gw.kernel_intervals(trace, on_gpu=True)
    assert len(ivs) == 4
    st = gw.analyze(ivs)
    assert st["gemm_count"] == 1 and st["row_count"] == 1 and st["small_count"] == 2
    assert st["span_ms"] == pytest.approx(2.45) and st["busy_ms"] == pytest.approx(1.45)
    assert st["idle_ms"] == pytest.approx(1.0) and st["gaps"] == 1
    assert st["concurrent_ms"] == pytest.approx(0.1)  # the row kernel beside the GEMM
    assert st["largest_gaps"] == [[1.0, "_policy_rows_kernel"]]
    assert gw.kernel_intervals(trace, on_gpu=False) == [("aten::mm", 0.0, 5000.0)]
    assert gw.analyze([])["idle_ms"] == 0.0
    assert gw.timeline_decision(3.0, 5.0).startswith("neither")
    assert gw.timeline_decision(3.5, 1.5).startswith("fold")
    assert gw.timeline_decision(3.5, 0.5).startswith("capture")


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_gpu_window_dry_run(tmp_path):
    """bench/gpu_window.sh --dry-run: every step on the CPU at tiny shapes (the interpreter;
    profiling on CPU events; nvidia-smi and absent peers skipped with a line): each step
    ends ok, each part leaves its records and decisions in figures.jsonl, at most 8 files
    come back, and the summary holds the decisions (about 3 minutes on an idle core; with the
    peers' wheels in .whl/, their call paths too, about 8 minutes more)."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "bench", "gpu_window.sh"), "--dry-run", "--out",
         str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=3000 if _peer_wheels_present() else 1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 8
    assert {p.name for p in files} == {"summary.md", "figures.jsonl", "traces.tar.gz",
                                       "logs.tar.gz"}  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "figures.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r.get("part") != "peers" and "error" in r]
    parts = {r["part"] for r in rows}
    assert {"state", "timeline", "ab", "cublas", "rows", "peers", "decision"} <= parts
    decided = {r["name"] for r in rows if r["part"] == "decision"}
    from bench import gpu_window

    assert decided == set(gpu_window.THRESHOLDS)
    ab = {(r["name"], r["config"]) for r in rows if r["part"] == "ab"}
    assert len(ab) == 6  # 2 ops x (default, overlap, low-memory)
    tl = [r for r in rows if r["part"] == "timeline"]
    assert len(tl) == 5 and all(r["kernels"] > 0 for r in tl)  # JS has no overlap arm
    peers = {r["name"]: r for r in rows if r["part"] == "peers" and "grad_ok" in r}
    assert peers["ours"]["ms"] > 0 and peers["ours"]["grad_ok"]
    if _peer_wheels_present():  # their real call paths, kernels included, under the interpreter
        assert set(peers) == {"ours", "liger_fp32_accum", "liger_default", "cce_exact",
                              "cce_default"}, peers.keys()  # fmt: skip
        assert all(r["grad_ok"] and r["logp_max_err"] < 1e-2 for r in peers.values()), peers
        assert not [r for r in rows if r["part"] == "peers" and "error" in r]
    summary = (tmp_path / "summary.md").read_text()
    steps = ["state_before", "peers", "timeline", "ab", "cublas", "rows", "state_after"]
    if _peer_wheels_present():
        steps.insert(0, "wheels")
    for step in steps:
        assert f"| {step} | ok |" in summary, step
    assert "**decision**" in summary and "dry run" in summary
    assert "GPU: none (dry run on the CPU)" in summary


def _peer_wheels_present() -> bool:
    """Whether .whl/ holds the pinned peer wheels (bench/peer_wheels.sh puts them there)."""
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "peer_wheels.sh"), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc.returncode == 0


def test_gpu_window_steps_fit_one_call():
    """bench/gpu_window.sh's steps: their time limits add up to no more than the budget,
    which stays under the device call's 600 s with room for the start (540 s at most), and
    the peers run right after the machine state (early, before the long steps), as the
    header lists them."""
    script = open(os.path.join(ROOT, "bench", "gpu_window.sh")).read()
    body = script.split("set -u -o pipefail")[1]
    steps = re.findall(r"^\s*step (\w+) (\d+) ", body, flags=re.M)
    names = [n for n, _ in steps]
    assert names == ["wheels", "state_before", "peers", "timeline", "ab", "cublas", "rows",
                     "state_after"]  # fmt: skip
    budget = int(re.search(r"GPU_WINDOW_BUDGET_S:-(\d+)", body).group(1))
    total = sum(int(s) for _, s in steps)
    assert budget <= 540 and total <= budget - 60, (total, budget)
    header = script.split("set -u -o pipefail")[0]
    assert f"limits add up to {total} s" in header.replace("\n# ", " ")
    listed = re.findall(r"^#   (\w+)\s+(\d+)  ", header, flags=re.M)
    assert [int(s) for _, s in listed] == [int(s) for _, s in steps]


def test_peer_wheels_check(tmp_path):
    """bench/peer_wheels.sh --check: true only when the folder holds every pinned wheel (the
    file names pip saves: dashes as underscores, py3-none-any)."""
    from bench import gpu_window

    script = os.path.join(ROOT, "bench", "peer_wheels.sh")

    def check():
        return subprocess.run(["bash", script, "--check", "--dest", str(tmp_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60).returncode  # fmt: skip

    assert check() == 1
    names = [f"{k.replace('-', '_')}-{v}-py3-none-any.whl"
             for k, v in gpu_window.PEER_WHEELS.items()]  # fmt: skip
    (tmp_path / names[0]).write_bytes(b"")
    assert check() == 1
    (tmp_path / names[1]).write_bytes(b"")
    assert check() == 0


def test_replay_floor_runs_and_records(tmp_path):
    """bench/replay_floor.py on the tiny model at a few tokens: both ratios per length, in the
    CSV and the Markdown record, each beside its target and verdict."""
    from bench import replay_floor

    rec = tmp_path / "record.md"
    assert replay_floor.main(["--out", str(tmp_path), "--models", "tiny", "--lengths", "8",
                              "--repeats", "1", "--record", str(rec)]) == 0  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "replay_floor.csv")))
    assert [r["part"] for r in rows] == ["units", "js"]
    for r in rows:
        assert float(r["ms_p50"]) > 0 and float(r["floor_ms_p50"]) > 0
        ratio = float(r["ms_p50"]) / float(r["floor_ms_p50"])
        assert float(r["ratio"]) == pytest.approx(ratio, rel=2e-2)  # rounded medians
        assert r["verdict"] == ("met" if float(r["ratio"]) <= float(r["target"]) else "missed")
    assert int(rows[0]["tokens"]) > 4 * 2 * 8  # every unit's prompt suffix and responses
    assert int(rows[1]["tokens"]) == 2 * 8
    text = rec.read_text()
    assert "load average" in text and "| tiny | 8 | units |" in text
    with pytest.raises(ValueError, match="--lengths"):
        replay_floor.main(["--out", str(tmp_path), "--lengths", "0"])
    # --parts js: the JS and its floor only
    assert replay_floor.main(["--out", str(tmp_path / "js"), "--models", "tiny", "--lengths",
                              "8", "--repeats", "1", "--parts", "js"]) == 0  # fmt: skip
    rows = list(csv.DictReader(open(tmp_path / "js" / "replay_floor.csv")))
    assert [r["part"] for r in rows] == ["js"] and float(rows[0]["floor_ms_p50"]) > 0
    with pytest.raises(ValueError, match="--parts"):
        replay_floor.main(["--out", str(tmp_path), "--parts", "gemm"])
