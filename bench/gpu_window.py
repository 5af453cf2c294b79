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

Here the command and the parts that time our own ops (state, ab, cublas, rows); the
timeline in bench/gpu_window_timeline.py, the peers in bench/gpu_window_peers.py, what
every part shares (the rules, the A/B arms, the timers) in bench/gpu_window_common.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from .gpu_micro import add_shape_args, apply_size_env, run_part
from .gpu_window_common import (
    CONFIGS,
    THRESHOLDS,
    _decide,
    _elapsed_ms,
    _Env,
    _extra_mb,
    _median_ms,
    _ops,
    _sync,
)
from .gpu_window_peers import PEER_WHEELS, part_peers
from .gpu_window_timeline import part_timeline

# THRESHOLDS (the rules, quoted in bench/gpu_window.sh's header) and PEER_WHEELS (the
# peers' pins, read by bench/peer_wheels.sh) live with the code that applies them and are
# named here, the window's command, as the scripts read them.
__all__ = ["PARTS", "PEER_WHEELS", "THRESHOLDS", "main"]

PARTS = ("state", "timeline", "ab", "cublas", "rows", "peers")

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
    fn = {
        "state": part_state,
        "timeline": part_timeline,
        "ab": part_ab,
        "cublas": part_cublas,
        "rows": part_rows,
        "peers": part_peers,
    }[args.part]
    return run_part(lambda emit: fn(torch, args, emit), args.part, args.out, "window")


if __name__ == "__main__":
    raise SystemExit(main())
