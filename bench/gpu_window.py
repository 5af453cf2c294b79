"""The decision steps of a GPU window (issue 35), one part per process; bench/gpu_window.sh
runs them in order and its header states, before anything runs, what each one decides.

    python -m bench.gpu_window --part PART --out figures.jsonl [--device cpu --n 40 --d 16
        --v 3000 --chunk-mib 1 --grad-buffer-mib 1] [--traces DIR]

Every record is appended to ``--out`` (JSON lines) the moment it exists (a killed part keeps
what it measured); a part ends with one ``decision`` record per question it answers: the
rule (THRESHOLDS below, quoted in the shell script's header), the measured value and what
follows. ``--device cpu`` runs the same code on CPU tensors under TRITON_INTERPRET=1 at tiny
shapes (the dry run: every step's plumbing, profiling on the CPU's own events, nvidia-smi
skipped), so a window cannot be lost to a typo.

Parts:
    state     nvidia-smi's clocks, power, temperature and throttle reasons (--tag before or
              after), so a slow figure can be told from a throttled machine
    timeline  torch.profiler over one call per op (policy loss fwd+bwd, log-probs fwd+bwd,
              JS one-vs-4), at the defaults and with MRTPO_OVERLAP_ROWS=1: the kernels sorted
              into GEMM, row kernels and small kernels, their summed time, and the idle time
              between kernels (the op's kernel span less the union of kernel intervals)
    ab        default, overlap and low-memory backward interleaved in one process (round
              robin, the order rotated each round), policy loss and log-probs, CUDA-event
              medians and extra memory, beside the cost model's prediction
    cublas    GEMM shapes around the plan's: logits of 128-aligned row counts and the plan's
              410, fp32 against bf16 output; dh and dW with K = 2048 and 4096
    rows      the row kernels at in-op sizes back to back (one chunk of the plan's rows, the
              kernel launched as many times as an op launches it, one event pair around
              them): bandwidth without the per-call launch a lone timing includes; the
              split-row statistics kernel beside the one-program-per-row one
    peers     log-probs fwd+bwd: ours, Liger-Kernel (accum_dtype=float32, and its default)
              and Cut Cross-Entropy (impl "cce_exact", and its default "cce"), time and
              extra memory; a line saying so where a wheel is absent
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from .gpu_micro import add_shape_args, apply_size_env, op_calls, op_inputs, run_part

PARTS = ("state", "timeline", "ab", "cublas", "rows", "peers")

# The rules, fixed before the window runs (bench/gpu_window.sh's header quotes each line;
# tests/test_bench.py checks that it does).
THRESHOLDS = {
    "state": "clocks: an SM clock under 90% of its max, or any active throttle reason other "
    "than idle, before or after, marks every timing of the window as throttled",
    "timeline": "idle gaps: more than 3 ms of idle time between kernels in one call of an op "
    "-> fold the small kernels into the row kernel where they take more than 1 ms, else "
    "capture the chunk loop in a CUDA graph; 3 ms or less -> neither",
    "ab_overlap": "overlap: kept only if MRTPO_OVERLAP_ROWS=1 is at least 2% faster than the "
    "default on both the policy loss and log-probs (medians, same process); else removed",
    "ab_low_memory": "low-memory backward: made the default (MRTPO_LOW_MEMORY=1) if it is "
    "within 3% of the default's time on both ops (it drops the 2.4 GB fp32 dW accumulator)",
    "cublas_rows": "chunk rows: round the logits chunk to a multiple of 128 rows if the best "
    "128-aligned row count gets at least 3% more TFLOP/s than the plan's 410 rows",
    "cublas_k": "gradient buffer: 4096 rows if dW at K = 4096 gets at least 5% more TFLOP/s "
    "than at K = 2048 (and the memory target still holds), else 2048",
    "rows": "row kernels: a kernel under 2.5 TB/s back to back at in-op size is the next "
    "kernel to rewrite; the split-row statistics kernel replaces the one-program-per-row one "
    "if it is at least 1.2x faster",
    "peers": "peers: ours must be faster than Liger (accum_dtype=float32) and Cut "
    "Cross-Entropy (cce_exact) on log-probs fwd+bwd at no more extra memory than theirs; "
    "a miss is recorded as a miss",
}

GEMM_NAMES = re.compile(r"gemm|nvjet|xmma|cutlass|splitk", re.IGNORECASE)
ROW_NAMES = re.compile(
    r"_stats_rows|_stats_split|_grad_rows|_policy_rows|_row_norm|_js_rows_sum|_js_finish"
    r"|_grad_cols|_policy_terms"
)
CPU_GEMM_NAMES = re.compile(r"^aten::(mm|addmm|matmul|bmm)$")


def _decide(emit, key: str, measured, outcome: str) -> None:
    emit({"part": "decision", "name": key, "rule": THRESHOLDS[key], "measured": measured,
          "outcome": outcome})  # fmt: skip


class _Env:
    """Set MRTPO_* variables for a block (the driver reads them at each call)."""

    def __init__(self, **kv):
        self.kv = {k: str(v) for k, v in kv.items()}

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.kv}
        os.environ.update(self.kv)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


CONFIGS = {  # the A/B arms (and the timeline's two): MRTPO_* variables each
    "default": {},
    "overlap": {"MRTPO_OVERLAP_ROWS": "1"},
    "low_memory": {"MRTPO_LOW_MEMORY": "1"},
}


def _sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _elapsed_ms(torch, fn, calls: int = 1) -> float:
    """One timing of ``calls`` back-to-back calls: CUDA events on a GPU, else wall clock."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _median_ms(torch, fn, repeats=3, calls=1) -> float:
    fn()
    _sync(torch)
    return statistics.median(_elapsed_ms(torch, fn, calls) / calls for _ in range(repeats))


