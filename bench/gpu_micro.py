"""Micro-benchmarks of the chunk driver for a GPU window, one part per process.

    python -m bench.gpu_micro --part PART --out figures.jsonl [--n 16384 --d 4096
        --v 151936] [--grad-buffer-mib M] [--chunk-mib M] [--dry-run]

Every figure is appended to ``--out`` (JSON lines) the moment it exists, so a part that is
killed keeps what it measured. Timing is by CUDA events (median of several calls after a
warm-up) and never waits on a correctness check: the ``correctness`` part reports errors
against float64 beside the timings, in its own line. Each timed figure carries the cost
model's prediction (bench/cost_model.py, H200 figures) and the GEMM path the driver takes
(``chunk_plan.gemm_path``: "16-bit, fp32 out" or the "fp32 fallback").

Parts:
    cublas       the GEMMs of the plan at their exact shapes (logits h W^T fp32 out, dh = G W,
                 dW = / += G^T h with K = the gradient buffer's rows), and the plain bf16
                 GEMM of the whole op (N x d x V) for the ceiling
    rows         each Triton row kernel alone on one fp32 logits chunk: stats, grad_ (into a
                 separate 16-bit buffer), policy_, js_many (K = 4)
    ops          linear_policy_loss fwd+bwd, linear_logprobs fwd+bwd and JS one-vs-4 at the
                 target shape with the plan given by --grad-buffer-mib / --chunk-mib (and
                 MRTPO_OVERLAP_ROWS / MRTPO_LOW_MEMORY / MRTPO_ROW_BLOCK from the environment)
    correctness  512 rows at the target V and d, bf16, both ops on backend "triton" against
                 the float64 references
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PARTS = ("cublas", "rows", "rows-sweep", "ops", "correctness")


def emit_record(path: str, record: dict, tag: str = "micro") -> None:
    """Append ``record`` (time-stamped) to the JSON-lines file ``path``, synced at once, and
    print it after ``[tag]`` (bench/gpu_window.py writes its records through this too)."""
    record = {"t": round(time.time(), 1), **record}
    line = json.dumps(record)
    print(f"[{tag}] {line}", flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _time_ms(torch, fn, repeats=5):
    """Median of ``repeats`` calls timed by CUDA events, after one warm-up call (on the CPU,
    where ``--device cpu`` runs the parts' plumbing under the interpreter: wall clock)."""
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _context(chunk_plan, args) -> dict:
    import torch

    return {
        "N": args.n, "d": args.d, "V": args.v,
        "grad_buffer_mib": args.grad_buffer_mib, "chunk_mib": args.chunk_mib,
        "row_block": os.environ.get("MRTPO_ROW_BLOCK") or "default",
        "low_memory": os.environ.get("MRTPO_LOW_MEMORY") or "auto",
        "overlap_rows": os.environ.get("MRTPO_OVERLAP_ROWS") or "0",
        "gemm_path": chunk_plan.gemm_path("triton", args.device, torch.bfloat16),
    }  # fmt: skip


def part_cublas(torch, chunk_plan, cm, args, emit):
    dev, bf = args.device, torch.bfloat16
    n, d, v = args.n, args.d, args.v
    plan = chunk_plan.chunk_plan("linear_policy_loss", n, v, d, grad16=True)
    r = max(g.m for g in plan.gemms if g.stage == "logits")
    b = plan.grad_rows
    h = torch.randn(b, d, device=dev, dtype=bf)
    w = torch.randn(v, d, device=dev, dtype=bf) * d**-0.5
    z = torch.empty(r, v, device=dev)
    g16 = torch.randn(b, v, device=dev, dtype=bf) * 1e-3
    dh = torch.empty(b, d, device=dev, dtype=bf)
    dw = torch.zeros(v, d, device=dev)
    f32 = chunk_plan.f32_out_supported(torch.device(dev), bf)
    shapes = {
        "logits": (chunk_plan.Gemm("logits", r, v, d, False, 2, 4),
                   lambda: chunk_plan.mm_f32(h[:r], w.t(), z)),
        "dh": (chunk_plan.Gemm("dh", b, d, v, False, 2, 2), lambda: torch.mm(g16, w, out=dh)),
        "dw_first": (chunk_plan.Gemm("dw", v, d, b, False, 2, 4),
                     lambda: chunk_plan.mm_f32(g16.t(), h, dw)),
        "dw_accumulate": (chunk_plan.Gemm("dw", v, d, b, True, 2, 4),
                          lambda: chunk_plan.addmm_f32(dw, g16.t(), h)),
    }  # fmt: skip
    for name, (gm, fn) in shapes.items():
        rec = {"part": "cublas", "name": name, "m": gm.m, "n": gm.n, "k": gm.k}
        if not f32:
            emit({**rec, "error": "no 16-bit GEMM with fp32 output on this torch"})
            continue
        ms = _time_ms(torch, fn)
        pred = cm.gemm_time(gm, cm.H200) * 1e3
        emit({**rec, "ms": ms, "tflops": gm.flops / ms / 1e9, "pred_ms": pred})
    hb = torch.randn(n, d, device=dev, dtype=bf)
    ms = _time_ms(torch, lambda: hb @ w.t(), 3)
    emit({"part": "cublas", "name": "full_bf16_gemm", "m": n, "n": v, "k": d, "ms": ms,
          "tflops": 2 * n * d * v / ms / 1e9})  # fmt: skip


def _row_cases(torch, chunk_plan, dev, c, v):
    """The Triton row kernel and its three passes on one chunk of c random rows:
    (kernel, {name: (bytes per element, call)}) (the stats pass reads 4 bytes per element,
    the gradient passes read 8 and write 2)."""
    import mrtpo_kernels as mk

    k = chunk_plan.row_kernel("triton")
    cfg = mk.PolicyLossSettings()
    z = torch.randn(c, v, device=dev) * 2
    lab = torch.randint(0, v, (c,), device=dev)
    one = torch.ones(c, device=dev)
    out16 = torch.empty(c, v, device=dev, dtype=torch.bfloat16)
    _, _, lse = k.stats(z, lab, 1.0, -100, False)
    return k, {
        "stats": (4, lambda: k.stats(z, lab, 1.0, -100, True)),
        "grad": (10, lambda: k.grad_(z, lab, lse, None, one, None, 1.0, -100, out=out16)),
        "policy": (10, lambda: k.policy_(z, lab, one, one, one, None, cfg, True, out=out16)),
    }  # fmt: skip


def part_rows(torch, chunk_plan, cm, args, emit):
    dev = args.device
    v = args.v
    c = chunk_plan.chunk_rows(v)
    k, cases = _row_cases(torch, chunk_plan, dev, c, v)
    for name, (bytes_per, fn) in cases.items():
        ms = _time_ms(torch, fn)
        gb = bytes_per * c * v / 1e9
        pred = cm.row_time(chunk_plan.RowPass(name, c, v, bytes_per), cm.H200) * 1e3
        emit({"part": "rows", "name": name, "rows": c, "ms": ms, "gb_per_s": gb / ms * 1e3,
              "pred_ms": pred})  # fmt: skip
    rows = max(1, c // 5)
    zs = torch.randn(5, rows, v, device=dev)
    ms = _time_ms(torch, lambda: k.js_many(zs, 1.0))
    pred = cm.row_time(chunk_plan.RowPass("js", 5 * rows, v, 8), cm.H200) * 1e3
    emit({"part": "rows", "name": "js_many_k4", "rows": 5 * rows, "ms": ms,
          "gb_per_s": 8 * 5 * rows * v / 1e6 / ms, "pred_ms": pred})  # fmt: skip


def part_rows_sweep(torch, chunk_plan, cm, args, emit):
    """The row kernels of ``part_rows`` (stats, grad, policy) at each columns-per-step block
    and warp count of a small grid, set through MRTPO_ROW_BLOCK (read at each launch). The
    best row, by the three kernels' summed time, is the one to try in ``--part ops``."""
    dev, v = args.device, args.v
    c = chunk_plan.chunk_rows(v)
    if dev == "cpu":  # the plumbing only: a few rows, the interpreter's small blocks
        c, grid = 4, [(256, 4), (512, 4)]
    else:
        grid = [(b, w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]
    _, cases = _row_cases(torch, chunk_plan, dev, c, v)
    before = os.environ.get("MRTPO_ROW_BLOCK")
    try:
        for block, warps in grid:
            os.environ["MRTPO_ROW_BLOCK"] = f"{block},{warps}"
            for name, (bytes_per, fn) in cases.items():
                ms = _time_ms(torch, fn)
                gb_per_s = bytes_per * c * v / 1e6 / ms
                emit({"part": "rows-sweep", "name": name, "rows": c, "block": block,
                      "warps": warps, "ms": ms, "gb_per_s": gb_per_s})  # fmt: skip
    finally:
        if before is None:
            os.environ.pop("MRTPO_ROW_BLOCK", None)
        else:
            os.environ["MRTPO_ROW_BLOCK"] = before


def op_inputs(torch, args):
    """(h, w, labels, generator): bf16 hidden states and weights at ``args``' shape, seeded."""
    dev, bf = args.device, torch.bfloat16
    n, d, v = args.n, args.d, args.v
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, d, device=dev, generator=g).to(bf).requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) * d**-0.5).to(bf).requires_grad_()
    lab = torch.randint(0, v, (n,), device=dev, generator=g)
    return h, w, lab, g


