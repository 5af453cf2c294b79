"""Cost model of the chunk driver: predicted time of each op from its plan.

A plan (``mrtpo_kernels.chunk_plan.chunk_plan``) lists every GEMM the driver issues (shape,
operand and output bytes, whether it accumulates into its output) and every row-kernel
pass (elements, bytes read and written per element). The model times them one after the
other (the driver runs them on one stream):

    GEMM      t = o t_roof + (1 - o) t_serial
              t_roof   = max(F / R', (A + C) / B)      (all traffic hidden under the math)
              t_serial = max(F / R', A / B) + C / B    (the output's traffic after it)
    row pass  t = bytes / (B x e_row) + t_call     (or bytes / a measured rate per kernel)

F is the GEMM's FLOPs, A its operand bytes (each read once), C its output bytes (written,
and read first when it accumulates), R' = R x wave efficiency with R the device's
achievable dense GEMM rate and the wave efficiency tiles / (waves x SMs) of the output
tiled by 128 x 128 (no split-K; 1 where the device has no SM count), B the memory
bandwidth, e_row the fraction of B the row kernels reach, o the share of the output
traffic a GEMM hides under its math (a persistent kernel overlaps a tile's epilogue with
the next tile's main loop), t_call a fixed time per row-kernel call (its chunk's small
kernels, launches and gaps).

Devices:
    H200 (SXM, bf16), refit on the first run (2026-12-04, issue 35): R = 790 TFLOP/s
        (achievable cuBLAS, 787 measured, against a 989 TFLOP/s dense datasheet peak),
        B = 4.25 TB/s (a device copy, measured; the datasheet's 4.8 is not reached), the
        row kernels at their measured rates per kernel (stats 1.40, gradient 2.65, policy
        2.76 TB/s alone; JS 2.8 in the op), the JS plan's GEMMs at their measured floor
        (157 ms: 650 TFLOP/s for the stacked 1300-row fp32-output GEMM, where the formula
        says 135 ms), 0.12 ms per row-kernel call for the chunk's small kernels, launches
        and gaps (fit), 132 SMs, o = 0.5 (the table also shows o = 1 and o = 0). It
        reproduces the run's three ops within 5 % (tests/test_bench_cost_model.py); what
        it predicts for the next window: docs/kernels.md.
    CPU: R measured per GEMM shape of the plan and e_row B measured per row-pass kind, at
        the same shapes; ``cpu_check`` then compares the predicted time of whole ops with
        their measured time (both in bench/cost_model_cpu.py).

Code: the plans and the formulas above are bench/cost_plans.py (no device's figures); this
file adds the H200 figures, the targets, the sweep and the command line.

Plans: "v3" is the driver as it is (``chunk_plan.chunk_plan``: fp32 logits chunks of
MRTPO_CHUNK_BYTES, a 16-bit gradient buffer of MRTPO_GRAD_BUFFER_BYTES, balanced spans,
the first dW GEMM written); "v2" rebuilds the previous plan for comparison (one
MRTPO_CHUNK_BYTES chunk per dh / dW GEMM pair with a tail, dW accumulated into zeros).

    python -m bench.cost_model table        the targets at V = 151936, d = 4096, N = 16384
    python -m bench.cost_model sweep        gradient-buffer sizes (the default's choice)
    python -m bench.cost_model cpu-check    predicted vs measured on this CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from .cost_model_cpu import CPU_BAND, cpu_check
from .cost_plans import (
    PLAN_OPS,
    Device,
    Prediction,
    gemm_time,
    plans_for,
    predict_plans,
    row_time,
    v2_plan,
    wave_efficiency,
)

MiB = 1 << 20
TARGET_SHAPE = dict(n=16384, v=151936, d=4096)
# fwd+bwd TFLOP/s at 6 N d V (JS: (1 + K) 2 N d V, K = 4); extra memory <= 1 GB beyond
# inputs, outputs and the fp32 dW
TARGETS = {
    "linear_policy_loss_fwd_bwd": 700.0,
    "linear_logprobs_fwd_bwd": 550.0,
    "linear_js_distance": 650.0,
}
MEMORY_TARGET = 1e9


# The first H200 run (bench/results/gpu-2026-12-04-h200.md, call 1; issue 35, item 5):
FIRST_RUN_MS = {  # the three ops at the target shape (call 1: the median of the 3 calls)
    "linear_policy_loss_fwd_bwd": 101.7,
    "linear_logprobs_fwd_bwd": 140.1,
    "linear_js_distance": 192.5,
}
JS_GEMM_FLOOR_MS = 157.0  # the JS plan's GEMMs alone (gemm-floor provider), K = 4
JS_FLOPS = 2 * (1 + 4) * 16384 * 4096 * 151936  # (1 + K) 2 N d V

H200 = Device(
    "H200 SXM, bf16 (refit on the first run)",
    gemm_flops=790e12,  # achievable cuBLAS (787 measured, 8192 cube)
    bandwidth=4.25e12,  # device copy, measured (4246 GB/s; the datasheet's 4.8 is not reached)
    row_efficiency=0.85,  # stages without a measured rate below
    sms=132,
    peak_flops=989e12,
    overlap=0.5,
    # each Triton row kernel alone on a 441-row chunk, CUDA events (launch included); JS:
    # the op's 192.5 - 157 ms leaves at most 35.5 ms for its 99.6 GB, so in the op it runs
    # at >= 2.8 TB/s, faster than the 2.07 measured alone on 440 rows (not its 1300); the
    # column kernel (low-memory mode) and the kept-rows copy are not measured: the gradient
    # kernel's rate and the copy bandwidth
    row_rates={
        "stats": 1.40e12,
        "grad": 2.65e12,
        "policy": 2.76e12,
        "js": 2.8e12,
        "cols": 2.65e12,
        "copy kept": 4.25e12,
    },  # fmt: skip
    op_gemm_flops={"linear_js_distance": JS_FLOPS / (JS_GEMM_FLOOR_MS * 1e-3)},  # 650 TFLOP/s
    row_call_s=0.12e-3,  # fit: per row-kernel call, the chunk's small kernels and gaps
)


def predict(bench_op, n, v, d, k=4, dev: Device = H200, *, version="v3", grad16=True):
    plans = plans_for(bench_op, n, v, d, k, version=version, grad16=grad16)
    return predict_plans(bench_op, plans, n, v, d, k, dev)


def predicted_ms(bench_op, n, d, v, k, device_type: str, dtype: str) -> float | None:
    """The prediction a benchmark row carries: the H200 model for CUDA rows of the chunk
    driver's ops (16-bit plan for 16-bit inputs); None for ops it does not model and for
    CPU rows (the CPU has no fixed rates: ``cpu_check`` measures them)."""
    if device_type != "cuda" or (bench_op not in PLAN_OPS and bench_op != "credit_assignment_step"):
        return None
    grad16 = dtype in ("bfloat16", "float16")
    return predict(bench_op, n, v, d, max(k, 1), H200, grad16=grad16).total_s * 1e3


# --------------------------------------------------------------------------- targets


def target_rows(dev: Device = H200) -> list[dict]:
    """Old and new plan at the targets' shape: predicted ms, TFLOP/s, buffer memory."""
    n, v, d = TARGET_SHAPE["n"], TARGET_SHAPE["v"], TARGET_SHAPE["d"]
    rows = []
    for op, target in TARGETS.items():
        k = 4 if op == "linear_js_distance" else 1
        for version in ("v2", "v3"):
            p = predict(op, n, v, d, k, dev, version=version)
            hi = predict(op, n, v, d, k, replace(dev, overlap=1.0), version=version)
            lo = predict(op, n, v, d, k, replace(dev, overlap=0.0), version=version)
            rows.append(
                dict(
                    op=op, plan=version, gemms=p.gemms, gemm_ms=p.gemm_s * 1e3,
                    row_ms=p.row_s * 1e3, ms=p.total_s * 1e3, tflops=p.tflops,
                    tflops_range=f"{lo.tflops:.0f}-{hi.tflops:.0f}", target=target,
                    met=p.tflops >= target and p.buffer_bytes <= MEMORY_TARGET,
                    buffer_mb=p.buffer_bytes / 1e6,
                )
            )  # fmt: skip
    return rows