def _extra_mb(torch, fn) -> float:
    """Peak device memory of one call beyond what was allocated before it (0 on the CPU)."""
    if not torch.cuda.is_available():
        fn()
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def _ops(torch, args):
    """{name: (call, flops)}: the three ops at the window's shape, one call each."""
    from . import formulas

    n, d, v = args.n, args.d, args.v
    calls = op_calls(torch, args)
    return {name: (fn, formulas.flops(name, n, d, v, k)) for name, fn, k in calls}


# --------------------------------------------------------------------------- state


def part_state(torch, args, emit):
    fields = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit",
              "temperature.gpu", "clocks_throttle_reasons.active", "pstate")  # fmt: skip
    rec = {"part": "state", "name": args.tag}
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        emit({**rec, "skipped": f"nvidia-smi: {type(exc).__name__}"})
        _decide(emit, "state", None, f"{args.tag}: no nvidia-smi here, no verdict")
        return
    vals = [x.strip() for x in out.split(",")]
    keys = ("gpu_name" if f == "name" else f.replace(".", "_") for f in fields)
    rec.update(dict(zip(keys, vals, strict=False)))
    emit(rec)
    throttled = []
    try:
        if float(rec["clocks_sm"]) < 0.9 * float(rec["clocks_max_sm"]):
            throttled.append(f"SM clock {rec['clocks_sm']} of {rec['clocks_max_sm']} MHz")
    except (KeyError, ValueError):
        pass
    reasons = rec.get("clocks_throttle_reasons_active", "0x0")
    try:
        active = int(reasons, 16) & ~0x1  # bit 0: idle, not a throttle
    except ValueError:
        active = 0
    if active:
        throttled.append(f"throttle reasons {reasons}")
    verdict = "throttled: " + "; ".join(throttled) if throttled else "not throttled"
    _decide(emit, "state", {"tag": args.tag, "gpu": rec.get("gpu_name"),
                            "sm_mhz": rec.get("clocks_sm"),
                            "power_w": rec.get("power_draw"), "reasons": reasons},
            f"{args.tag}: {verdict}")  # fmt: skip


# --------------------------------------------------------------------------- timeline


def kernel_intervals(trace: dict, on_gpu: bool) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of the device kernels (and memcpy / memset) of a chrome
    trace torch.profiler exported; on the CPU, of its aten operators instead."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", "")).lower()
        wanted = cat in ("kernel", "gpu_memcpy", "gpu_memset") if on_gpu else cat == "cpu_op"
        if wanted:
            ts = float(e["ts"])
            out.append((str(e.get("name", "")), ts, ts + float(e["dur"])))
    return out