def op_calls(torch, args) -> list[tuple]:
    """[(name, call, K)]: the three ops at ``args``' shape, one call each (bench/gpu_window.py
    times the same calls)."""
    import mrtpo_kernels as mk

    h, w, lab, g = op_inputs(torch, args)
    n, d, dev = args.n, args.d, args.device
    old = torch.full((n,), -12.0, device=dev)
    adv = torch.randn(n, device=dev, generator=g)
    up = torch.randn(n, device=dev, generator=g)
    hq = (h.detach()[None] + 0.3 * torch.randn(4, n, d, device=dev, generator=g)).to(h.dtype)

    def policy():
        loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, backend="triton")
        loss.backward()
        h.grad = w.grad = None

    def logprobs():
        lp = mk.linear_logprobs(h, w, lab, backend="triton")
        lp.backward(up)
        h.grad = w.grad = None

    def js():
        with torch.no_grad():
            mk.linear_js_distance(h.detach(), hq, w.detach(), backend="triton")

    return [("linear_policy_loss_fwd_bwd", policy, 1), ("linear_logprobs_fwd_bwd", logprobs, 1),
            ("linear_js_distance", js, 4)]  # fmt: skip


def part_ops(torch, chunk_plan, cm, args, emit):
    from . import formulas

    dev = args.device
    n, d, v = args.n, args.d, args.v
    ctx = _context(chunk_plan, args)
    for name, fn, k in op_calls(torch, args):
        rec = {"part": "ops", "name": name, **ctx}
        cuda = dev != "cpu"
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            ms = _time_ms(torch, fn, 3)
            extra = torch.cuda.max_memory_allocated() - base if cuda else 0
        except Exception as exc:  # keep going: the next op may run
            emit({**rec, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if cuda:
                torch.cuda.empty_cache()
            continue
        fl = formulas.flops(name, n, d, v, k)
        pred = cm.predicted_ms(name, n, d, v, k, "cuda", "bfloat16")
        emit({**rec, "ms": ms, "tflops": fl / ms / 1e9, "pred_ms": pred,
              "target_tflops": cm.TARGETS.get(name), "extra_mem_mb": extra / 1e6})  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()


def part_correctness(torch, chunk_plan, cm, args, emit):
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as ref

    dev, rows, v, d = args.device, args.rows, args.v, args.d
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, d, device=dev, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) * d**-0.5).bfloat16().requires_grad_()
    lab = torch.randint(0, v, (rows,), device=dev, generator=g)
    lab[::7] = -100
    out = {"part": "correctness", "name": f"bf16_{rows}_rows", **_context(chunk_plan, args)}
    lp, ent = mk.linear_logprobs(h, w, lab, return_entropy=True, backend="triton")
    up = torch.randn(rows, device=dev, generator=g)
    gh, gw = torch.autograd.grad((lp * up).sum() + ent.sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl, re = ref.linear_logprobs_ref(h64, w64, lab, return_entropy=True)
    rh, rw = torch.autograd.grad((rl * up.double()).sum() + re.sum(), (h64, w64))
    out["logp_max_err"] = (lp.double() - rl).abs().max().item()
    out["entropy_max_err"] = (ent.double() - re).abs().max().item()
    out["dh_rel_err"] = ((gh.double() - rh).norm() / rh.norm()).item()
    out["dw_rel_err"] = ((gw.double() - rw).norm() / rw.norm()).item()
    old = rl.detach().float() + 0.2 * torch.randn(rows, device=dev, generator=g)
    adv = torch.randn(rows, device=dev, generator=g)
    loss, _ = mk.linear_policy_loss(h, w, lab, old, adv, backend="triton")
    ph, pw = torch.autograd.grad(loss, (h, w))
    ref_loss = mk.linear_policy_loss(h64, w64, lab, old.double(), adv.double(), backend="torch")[0]
    qh, qw = torch.autograd.grad(ref_loss, (h64, w64))
    out["policy_loss_err"] = abs(loss.item() - ref_loss.item())
    out["policy_dh_rel_err"] = ((ph.double() - qh).norm() / qh.norm()).item()
    out["policy_dw_rel_err"] = ((pw.double() - qw).norm() / qw.norm()).item()
    # bf16 inputs, fp32 math: errors of a few 1e-3 are bf16 rounding of the gradients
    out["ok"] = (
        out["logp_max_err"] < 1e-2
        and out["entropy_max_err"] < 1e-2
        and max(out["dh_rel_err"], out["dw_rel_err"]) < 2e-2
        and max(out["policy_dh_rel_err"], out["policy_dw_rel_err"]) < 2e-2
    )
    emit(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_micro", description=__doc__)
    ap.add_argument("--part", choices=PARTS, required=True)
    ap.add_argument("--out", required=True, help="JSON-lines file the figures are appended to")
    add_shape_args(ap)
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing under TRITON_INTERPRET=1")
    ap.add_argument("--rows", type=int, default=512, help="rows of the correctness part")
    ap.add_argument("--dry-run", action="store_true", help="check imports and arguments only")
    args = ap.parse_args(argv)
    apply_size_env(args)
    import torch

    from mrtpo_kernels import chunk_plan

    from . import cost_model as cm

    if args.dry_run:
        plan = chunk_plan.chunk_plan("linear_policy_loss", args.n, args.v, args.d, grad16=True)
        print(f"gpu_micro: would measure N={args.n} d={args.d} V={args.v} part {args.part} "
              f"into {args.out}; plan: {plan.count()} GEMMs, gradient buffers of "
              f"{plan.grad_rows} rows")  # fmt: skip
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_micro: no CUDA device", file=sys.stderr)
        return 2
    fn = globals()[f"part_{args.part.replace('-', '_')}"]
    return run_part(lambda emit: fn(torch, chunk_plan, cm, args, emit), args.part, args.out)


def add_shape_args(ap) -> None:
    """The shape and buffer flags bench/gpu_micro.py and bench/gpu_window.py share."""
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--grad-buffer-mib", type=int, default=0, help="0: the default")
    ap.add_argument("--chunk-mib", type=int, default=0, help="0: the default")


def apply_size_env(args) -> None:
    """--grad-buffer-mib / --chunk-mib (when not 0) into the MRTPO_* variables the ops read."""
    if args.grad_buffer_mib:
        os.environ["MRTPO_GRAD_BUFFER_BYTES"] = str(args.grad_buffer_mib << 20)
    if args.chunk_mib:
        os.environ["MRTPO_CHUNK_BYTES"] = str(args.chunk_mib << 20)


def run_part(call, part: str, out: str, tag: str = "micro") -> int:
    """Run ``call(emit)`` (emit appends a record to ``out``), timing it: 0 when it returns, 1
    (with an error record) when it raises; the records already written stay."""
    t0 = time.time()

    def emit(rec):
        return emit_record(out, rec, tag)

    try:
        call(emit)
    except Exception as exc:  # report what broke
        emit({"part": part, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return 1
    finally:
        print(f"[{tag}] part {part}: {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