def gemm_rows(dev: Device = H200, version: str = "v3") -> list[dict]:
    """Per GEMM shape of the policy loss at the target shape: count, FLOP/byte, time."""
    n, v, d = TARGET_SHAPE["n"], TARGET_SHAPE["v"], TARGET_SHAPE["d"]
    (plan,) = plans_for("linear_policy_loss_fwd_bwd", n, v, d, version=version)
    shapes: dict[tuple, list] = {}
    for g in plan.gemms:
        shapes.setdefault((g.stage, g.m, g.n, g.k, g.accumulate), []).append(g)
    out = []
    for (stage, m, nn, kk, acc), gs in shapes.items():
        g = gs[0]
        out.append(
            dict(
                stage=stage, m=m, n=nn, k=kk, accumulate=acc, count=len(gs),
                flop_per_byte=g.flops / g.bytes, ms_each=gemm_time(g, dev) * 1e3,
                bound="memory" if g.bytes / dev.bandwidth > g.flops / dev.gemm_flops
                else "compute",
            )
        )  # fmt: skip
    return out


def sweep(dev: Device = H200, steps_mib=range(128, 1025, 32)) -> list[dict]:
    """MRTPO_GRAD_BUFFER_BYTES from 128 MiB to 1 GiB at the target shape: predicted time of
    the policy loss and log-probs fwd+bwd, and the larger of their buffer memories."""
    n, v, d = TARGET_SHAPE["n"], TARGET_SHAPE["v"], TARGET_SHAPE["d"]
    saved = os.environ.get("MRTPO_GRAD_BUFFER_BYTES")
    out = []
    try:
        for mib in steps_mib:
            os.environ["MRTPO_GRAD_BUFFER_BYTES"] = str(mib * MiB)
            pol = predict("linear_policy_loss_fwd_bwd", n, v, d, 1, dev)
            lp = predict("linear_logprobs_fwd_bwd", n, v, d, 1, dev)
            (plan,) = plans_for("linear_policy_loss_fwd_bwd", n, v, d)
            out.append(
                dict(
                    grad_buffer_mib=mib, grad_rows=plan.grad_rows,
                    ms=(pol.total_s + lp.total_s) * 1e3, policy_tflops=pol.tflops,
                    logprobs_tflops=lp.tflops,
                    buffer_mb=max(pol.buffer_bytes, lp.buffer_bytes) / 1e6,
                )
            )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("MRTPO_GRAD_BUFFER_BYTES", None)
        else:
            os.environ["MRTPO_GRAD_BUFFER_BYTES"] = saved
    return out