def classify(name: str, on_gpu: bool = True) -> str:
    if ROW_NAMES.search(name):
        return "row"
    if GEMM_NAMES.search(name) if on_gpu else CPU_GEMM_NAMES.match(name):
        return "gemm"
    return "small"


def analyze(intervals: list[tuple[str, float, float]], on_gpu: bool = True) -> dict:
    """Per kind (gemm, row, small): summed kernel time (ms) and count; the span from the first
    kernel's start to the last one's end, the busy time (the union of all intervals, any
    stream) and the idle time (span - busy), all in ms; the largest gaps with the kernel
    before each; ``concurrent_ms``: summed kernel time beyond the busy time (kernels that
    ran beside each other, the overlap's aim)."""
    if not intervals:
        return {"kernels": 0, "span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0}
    ivs = sorted(intervals, key=lambda x: x[1])
    out: dict = {"kernels": len(ivs)}
    for kind in ("gemm", "row", "small"):
        sel = [e - s for n, s, e in ivs if classify(n, on_gpu) == kind]
        out[f"{kind}_ms"] = sum(sel) / 1e3
        out[f"{kind}_count"] = len(sel)
    busy, gaps = 0.0, []
    cur_s, cur_e, cur_name = ivs[0][1], ivs[0][2], ivs[0][0]
    for name, s, e in ivs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_name))
            cur_s, cur_e, cur_name = s, e, name
        elif e > cur_e:
            cur_e, cur_name = e, name
    busy += cur_e - cur_s
    span = max(e for _, _, e in ivs) - ivs[0][1]
    out["span_ms"] = span / 1e3
    out["busy_ms"] = busy / 1e3
    out["idle_ms"] = (span - busy) / 1e3
    out["gaps"] = len(gaps)
    out["concurrent_ms"] = max(0.0, sum(e - s for _, s, e in ivs) - busy) / 1e3
    gaps.sort(reverse=True)
    out["largest_gaps"] = [[round(g / 1e3, 4), n[:60]] for g, n in gaps[:5]]
    return out


def timeline_decision(idle_ms: float, small_ms: float) -> str:
    if idle_ms <= 3.0:
        return "neither (idle gaps within 3 ms)"
    if small_ms > 1.0:
        return "fold the small kernels into the row kernel"
    return "capture the chunk loop in a CUDA graph"


def part_timeline(torch, args, emit):
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    ops = _ops(torch, args)
    worst = {}
    for config in ("default", "overlap"):
        with _Env(**CONFIGS[config]):
            for name, (fn, _) in ops.items():
                if config == "overlap" and name == "linear_js_distance":
                    continue  # the overlap does not cover JS
                fn()  # warm-up: compiles, caches
                _sync(torch)
                with profile(activities=acts) as prof:
                    fn()
                    _sync(torch)
                path = os.path.join(args.traces, f"{config}_{name}.json")
                prof.export_chrome_trace(path)
                with open(path) as f:
                    trace = json.load(f)
                stats = analyze(kernel_intervals(trace, on_gpu), on_gpu)
                wall = _elapsed_ms(torch, fn)
                source = "cuda kernels" if on_gpu else "cpu ops (dry run)"
                emit({"part": "timeline", "name": name, "config": config, "wall_ms": wall,
                      "source": source, **stats})  # fmt: skip
                if config == "default":
                    worst[name] = (stats["idle_ms"], stats.get("small_ms", 0.0))
    for name, (idle, small) in worst.items():
        _decide(emit, "timeline", {"op": name, "idle_ms": round(idle, 3),
                                   "small_ms": round(small, 3)},
                f"{name}: {timeline_decision(idle, small)}")  # fmt: skip


# --------------------------------------------------------------------------- A/B


