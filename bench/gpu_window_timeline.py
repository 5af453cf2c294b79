"""The GPU window's ``timeline`` part (bench/gpu_window.py): torch.profiler over one call
per op, at the defaults and with MRTPO_OVERLAP_ROWS=1, the kernels sorted into GEMM, row
kernels and small kernels, and the idle time between them (the op's kernel span less the
union of kernel intervals), against the timeline rule (gpu_window_common.THRESHOLDS).
"""

from __future__ import annotations

import json
import os
import re

from .gpu_window_common import CONFIGS, _decide, _elapsed_ms, _Env, _ops, _sync

GEMM_NAMES = re.compile(r"gemm|nvjet|xmma|cutlass|splitk", re.IGNORECASE)
ROW_NAMES = re.compile(
    r"_stats_rows|_stats_split|_grad_rows|_policy_rows|_row_norm|_js_rows_sum|_js_finish"
    r"|_grad_cols|_policy_terms"
)
CPU_GEMM_NAMES = re.compile(r"^aten::(mm|addmm|matmul|bmm)$")


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