def choose_grad_buffer(dev: Device = H200) -> int:
    """The default of MRTPO_GRAD_BUFFER_BYTES: the smallest size of the sweep whose
    predicted time is within 0.5% of the best one inside the memory target."""
    rows = [r for r in sweep(dev) if r["buffer_mb"] * 1e6 <= MEMORY_TARGET]
    best = min(r["ms"] for r in rows)
    return min(r["grad_buffer_mib"] for r in rows if r["ms"] <= best * 1.005) * MiB


# --------------------------------------------------------------------------- output


def _md(rows: list[dict], cols: list[str]) -> str:
    def f(x):
        if isinstance(x, float):
            return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost_model", description=__doc__)
    ap.add_argument("what", choices=("table", "sweep", "cpu-check"))
    ap.add_argument("--json", action="store_true", help="JSON lines instead of Markdown")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.what == "table":
        rows = target_rows()
        cols = ["op", "plan", "gemms", "gemm_ms", "row_ms", "ms", "tflops", "tflops_range",
                "target", "buffer_mb", "met"]  # fmt: skip
        extra = gemm_rows(H200, "v2") + gemm_rows(H200, "v3")
        gcols = ["stage", "m", "n", "k", "accumulate", "count", "flop_per_byte", "ms_each",
                 "bound"]  # fmt: skip
    elif args.what == "sweep":
        rows, extra = sweep(), []
        cols = ["grad_buffer_mib", "grad_rows", "ms", "policy_tflops", "logprobs_tflops",
                "buffer_mb"]  # fmt: skip
    else:
        rows, extra = cpu_check(args.repeats), []
        cols = ["op", "backend", "N", "V", "d", "K", "gemms", "predicted_ms", "gemm_ms",
                "row_ms", "measured_ms", "ratio", "in_band", "load"]  # fmt: skip
    if args.json:
        for r in rows + extra:
            print(json.dumps(r))
        return 0
    print(_md(rows, cols))
    if extra:
        print()
        print(_md(extra, gcols))
    if args.what == "cpu-check":
        print(f"\nband: measured / predicted in [{CPU_BAND[0]}, {CPU_BAND[1]}]")
        return 0 if all(r["in_band"] for r in rows) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "H200",
    "Device",
    "Prediction",
    "choose_grad_buffer",
    "gemm_time",
    "predict",
    "predicted_ms",
    "row_time",
    "sweep",
    "target_rows",
    "v2_plan",
    "wave_efficiency",
]