def _predicted_ms(cm, name, args, low_memory=False) -> float:
    """The refit H200 model's time for one A/B arm (the low-memory arm's own plan: the
    backward by vocabulary chunks; the overlap's plan has the same GEMMs and passes)."""
    from mrtpo_kernels import chunk_plan

    op = {"linear_policy_loss_fwd_bwd": "linear_policy_loss",
          "linear_logprobs_fwd_bwd": "linear_logprobs"}[name]  # fmt: skip
    plan = chunk_plan.chunk_plan(op, args.n, args.v, args.d, grad16=True, low_memory=low_memory)
    return cm.predict_plans(name, [plan], args.n, args.v, args.d, 1, cm.H200).total_s * 1e3


def part_ab(torch, args, emit):
    from . import cost_model as cm

    ops = {k: v for k, v in _ops(torch, args).items() if k != "linear_js_distance"}
    names = list(CONFIGS)
    times = {(c, o): [] for c in names for o in ops}
    mem = {}
    for c in names:  # warm-up and memory, once per arm
        with _Env(**CONFIGS[c]):
            for o, (fn, _) in ops.items():
                fn()
                mem[(c, o)] = _extra_mb(torch, fn)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for c in order:
            with _Env(**CONFIGS[c]):
                for o, (fn, _) in ops.items():
                    _sync(torch)
                    times[(c, o)].append(_elapsed_ms(torch, fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    for (c, o), ms in med.items():
        flops = ops[o][1]
        pred = _predicted_ms(cm, o, args, low_memory=c == "low_memory")
        emit({"part": "ab", "name": o, "config": c, "ms": ms, "rounds": args.rounds,
              "tflops": flops / ms / 1e9, "vs_default": ms / med[("default", o)],
              "pred_ms": pred, "extra_mem_mb": mem[(c, o)],
              "spread_ms": max(times[(c, o)]) - min(times[(c, o)])})  # fmt: skip
    gains = {o: 1 - med[("overlap", o)] / med[("default", o)] for o in ops}
    keep = all(g >= 0.02 for g in gains.values())
    _decide(emit, "ab_overlap", {o: round(g, 4) for o, g in gains.items()},
            "keep MRTPO_OVERLAP_ROWS (>= 2% on both)" if keep
            else "remove MRTPO_OVERLAP_ROWS and _RowLanes")  # fmt: skip
    ratios = {o: med[("low_memory", o)] / med[("default", o)] for o in ops}
    low = all(r <= 1.03 for r in ratios.values())
    _decide(emit, "ab_low_memory", {o: round(r, 4) for o, r in ratios.items()},
            "make the low-memory backward the default" if low
            else "keep MRTPO_LOW_MEMORY=auto (the fp32 dW accumulator)")  # fmt: skip


# --------------------------------------------------------------------------- cuBLAS


def _logits_cases(torch, chunk_plan, f32, h, w, rows_grid, v):
    """{(rows, out dtype): call} for the logits GEMM h[:rows] W^T, fp32 or bf16 output."""
    z32 = torch.empty(max(rows_grid), v, device=h.device)
    z16 = torch.empty(max(rows_grid), v, device=h.device, dtype=h.dtype)
    cases = {}
    for m in rows_grid:
        if f32:
            cases[(m, "fp32")] = lambda m=m: chunk_plan.mm_f32(h[:m], w.t(), z32[:m])
        else:  # the fp32 fallback the driver would take
            cases[(m, "fp32")] = lambda m=m: torch.mm(h[:m].float(), w.t().float(), out=z32[:m])
        cases[(m, "bf16")] = lambda m=m: torch.mm(h[:m], w.t(), out=z16[:m])
    return cases


def _grad_cases(torch, chunk_plan, f32, w, k, d, v):
    """{name: call} for dh = G W and dW (=, +=) G^T h with K = k gradient rows."""
    dev, bf = w.device, w.dtype
    g16 = torch.randn(k, v, device=dev, dtype=bf) * 1e-3
    hk = torch.randn(k, d, device=dev, dtype=bf)
    dh = torch.empty(k, d, device=dev, dtype=bf)
    dw = torch.zeros(v, d, device=dev)
    cases = {"dh": lambda: torch.mm(g16, w, out=dh)}
    if f32:
        cases["dw_first"] = lambda: chunk_plan.mm_f32(g16.t(), hk, dw)
        cases["dw_accumulate"] = lambda: chunk_plan.addmm_f32(dw, g16.t(), hk)
    else:
        cases["dw_accumulate"] = lambda: dw.addmm_(g16.t().float(), hk.float())
    return cases


def part_cublas(torch, args, emit):
    from mrtpo_kernels import chunk_plan

    dev, bf = args.device, torch.bfloat16
    d, v = args.d, args.v
    plan = chunk_plan.chunk_plan("linear_policy_loss", args.n, v, d, grad16=True)
    plan_rows = max(g.m for g in plan.gemms if g.stage == "logits")
    f32 = chunk_plan.f32_out_supported(torch.device(dev), bf)
    gpu = dev != "cpu"
    rows_grid = sorted({plan_rows, *((128 * i for i in range(3, 9)) if gpu else (16, 32))})
    w = torch.randn(v, d, device=dev, dtype=bf) * d**-0.5
    h = torch.randn(max(rows_grid), d, device=dev, dtype=bf)
    per = {}
    for (m, out), fn in _logits_cases(torch, chunk_plan, f32, h, w, rows_grid, v).items():
        ms = _median_ms(torch, fn, 5)
        per[(m, out)] = 2 * m * v * d / ms / 1e9
        emit({"part": "cublas", "name": "logits", "m": m, "n": v, "k": d, "out": out,
              "ms": ms, "tflops": per[(m, out)], "ms_per_row": ms / m})  # fmt: skip
    ks = (2048, 4096) if gpu else (32, 64)
    for k in ks:
        for name, fn in _grad_cases(torch, chunk_plan, f32, w, k, d, v).items():
            ms = _median_ms(torch, fn, 5)
            per[(name, k)] = 2 * k * v * d / ms / 1e9
            emit({"part": "cublas", "name": name, "k_rows": k, "ms": ms,
                  "tflops": per[(name, k)]})  # fmt: skip
    aligned = [m for m in rows_grid if m % 128 == 0]
    best = max(aligned, key=lambda m: per[(m, "fp32")], default=None)
    gain = per[(best, "fp32")] / per[(plan_rows, "fp32")] - 1 if best else 0.0
    out16 = per[(plan_rows, "bf16")] / per[(plan_rows, "fp32")]
    measured = {"plan_rows": plan_rows, "best_aligned": best, "gain": round(gain, 4),
                "bf16_vs_fp32_out": round(out16, 4)}  # fmt: skip
    outcome = f"round the chunk to {best} rows" if gain >= 0.03 else (
        f"keep balanced {plan_rows}-row chunks")  # fmt: skip
    _decide(emit, "cublas_rows", measured, outcome)
    kg = per[("dw_accumulate", ks[1])] / per[("dw_accumulate", ks[0])] - 1
    _decide(
        emit,
        "cublas_k",
        {"dw_gain": round(kg, 4)},
        "gradient buffer of 4096 rows" if kg >= 0.05 else "keep 2048-row buffers",
    )


# --------------------------------------------------------------------------- row kernels


def part_rows(torch, args, emit):
    from mrtpo_kernels import chunk_plan

    dev, v = args.device, args.v
    import mrtpo_kernels as mk

    k = chunk_plan.row_kernel("triton")
    cfg = mk.PolicyLossSettings()
    plan = chunk_plan.chunk_plan("linear_policy_loss", args.n, v, args.d, grad16=True)
    c = max(g.m for g in plan.gemms if g.stage == "logits")
    calls = plan.count("logits")
    z = torch.randn(c, v, device=dev) * 2
    lab = torch.randint(0, v, (c,), device=dev)
    one = torch.ones(c, device=dev)
    out16 = torch.empty(c, v, device=dev, dtype=torch.bfloat16)
    _, _, lse = k.stats(z, lab, 1.0, -100, False)
    cases = {
        "stats": (4, lambda: k.stats(z, lab, 1.0, -100, True)),
        "grad": (10, lambda: k.grad_(z, lab, lse, None, one, None, 1.0, -100, out=out16)),
        "policy": (10, lambda: k.policy_(z, lab, one, one, one, None, cfg, True, out=out16)),
    }  # fmt: skip
    split = getattr(k, "stats_split", None)
    if split is not None:
        cases["stats_split"] = (4, lambda: split(z, lab, 1.0, -100, True))
    rate = {}
    for name, (bytes_per, fn) in cases.items():
        one_ms = _median_ms(torch, fn, 3)
        b2b = _median_ms(torch, fn, 3, calls=calls)
        rate[name] = bytes_per * c * v / b2b / 1e9  # TB/s
        emit({"part": "rows", "name": name, "rows": c, "calls": calls, "lone_ms": one_ms,
              "back_to_back_ms": b2b, "tb_per_s": rate[name],
              "lone_tb_per_s": bytes_per * c * v / one_ms / 1e9})  # fmt: skip
    slow = sorted(n for n in ("stats", "grad", "policy") if rate[n] < 2.5)
    outcome = f"rewrite next: {', '.join(slow)}" if slow else "no row kernel under 2.5 TB/s"
    if "stats_split" in rate:
        speed = rate["stats_split"] / rate["stats"]
        outcome += "; split stats " + ("replaces" if speed >= 1.2 else "does not replace")
        outcome += f" the per-row kernel ({speed:.2f}x)"
    _decide(emit, "rows", {n: round(r, 3) for n, r in rate.items()}, outcome)


# --------------------------------------------------------------------------- peers


# The peers' pinned versions (bench/peer_wheels.sh fetches exactly these into .whl/).
PEER_WHEELS = {"liger-kernel": "0.8.5", "cut-cross-entropy": "25.1.1"}

# What each peer setting computes in which precision, against ours, on the one op both
# peers have: log-probs fwd+bwd (-cross-entropy of a linear head). Neither peer has a policy
# loss or a JS op, so the window compares this op only. Ours: logits in fp32 (16-bit GEMM,
# fp32 out), softmax in fp32, the logits' gradient rounded to 16 bits for the dh / dW GEMMs,
# dW accumulated in fp32 across chunks, dh in fp32 within its GEMM.
PEER_PRECISION = {
    "liger_fp32_accum": "Liger accum_dtype=torch.float32, the precision-matched setting on "
    "dW (accumulated in fp32 across chunks, as ours); its logits chunk is the input dtype's "
    "GEMM output (16-bit) in both settings, so its softmax reads 16-bit logits where ours "
    "reads fp32: the one gap no Liger 0.8.5 setting closes",
    "liger_default": "Liger default (accum_dtype None): dW accumulated in the weight's "
    "16-bit dtype across chunks, 16-bit logits",
    "cce_exact": "Cut Cross-Entropy, the precision-matched setting on the forward "
    "(impl cce_exact where the version has it, else filter_eps=None): fp32 logits and "
    "softmax in-kernel, no gradient filtering; 25.1.1 rounds the logits' gradient to 16 "
    "bits (as ours) and accumulates dh and dW in 16 bits across blocks (ours: fp32)",
    "cce_default": "Cut Cross-Entropy default (filter_eps='high'): gradient blocks under "
    "the threshold skipped, so its gradient is approximate by design",
}


def cce_exact_options(linear_cross_entropy) -> dict:
    """Cut Cross-Entropy's exact gradient: ``impl="cce_exact"`` where its version has it
    (no gradient filtering, fp32 accumulation), else (25.1.1, the pinned wheel)
    ``filter_eps=None``: the default "cce" kernel without its gradient filtering."""
    try:
        from cut_cross_entropy.cce_utils import CCEPresets

        if "cce_exact" in CCEPresets.names:
            return {"impl": "cce_exact"}
    except ImportError:
        pass
    return {"impl": "cce", "filter_eps": None}


def interpreter_libdevice() -> list[str]:
    """Under TRITON_INTERPRET=1 only (the dry run): give the libdevice functions a peer's
    kernels call an implementation the interpreter can run. Triton 3.9's interpreter has none:
    ``triton.language.extra.libdevice``'s functions are placeholders that the compiler binds
    to a backend's library (their Python bodies return None), and the backend's own versions
    lower to ``extern_elementwise``, which the interpreter refuses. Cut Cross-Entropy's
    log-sum-exp merge calls ``libdevice.log1p`` (and its softcap ``libdevice.tanh``), so the
    interpreter added None to a tensor ("'NoneType' object has no attribute 'dtype'": the
    error of the earlier dry runs). Here log1p(x) = log(1 + x) and tanh by exp: the same
    values to fp32 rounding at the dry run's sizes; never used on a GPU. Returns the names
    bound."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    import triton.language as tl
    from triton.language.extra import libdevice

    def log1p(x):
        return tl.log(1.0 + x)

    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    bound = []
    for name, fn in (("log1p", log1p), ("tanh", tanh)):
        if getattr(libdevice, name, None) is not None:
            setattr(libdevice, name, fn)
            bound.append(name)
    return bound


def peer_inputs(torch, args):
    """(h, w, labels, upstream): the log-prob op's inputs, in bf16 on a GPU; fp16 in the dry
    run, because the interpreter keeps bf16 as raw uint16 and does no bf16 arithmetic (only
    casts to and from fp32): a kernel that multiplies bf16 operands before casting (Cut
    Cross-Entropy's dot products do) computes on the bits, while fp16 is numpy's float16.
    A tenth of the labels are the ignore index (-100), as in a padded batch."""
    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16
    h, w, lab, g = op_inputs(torch, args)
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    lab = lab.clone()
    lab[::10] = -100
    up = torch.randn(args.n, device=args.device, generator=g)
    up[lab == -100] = 0.0
    return h, w, lab, up


def peer_calls(torch, h, w, lab, emit) -> dict:
    """{name: call}: each call returns the log-probs (N,) of ``h @ w.T`` at ``lab`` (0 at the
    ignore index) from ours or a peer, differentiable; a peer whose wheel is absent is left
    out with a ``skipped`` record."""
    import mrtpo_kernels as mk

    calls = {"ours": lambda: mk.linear_logprobs(h, w, lab, backend="triton")}
    try:
        from liger_kernel.transformers import functional as lf

        def liger(**kw):
            def run():
                out = lf.liger_fused_linear_cross_entropy(h, w, lab, reduction="none", **kw)
                return -(out[0] if isinstance(out, tuple) else out)

            return run

        calls["liger_fp32_accum"] = liger(accum_dtype=torch.float32)
        calls["liger_default"] = liger()
    except ImportError as exc:
        emit({"part": "peers", "name": "liger", "skipped": f"Liger-Kernel absent ({exc})"})
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(**kw):
            return lambda: -linear_cross_entropy(h, w, lab, reduction="none", **kw)

        calls["cce_exact"] = cce(**cce_exact_options(linear_cross_entropy))
        calls["cce_default"] = cce()
    except ImportError as exc:
        emit({"part": "peers", "name": "cce", "skipped": f"Cut Cross-Entropy absent ({exc})"})
    return calls


def peer_errors(torch, call, h, w, lab, up, ref) -> dict:
    """One call's log-probs and gradients (of sum up * log p) against the float64 reference
    ``ref`` = (log p, dh, dW): the largest log-prob error and the gradients' relative norm
    errors, the measures bench/gpu_micro.py's correctness part gives ours."""
    lp = call()
    gh, gw = torch.autograd.grad((lp.float() * up).sum(), (h, w))
    rl, rh, rw = ref
    valid = lab != -100
    return {
        "logp_max_err": (lp.double() - rl)[valid].abs().max().item(),
        "dh_rel_err": ((gh.double() - rh).norm() / rh.norm()).item(),
        "dw_rel_err": ((gw.double() - rw).norm() / rw.norm()).item(),
    }


# Peers whose call path the dry run runs once (the float64 check) without timing it.
DRY_RUN_UNTIMED = {
    "cce_default": "its filtered backward takes about 3 minutes a call under the interpreter "
    "(n = 40, V = 3000)",
}

# Gradient bar of the check: the 16-bit rounding of the logits' gradient and of dh / dW
# (ours rounds too) gives relative errors of a few 1e-3; a broken call path gives O(1).
PEER_GRAD_REL_TOL = 2e-2


def part_peers(torch, args, emit):
    from mrtpo_kernels import reference as ref

    bound = interpreter_libdevice()
    if bound:
        emit({"part": "peers", "name": "interpreter", "options": f"libdevice {bound} bound to "
              "tl math (dry run only)"})  # fmt: skip
    if args.device == "cpu":
        # Cut Cross-Entropy's default sorts its logit averages in a torch.compile'd function
        # (fullgraph), which on the CPU builds C++ for minutes: run it eagerly (the same
        # argsort) in the dry run
        torch.compiler.set_stance("force_eager")
    h, w, lab, up = peer_inputs(torch, args)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl = ref.linear_logprobs_ref(h64, w64, lab)
    rh, rw = torch.autograd.grad((rl * up.double()).sum(), (h64, w64))
    reference = (rl.detach(), rh, rw)
    cpu = args.device == "cpu"
    got, grad_ok = {}, {}
    for name, call in peer_calls(torch, h, w, lab, emit).items():
        rec = {"part": "peers", "name": name, "dtype": str(h.dtype).replace("torch.", ""),
               "options": PEER_PRECISION.get(name)}  # fmt: skip

        def step(call=call):
            lp = call()
            lp.backward(up.to(lp.dtype))
            h.grad = w.grad = None

        try:
            rec.update(peer_errors(torch, call, h, w, lab, up, reference))  # also the warm-up
            rec["grad_ok"] = grad_ok[name] = (
                max(rec["dh_rel_err"], rec["dw_rel_err"]) < PEER_GRAD_REL_TOL
            )
            if cpu and name in DRY_RUN_UNTIMED:  # its call path ran once, checked above
                emit({**rec, "skipped": f"not timed in the dry run: {DRY_RUN_UNTIMED[name]}"})
                continue
            mem = 0.0 if cpu else _extra_mb(torch, step)
            # the interpreter: one timing, the checked call above its warm-up
            ms = _elapsed_ms(torch, step) if cpu else _median_ms(torch, step, 3)
        except Exception as exc:  # a peer's API may differ: say so, keep going
            emit({**rec, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        got[name] = (ms, mem)
        vs = ms / got["ours"][0] if "ours" in got else None
        emit({**rec, "ms": ms, "extra_mem_mb": mem, "vs_ours": vs})
    if "ours" not in got:
        return
    verdict = []
    for peer in ("liger_fp32_accum", "cce_exact"):
        if peer not in got:
            verdict.append(f"{peer}: not measured")
            continue
        faster = got["ours"][0] < got[peer][0]
        leaner = got["ours"][1] <= got[peer][1]
        verdict.append(f"{peer}: {'met' if faster and leaner else 'missed'} "
                       f"(time {got['ours'][0] / got[peer][0]:.3f}x, memory "
                       f"{got['ours'][1]:.0f} vs {got[peer][1]:.0f} MB)")  # fmt: skip
    bad = [k for k, ok in grad_ok.items() if not ok]
    verdict.append(f"gradients vs float64 within {PEER_GRAD_REL_TOL:g}: "
                   + (f"not for {', '.join(bad)}" if bad else "all"))  # fmt: skip
    _decide(
        emit,
        "peers",
        {k: [round(a, 3), round(b, 1)] for k, (a, b) in got.items()},
        "; ".join(verdict),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_window", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--part", choices=PARTS, required=True)
    ap.add_argument("--out", required=True, help="JSON-lines file the records are appended to")
    add_shape_args(ap)
    ap.add_argument("--device", default="cuda", help="cpu: the dry run under TRITON_INTERPRET=1")
    ap.add_argument("--rounds", type=int, default=7, help="A/B rounds")
    ap.add_argument("--tag", default="before", help="state: before or after")
    ap.add_argument("--traces", default=None, help="timeline: folder for the chrome traces")
    args = ap.parse_args(argv)
    apply_size_env(args)
    if args.traces is None:
        args.traces = os.path.join(os.path.dirname(os.path.abspath(args.out)), "traces")
    os.makedirs(args.traces, exist_ok=True)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_window: no CUDA device", file=sys.stderr)
        return 2
    fn = globals()[f"part_{args.part}"]
    return run_part(lambda emit: fn(torch, args, emit), args.part, args.out, "window")


if __name__ == "__main__":
    raise SystemExit(main())
